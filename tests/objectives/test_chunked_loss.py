"""The causal-LM loss over chunks of tokens (`objectives/chunked.py`): Hugging Face's loss and every
gradient to float noise, with the head never seeing more than a chunk's tokens; the auto rule;
and the dry run's peak that no longer grows with the vocabulary at 8,192 tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from relaytrain.cost.formulas import ModelFacts
from relaytrain.models import family_spec
from relaytrain.models.layered import MicroBatch
from relaytrain.objectives import objective
from relaytrain.objectives.chunked import Chunking, auto_chunk_tokens
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_LLAMA, train_plain_loop
from tests.models.equality import assert_layered_equals_hf, padded_batch
from tests.models.test_type_survey import VOCAB, tiny_config
from tests.objectives.test_objectives import SequenceMargin
from tests.strategies.test_fsdp import assert_same, saved_model

DECODER = family_spec("decoder")
GiB = 2**30
CHUNK = 5  # 2 rows of 11 predicted tokens: four whole chunks and a short one


def _layered(model_type: str, chunk: int | str = CHUNK, **extra):
    """A tiny Hugging Face causal LM of `model_type` (its extra scalars far from the identity) and
    the layered model over it, its loss cut into chunks of `chunk` tokens."""
    config = tiny_config(model_type)
    for key, value in extra.items():
        setattr(config, key, value)
    DECODER.set_dropout(config, 0.0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=DECODER.attention(config, "sdpa"))
    reference.train()
    model = DECODER.layered(reference, objective("causal_lm"))
    model.loss_chunks = dataclasses.replace(model.loss_chunks, setting=chunk)
    return model, reference


def _rows_the_head_saw(model) -> list[int]:
    """Records the tokens every call of the LM head computes logits for (a call on a whole [batch,
    seq, width] sequence counts them all)."""
    seen: list[int] = []
    model.head.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    return seen


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {}),
    ("gemma2", {"tie_word_embeddings": True}),  # soft-capping 3, tied embeddings
    ("granite", {}),  # embeddings x 12, logits / 8
    ("cohere", {}),  # logits x 1/16, tied embeddings
])
def test_the_chunked_loss_is_hugging_face_s_loss_and_every_gradient(model_type, extra):
    model, reference = _layered(model_type, **extra)
    seen = _rows_the_head_saw(model)
    ids, mask, labels = padded_batch(rows=2, length=12, vocab=VOCAB)
    assert_layered_equals_hf(model, reference, ids, mask, labels, what=model_type)
    ours = seen[:-1]  # the last call is Hugging Face's own forward, on its whole sequence
    assert max(ours) <= CHUNK and sum(ours) == 2 * 11  # every predicting token once: its gradients taken in the forward


def test_gpt2_s_tied_head_chunked_is_hugging_face_s():
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).train()
    model = family_spec("gpt2").layered(reference, objective("causal_lm"))
    model.loss_chunks = dataclasses.replace(model.loss_chunks, setting=CHUNK)
    seen = _rows_the_head_saw(model)
    ids, mask, labels = padded_batch(rows=2, length=12, vocab=VOCAB)
    assert_layered_equals_hf(model, reference, ids, mask, labels, what="gpt2")
    assert max(seen[:-1]) <= CHUNK and sum(seen[:-1]) == 2 * 11


def _losses_then_gradients(model, mbs: list[MicroBatch]):
    """Every micro-batch's loss first, then one backward through them all, as GPipe's last stage
    runs them: the first loss takes its gradients in its forward, the others wait and recompute."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum(model(mb) for mb in mbs)
    return loss, torch.autograd.grad(loss, params)


def _two_micro_batches() -> list[MicroBatch]:
    batches = [padded_batch(rows=2, length=12, vocab=VOCAB, seed=seed) for seed in (0, 1)]
    return [MicroBatch(ids, labels, mask) for ids, mask, labels in batches]


