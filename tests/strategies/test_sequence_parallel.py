"""Sequence parallelism: `strategy.sequence_parallel=S` on real gloo process groups.

S workers share every sequence (R x S with replicas), an all-to-all around attention giving each
whole sequences for its share of the heads: the weights equal the plain loop's over the unsplit
minibatch to float noise, with a sliding window that crosses the cut, with keyed dropout (each
token's mask as the unsplit run draws it), with packed records, padding and replicas; what is not
supported yet is refused in one line before any worker starts.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from relaytrain.commands.cli import main
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.models.layered import MicroBatch
from relaytrain.models.pretrained import resolve as resolve_pretrained
from relaytrain.planner.dryrun import simulate
from relaytrain.records import checkpoint
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.step.evaluation import IGNORE_INDEX
from relaytrain.strategies import strategy_class
from relaytrain.strategies.sequence_parallel import (
    SequenceCut,
    SequenceSplit,
    install,
    own_tokens,
    whole_sequence,
)
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder
from tests.conftest import tiny_cfg, train_plain_loop
from tests.strategies.test_baseline_replicas import saved_model

STEPS = 3
# Sequences of 16 tokens cut in two at token 8; Mistral's window of 6 reaches across the cut.
MISTRAL_WINDOW = ["model.model_type=mistral", "model.sliding_window=6"]


# Adam's eps 1e-4, as tests/test_decoders.py explains: with a smaller one a nearly zero gradient (a
# token seen once) summed in another order (two workers) turns float noise into a step of its own.
def cut_cfg(*overrides: str, size: int = 2, strategy: str = "baseline"):
    return tiny_cfg("llama", f"strategy={strategy}", f"strategy.sequence_parallel={size}", f"train.steps={STEPS}",
                    "train.save_model=true", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
                    "strategy.timeout_s=60", "optim.lr=0.01", "optim.eps=1e-4", *overrides)


def uncut(cfg):
    """The same run in one process over whole sequences (micro-batches R times larger: every
    replica's rows, which `train_plain_loop(..., replicas=R)` keys as the replicas do)."""
    whole = copy.deepcopy(cfg)
    OmegaConf.update(whole, "strategy.sequence_parallel", 1)
    OmegaConf.update(whole, "strategy.replicas", 1)
    OmegaConf.update(whole, "strategy.microbatch_size", cfg.strategy.microbatch_size * cfg.strategy.replicas)
    return whole


def assert_trains_as_the_plain_loop(cfg, run_dir) -> dict:
    results = run(cfg, run_dir, table=False)
    reference = train_plain_loop(uncut(cfg), STEPS, replicas=cfg.strategy.replicas).hf_model
    for (name, ours), (_, theirs) in zip(saved_model(cfg, run_dir).named_parameters(), reference.named_parameters(),
                                         strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4, msg=lambda why, name=name: f"{name}: {why}")
    return results


DROPOUT = ["model.dropout=0.2"]


@pytest.mark.parametrize(("strategy", "overrides"), [
    pytest.param("baseline", MISTRAL_WINDOW, id="baseline-window-across-the-cut"),
    pytest.param("l2l", [*MISTRAL_WINDOW, *DROPOUT], id="l2l-window-and-dropout"),
    pytest.param("baseline", DROPOUT, id="baseline-dropout", marks=pytest.mark.slow),
    pytest.param("l2l", MISTRAL_WINDOW, id="l2l-window", marks=pytest.mark.slow),
    pytest.param("baseline", [*MISTRAL_WINDOW, *DROPOUT, "strategy.recompute=block", "model.attn_implementation=eager"],
                 id="baseline-window-dropout-recompute-eager", marks=pytest.mark.slow),
    pytest.param("baseline", ["data.seq_len=15"], id="baseline-padded-to-a-multiple", marks=pytest.mark.slow),
    pytest.param("baseline", ["strategy.replicas=2", *DROPOUT], id="baseline-two-replicas-of-two",
                 marks=pytest.mark.slow),
    pytest.param("l2l", ["strategy.replicas=2", *MISTRAL_WINDOW, *DROPOUT], id="l2l-two-replicas-of-two",
                 marks=pytest.mark.slow),
    pytest.param("fsdp", ["strategy.replicas=2", *MISTRAL_WINDOW], id="fsdp-two-replicas-of-two",
                 marks=pytest.mark.slow),
    pytest.param("fsdp", ["strategy.replicas=2", *MISTRAL_WINDOW, *DROPOUT, "strategy.recompute=block"],
                 id="fsdp-two-replicas-of-two-dropout-recompute", marks=pytest.mark.slow),
])
def test_a_cut_sequence_trains_to_the_plain_loops_weights(strategy, overrides, tmp_path):
    cfg = cut_cfg(*overrides, strategy=strategy)
    results = assert_trains_as_the_plain_loop(cfg, tmp_path / "cut")
    assert results["processes"] == cfg.strategy.replicas * 2 and results["replicas"] == cfg.strategy.replicas


def packed_chat(tmp_path, seq_len: int, *overrides: str, strategy: str = "baseline", window: int | None = None):
    """A cut run's config over chat records of unequal length packed into rows of `seq_len`, from
    a Llama checkpoint, or a Mistral one whose every layer slides over `window` tokens."""
    kind = {"model_type": "mistral", "sliding_window": window} if window else {"model_type": "llama"}
    pretrained = tiny_decoder(tmp_path / "ckpt", **kind)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(
        f'{{"messages": [{{"role": "user", "content": "{i}?"}}, '
        f'{{"role": "assistant", "content": "fox {"jumps " * (i % 3)}{i}"}}]}}\n' for i in range(32)))
    keys = [f"model.pretrained={pretrained}", "data=chat", f"data.path={chat}", "data.pack=true",
            f"data.seq_len={seq_len}", "train.untimed_steps=0", *overrides]
    return resolve_pretrained(cut_cfg(*keys, strategy=strategy))  # the checkpoint's own keys written in, as `train.run` does


def records(positions: torch.Tensor) -> list[tuple[int, int]]:
    """A packed row's segments (start, end): its records, and its unused tail if it has one."""
    starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(positions)]
    return list(itertools.pairwise(starts))


def hugging_face_on_each_record(cfg, minibatch: list[MicroBatch]) -> float:
    """The minibatch's mean loss with Hugging Face's model run on each packed record alone."""
    model = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, dtype=torch.float32).eval()
    total, items = 0.0, 0
    for mb in minibatch:
        for ids, labels, positions in zip(mb.input_ids, mb.labels, mb.position_ids, strict=True):
            for start, end in records(positions):
                record = labels[start:end].unsqueeze(0)
                count = int((record[:, 1:] != IGNORE_INDEX).sum())
                if count:  # a row's unused tail is a segment of its own, unlabelled
                    with torch.no_grad():
                        loss = model(input_ids=ids[start:end].unsqueeze(0), labels=record).loss
                    total, items = total + float(loss) * count, items + count
    return total / items


@pytest.mark.parametrize(("seq_len", "strategy", "window"), [
    pytest.param(63, "baseline", None, id="63-tokens-padded-to-64-baseline"),
    pytest.param(63, "l2l", None, id="63-tokens-padded-to-64-l2l", marks=pytest.mark.slow),
    pytest.param(63, "fsdp", None, id="63-tokens-padded-to-64-fsdp", marks=pytest.mark.slow),
    pytest.param(64, "baseline", 6, id="64-tokens-window-across-the-cut-baseline", marks=pytest.mark.slow),
])
def test_packed_chat_records_keep_apart_across_the_cut(seq_len, strategy, window, tmp_path):
    """Records packed into a row see nothing of each other whether or not the cut has to pad the
    row (63 tokens over two workers: one padding token): the first step's loss is Hugging Face's
    on each record alone, and the run ends on the unsplit plain loop's weights. (Full attention:
    a window of 6 would keep a record's replies from the one before it anyway.)"""
    cfg = packed_chat(tmp_path, seq_len, strategy=strategy, window=window)
    first = next(build_loader(uncut(cfg), build_dataset(cfg)))
    assert all(mb.attention_mask is None for mb in first)
    # Rows hold two records or more, and one record reaches across the cut at token 32.
    assert all(len(records(mb.position_ids[0])) > 2 for mb in first)
    assert (first[0].position_ids[:, 32] > 0).any()
    results = assert_trains_as_the_plain_loop(cfg, tmp_path / "cut")
    assert results["loss"][0] == pytest.approx(hugging_face_on_each_record(cfg, first), rel=1e-6)


def test_the_all_to_all_layout_round_trips_without_a_group():
    """A dry run moves nothing: the layouts alone, which must invert each other."""
    x = torch.randn(2, 4, 3, 5)  # batch, heads, tokens of this worker, dim
    cut = SequenceCut(size=2, part=0)
    whole = whole_sequence(x, cut)
    assert whole.shape == (2, 2, 6, 5)
    back = own_tokens(whole.transpose(1, 2), cut)  # the kernels' output layout: batch, tokens, heads, dim
    assert torch.equal(back, x.transpose(1, 2))


@pytest.mark.parametrize(("strategy", "overrides", "refusal"), [
    ("baseline", [], "must divide the attention heads \\(4\\) and the key/value heads \\(2\\)"),
    ("fsdp", [], "must divide the attention heads"),
    ("l2l", [], "must divide the attention heads"),
    ("baseline", ["train.compile=true"], "train.compile=true is not supported yet"),
])
def test_what_cannot_be_cut_yet_is_refused_in_one_line(strategy, overrides, refusal):
    cfg = cut_cfg(*overrides, size=4, strategy=strategy)  # 4 workers: more than the 2 key/value heads
    with pytest.raises(ConfigError, match=refusal) as refused:
        strategy_class(cfg.strategy.name).check_config(cfg)
    assert "\n" not in str(refused.value)