def test_losses_whose_backward_waits_recompute_their_chunks_and_equal_the_whole_sequence_s():
    """A second loss forward before the first one's backward keeps only the head's input (no
    second set of weight gradients waits) and computes its chunks again in its backward."""
    mbs = _two_micro_batches()
    chunked, _ = _layered("llama", CHUNK)
    seen = _rows_the_head_saw(chunked)
    loss, grads = _losses_then_gradients(chunked, mbs)
    whole_loss, whole_grads = _losses_then_gradients(_layered("llama", 0)[0], mbs)
    assert max(seen) <= CHUNK and sum(seen) == 2 * 11 + 2 * 2 * 11  # the first once, the second twice
    torch.testing.assert_close(loss, whole_loss)
    for ours, theirs in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_loss_inside_a_checkpointed_stage_recomputes_its_chunks_and_equals_the_whole_sequence_s():
    """A pipeline stage recomputed in its backward (`strategy.recompute=stage`) runs the loss under
    torch.utils.checkpoint, whose recompute must save what the forward saved: such a loss keeps
    its input, whether or not another loss waits, and computes its chunks again in its backward."""
    mbs = _two_micro_batches()
    grads = {}
    for chunk in (0, CHUNK):
        model, _ = _layered("llama", chunk)
        params = [p for p in model.parameters() if p.requires_grad]
        losses = [checkpoint(model, mb, use_reentrant=False) for mb in mbs]  # the second's forward: the first waits
        each = [torch.autograd.grad(loss, params) for loss in losses]  # the first's backward, then the second's
        grads[chunk] = (sum(losses), [sum(pair) for pair in zip(*each, strict=True)])
    torch.testing.assert_close(grads[CHUNK][0], grads[0][0])
    for ours, theirs in zip(grads[CHUNK][1], grads[0][1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_under_autocast_the_chunks_take_their_gradients_in_the_forward_s_precision():
    """Both ways run at the forward's autocast: the gradients taken in the forward under it, and
    the recompute of a loss that waited, which enters it again (the backward runs without it), so
    the chunked gradients are the whole-sequence ones at bf16's precision, not fp32's other values."""
    mbs = _two_micro_batches()
    grads = {}
    for chunk in (0, CHUNK):
        model, _ = _layered("llama", chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads[chunk] = _losses_then_gradients(model, mbs)
    torch.testing.assert_close(grads[CHUNK][0], grads[0][0], rtol=2e-2, atol=2e-2)
    for chunked, whole in zip(grads[CHUNK][1], grads[0][1], strict=True):
        torch.testing.assert_close(chunked, whole, rtol=5e-2, atol=5e-3)


def test_evaluation_sums_by_chunks_equal_the_whole_sequence_s():
    ids, mask, labels = padded_batch(rows=2, length=12, vocab=VOCAB)
    mb = MicroBatch(ids, labels, mask)
    stats = {}
    for chunk in (0, CHUNK):
        model, _ = _layered("llama", chunk)
        with torch.no_grad():
            hidden = model.embed_input(ids)
            ctx = model.context(mb, hidden)
            for block in model.blocks:
                hidden = block(hidden, ctx)
            stats[chunk] = model.eval_stats(hidden, mb).sums
    torch.testing.assert_close(stats[CHUNK], stats[0])


def test_an_objective_with_a_loss_of_its_own_gets_the_whole_logits():
    model, _ = _layered("llama", CHUNK)
    hidden = torch.zeros(2, 12, 32)
    assert objective("causal_lm").chunk_tokens(model.head, hidden, model.loss_chunks) == CHUNK
    assert objective(SequenceMargin.name).chunk_tokens(model.head, hidden, model.loss_chunks) == 0


def test_auto_chunks_where_the_whole_sequence_s_logits_would_take_more():
    llama3 = Chunking(vocab=128_256)
    assert auto_chunk_tokens(128_256) == 523  # 256 MiB of fp32 logits
    assert llama3.tokens(8192, 128_256 * 4096) == 523  # 12 GiB of logits against 0.8 GiB and a weight gradient
    assert llama3.tokens(1024, 128_256 * 4096) == 0  # the second weight gradient would cost more than it saves
    assert llama3.tokens(1024, 0) == 523  # a frozen head (adapters) has none
    assert Chunking(vocab=300).tokens(4096, 9600) == 0  # a tiny vocabulary's logits fit one chunk
    assert Chunking("0", 128_256).tokens(8192, 0) == 0 and Chunking("64", 300).tokens(100, 0) == 64
    assert Chunking("64", 300).tokens(64, 0) == 0  # one chunk is the whole


def test_a_chunk_setting_that_is_not_one_is_refused_in_one_line():
    from relaytrain.run.compose import validate

    with pytest.raises(ConfigError) as err:
        validate(compose_config(["model=llama_tiny", "model.loss_chunk_tokens=half"]))
    assert "\n" not in str(err.value) and "model.loss_chunk_tokens=half" in str(err.value)


# --------------------------------------------------------------------------- the dry run


def _long_sequence(strategy: str, vocab: int, *extra: str):
    return compose_config(["model=llama_tiny", f"strategy={strategy}", "model.num_layers=2", "model.hidden_size=64",
                           "model.intermediate_size=128", "model.num_heads=4", "model.num_kv_heads=2",
                           f"model.vocab_size={vocab}", "model.max_seq_len=8192", "data.seq_len=8192",
                           "data.num_samples=4", "strategy.microbatch_size=1", "strategy.num_microbatches=1", *extra])


@pytest.mark.parametrize("strategy", ["baseline", "l2l"])
def test_a_dry_run_at_8192_tokens_grows_by_less_than_2_gib_from_a_32k_to_a_256k_vocabulary(strategy):
    """The whole sequence's logits alone would grow by 7 GiB (8,192 x 224 k fp32 values), three times
    over at the loss's peak; chunked, only the embeddings, the head and their optimizer state grow.
    The closed form counts the same, within a tenth of the dry run (two steps: AdamW's state exists)."""
    peaks = {}
    for vocab in (32_768, 262_144):
        cfg = _long_sequence(strategy, vocab)
        peaks[vocab] = simulate(cfg, steps=2).peak_bytes
        closed = strategy_class(strategy).cost_model.device_bytes(cfg, ModelFacts.of(cfg))
        assert 0.9 <= closed / peaks[vocab] <= 1.1, (vocab, closed / GiB, peaks[vocab] / GiB)
    assert 0 < peaks[262_144] - peaks[32_768] < 2 * GiB


def test_the_closed_form_of_the_whole_sequence_s_logits_still_grows_with_the_vocabulary():
    whole = {vocab: ModelFacts.of(_long_sequence("baseline", vocab, "model.loss_chunk_tokens=0"))
             for vocab in (32_768, 262_144)}
    assert whole[262_144].head_activation_bytes(1) - whole[32_768].head_activation_bytes(1) == 3 * 7 * GiB  # 8,192 x 224 k fp32 values, three copies


# --------------------------------------------------------------------------- under the strategies


def _strategy_cfg(strategy: str, chunk: str, *extra: str):
    return compose_config([*TINY_LLAMA, f"strategy={strategy}", "train.steps=2", "train.untimed_steps=0",
                           "train.save_model=true", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
                           f"model.loss_chunk_tokens={chunk}", *extra])


@pytest.mark.slow  # each a whole run and its reference: 15 to 35 s; `test_l2l_s_turn...` below is the default's
@pytest.mark.parametrize(("strategy", "extra", "against"), [
    ("l2l", [], "plain loop"),  # the relay's device copies, swapped in only while the head's forward runs
    ("pipe_flush", [], "plain loop"),  # the last stage's head
    ("fsdp", [], "whole"),  # the root's gathered parameters, two workers
    ("pipe_gpipe", ["strategy.recompute=stage"], "plain loop"),  # every loss waits; each stage checkpointed
])
def test_a_strategy_with_the_loss_in_chunks_trains_the_whole_sequence_s_weights(strategy, extra, against, tmp_path):
    """Chunks of 7 tokens over 2 x 15 predicted ones a micro-batch, against the plain loop with the
    whole sequence's logits, or the same strategy with them."""
    cfg = _strategy_cfg(strategy, "7", *extra)
    run(cfg, tmp_path / "run")
    whole = _strategy_cfg(strategy, "0", *extra)
    if against == "plain loop":
        reference = train_plain_loop(whole, 2).hf_model
    else:
        run(whole, tmp_path / "whole")
        reference = saved_model(whole, tmp_path / "whole")
    assert_same(saved_model(cfg, tmp_path / "run"), reference)


def test_l2l_s_turn_around_puts_the_chunked_gradients_on_the_relayed_copies():
    """L2L runs the head in a functional call on device copies of its weights and backpropagates
    after the call has returned (`l2l.L2L._turnaround`): the recompute must use those copies, not
    the module's own weights, and their gradients must be the whole sequence's."""
    from torch.func import functional_call

    from relaytrain.strategies.l2l import HeadLoss

    model, _ = _layered("llama", CHUNK)
    part = HeadLoss(model)
    ids, mask, labels = padded_batch(rows=2, length=12, vocab=VOCAB)
    mb = MicroBatch(ids, labels, mask)
    hidden = torch.randn(2, 12, 32)
    grads = {}
    for chunk in (CHUNK, 0):
        model.loss_chunks = dataclasses.replace(model.loss_chunks, setting=chunk)
        copies = {name: p.detach().clone().requires_grad_(True) for name, p in part.named_parameters()}
        x = hidden.clone().requires_grad_(True)
        loss = functional_call(part, copies, (x, mb)).total
        loss.backward()  # outside the functional call, as the relay does
        grads[chunk] = (loss.detach(), x.grad, {name: t.grad for name, t in copies.items()})
    assert all(p.grad is None for p in part.parameters())  # the module's own weights got nothing
    torch.testing.assert_close(grads[CHUNK][0], grads[0][0])
    torch.testing.assert_close(grads[CHUNK][1], grads[0][1])
    for name, grad in grads[0][2].items():
        torch.testing.assert_close(grads[CHUNK][2][name], grad, msg=name)