def test_other_families_and_zero_workers_are_refused():
    bert = tiny_cfg("bert", "strategy=baseline", "strategy.sequence_parallel=2")
    with pytest.raises(ConfigError, match="model.family=decoder only so far, not model.family=bert"):
        strategy_class("baseline").check_config(bert)
    with pytest.raises(ConfigError, match="strategy.sequence_parallel=0 must be at least 1"):
        strategy_class("baseline").check_config(cut_cfg(size=0))


def test_a_strategy_without_the_key_refuses_it_in_one_line(capsys):
    try:
        code = main(["train", "strategy=pipe_flush", "strategy.sequence_parallel=2"])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "strategy.sequence_parallel is not a key of strategy=pipe_flush" in err[0]


def test_the_dry_run_holds_a_share_of_every_sequence():
    """Each worker's activations are of its tokens: at 1,024 tokens the simulated peak nearly halves."""
    long = ["model.hidden_size=64", "model.max_seq_len=1024", "data.seq_len=1024", "data.num_samples=8",
            "strategy.microbatch_size=2", "strategy.num_microbatches=1", "train.device=meta"]
    whole, cut = (simulate(tiny_cfg("llama", "strategy=baseline", f"strategy.sequence_parallel={size}", *long))
                  for size in (1, 2))
    assert len(cut.per_process) == 2
    assert cut.per_process[0].by_kind["weights"] == whole.per_process[0].by_kind["weights"]
    assert cut.peak_bytes < 0.7 * whole.peak_bytes


@pytest.mark.slow
def test_the_loss_and_the_evaluation_sum_every_workers_tokens(tmp_path):
    cfg = cut_cfg("data.eval_fraction=0.25", "data.seq_len=15")  # padded: the padding is no item
    cut = run(cfg, tmp_path / "cut", table=False)
    whole = run(uncut(cfg), tmp_path / "whole", table=False)
    assert cut["loss"] == pytest.approx(whole["loss"], rel=1e-5)  # each step's mean over the minibatch's items
    assert cut["eval"][-1]["items"] == whole["eval"][-1]["items"]
    assert cut["eval"][-1]["loss"] == pytest.approx(whole["eval"][-1]["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["baseline", "l2l", "fsdp"])
def test_a_cut_run_resumes_from_its_checkpoint_as_if_uninterrupted(strategy, tmp_path):
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0", "model.dropout=0.2")
    cfg = cut_cfg(*keys, strategy=strategy)
    run(cfg, tmp_path / "whole", table=False)
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 1)
    run(cut_cfg(*keys, f"train.resume={step_one}", strategy=strategy), tmp_path / "again", table=False)
    for (name, a), (_, b) in zip(saved_model(cfg, tmp_path / "whole").named_parameters(),
                                 saved_model(cfg, tmp_path / "again").named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda why, name=name: f"{name}: {why}")


@pytest.mark.parametrize(("overrides", "refusal"), [
    (["model.num_kv_heads=1"], "must divide the attention heads \\(4\\) and the key/value heads \\(1\\)"),
    (["model.model_type=phi3", "model.dropout=0.1"], "not phi3's resid_pdrop; set model.dropout=0"),
    (["model.attn_implementation=flex_attention"], "runs attention with sdpa or eager, not flex_attention"),
])
def test_a_model_the_cut_cannot_take_is_refused_when_it_is_built(overrides, refusal):
    """What only the built model shows (a checkpoint's heads, its dropout, its kernel)."""
    model = build_model(tiny_cfg("llama", *overrides).model)
    with pytest.raises(ConfigError, match=refusal):
        install(model, SequenceCut(size=2))
    assert model.hf_config._attn_implementation in ("sdpa", "flex_attention")  # left as it was


def test_mixtures_of_experts_are_refused_in_one_line():
    cfg = compose_config(["model=olmoe_1b_7b", "strategy=baseline", "strategy.sequence_parallel=2"])
    with pytest.raises(ConfigError, match="does not take mixtures of experts yet"):
        strategy_class("baseline").check_config(cfg)


def test_the_second_part_sees_the_whole_sequences_mask_and_its_own_positions_and_labels():
    model = build_model(tiny_cfg("llama", *MISTRAL_WINDOW).model)
    ids = torch.arange(32).reshape(2, 16)
    mb = MicroBatch(ids, ids.clone())
    split = SequenceSplit(SequenceCut(size=2, part=1))
    ctx = split.context(model, mb, model.embed_input(split.input_ids(mb)))
    whole = model.context(mb, model.embed_input(ids))
    assert torch.equal(ctx["masks"]["sliding_attention"], whole["masks"]["sliding_attention"])  # 16 x 16, the window
    assert torch.equal(ctx["position_ids"], torch.arange(8, 16).unsqueeze(0))
    for mine, all_of_them in zip(ctx["rope"]["sliding_attention"], whole["rope"]["sliding_attention"], strict=True):
        assert torch.equal(mine, all_of_them[:, 8:])
    hidden, scored = split.scored(torch.zeros(2, 8, 32), mb)
    assert hidden.shape == (2, 9, 32)  # one position more, which the causal LM's shift drops
    assert torch.equal(scored.labels[:, 1:], torch.cat([ids[:, 9:], torch.full((2, 1), -100)], dim=1))
