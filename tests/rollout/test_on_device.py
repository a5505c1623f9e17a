"""A device copy of a host-held policy (`rollout.on_device`), whole or relayed a block at a time:
the same weights, the same samples, nothing left behind. On this CPU the "device" is the CPU: the
copy's making, filling and freeing (and the relay's visits) are what is checked; a CUDA machine
runs the same code with real transfers, the relay's next block uploading on a side stream."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.rollout.on_device import (
    DeviceCopy,
    RelayCopy,
    choose,
    decoder_layer_names,
    free_bytes,
    kv_cache_bytes,
)
from relaytrain.rollout.sampling import Sampling, sample, sample_key
from tests.checkpoints import chat_tokenizer, tiny_decoder, tiny_moe

CPU = torch.device("cpu")


def test_the_copy_samples_what_the_policy_samples_and_is_freed_after(tmp_path):
    policy = AutoModelForCausalLM.from_pretrained(tiny_decoder(tmp_path / "gemma2", "gemma2", layers=2)).eval()
    tok = chat_tokenizer()
    prompts = [tok(t)["input_ids"] for t in ("What is two plus", "Hello there")]
    keys = [sample_key(0, 0, j, 0) for j in range(2)]
    cpu = torch.device("cpu")
    expected = sample(policy, prompts, keys, Sampling(), 8, {tok.eos_token_id}, tok.pad_token_id, cpu)
    copied = DeviceCopy(policy, cpu)
    assert all(p.device.type == "meta" for p in copied.model.parameters())  # made without host memory
    with torch.no_grad():  # the copy takes the weights as they are when it is entered
        policy.model.embed_tokens.weight.mul_(40.0)
    expected_now = sample(policy, prompts, keys, Sampling(), 8, {tok.eos_token_id}, tok.pad_token_id, cpu)
    with copied.on_device() as model:
        assert torch.equal(model.model.embed_tokens.weight, policy.model.embed_tokens.weight)
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # Gemma 2's tied head, filled
        got = sample(model, prompts, keys, Sampling(), 8, {tok.eos_token_id}, tok.pad_token_id, cpu)
    assert got == expected_now and expected_now != expected
    assert all(t.device.type == "meta" for t in [*copied.model.parameters(), *copied.model.buffers()])


def test_what_a_copy_needs_beside_it():
    from transformers import AutoConfig

    llama = AutoConfig.for_model("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=32, head_dim=8)
    assert kv_cache_bytes(llama, sequences=6, tokens=16, dtype=torch.bfloat16) == 2 * 2 * 2 * 8 * 6 * 16 * 2
    assert free_bytes(CPU) > 10**15  # the host is where a CPU run samples anyway


def _layers(model) -> list[str]:
    """The decoder layers' module names (under peft's wrappers too)."""
    return [name for name, _ in model.named_modules() if name.rpartition(".")[0].endswith("layers")]


def _prompts():
    tok = chat_tokenizer()
    prompts = [tok(t)["input_ids"] for t in ("What is two plus", "Hello there", "A")]
    return tok, prompts, [sample_key(3, 0, j, 0) for j in range(len(prompts))]


def _policy(kind: str, directory):
    if kind == "qwen3_moe":
        return AutoModelForCausalLM.from_pretrained(tiny_moe(directory, kind)).eval()
    if kind == "gemma2":
        return AutoModelForCausalLM.from_pretrained(tiny_decoder(directory, kind, layers=3)).eval()
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_decoder(directory, layers=3))
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # non-zero: the adapters count
    return get_peft_model(base, lora).eval()


@pytest.mark.parametrize("kind", ["gemma2", "qwen3_moe", "lora"])
def test_a_relay_samples_what_the_policy_samples_a_block_at_a_time(tmp_path, kind):
    """Gemma 2 (tied head, sliding and full layers), a mixture and a LoRA-adapted Llama: the
    relay draws the policy's tokens and scores its logits, each forward visiting every block
    once with two on the device (the one running, the next uploading), and leaves nothing behind."""
    policy = _policy(kind, tmp_path / kind)
    assert _layers(policy) == decoder_layer_names(policy) and len(_layers(policy)) == 3
    tok, prompts, keys = _prompts()
    expected = sample(policy, prompts, keys, Sampling(temperature=0.7), 8, {tok.eos_token_id}, tok.pad_token_id, CPU)
    relay = RelayCopy(policy, CPU, _layers(policy))
    assert all(t.device.type == "meta" for t in [*relay.model.parameters(), *relay.model.buffers()])
    forwards, held = [], []
    relay.model.register_forward_pre_hook(lambda m, args: forwards.append(1))
    for block in relay.blocks:
        block.register_forward_pre_hook(
            lambda m, args: held.append(sum(next(b.parameters()).device.type != "meta" for b in relay.blocks)))
    with relay.on_device() as model:
        assert all(p.device.type == "meta" for b in relay.blocks for p in b.parameters())  # none before the forward
        got = sample(model, prompts, keys, Sampling(temperature=0.7), 8, {tok.eos_token_id}, tok.pad_token_id, CPU)
        ids = torch.tensor([p + c for p, c in zip(prompts[:1], got[:1], strict=True)])
        scored = model(input_ids=ids).logits
    assert got == expected
    torch.testing.assert_close(scored, policy(input_ids=ids).logits, rtol=0, atol=0)
    blocks = len(relay.blocks)
    assert relay.visits == blocks * len(forwards) + 1  # and the first block again, for a next token that never came
    assert set(held) == {2}  # as each block runs: it and the next
    assert all(t.device.type == "meta" for t in [*relay.model.parameters(), *relay.model.buffers()])


def test_where_a_host_held_policy_samples_follows_the_free_memory(tmp_path):
    """A whole copy where it and the cache fit; a relay with the cache on the device, then on
    the host; the host itself where not even the relay's parts fit, each said in a line (a GPU's
    choice, made here from the free bytes given: nothing is placed)."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_decoder(tmp_path / "llama", layers=4)).eval()
    names, cache, gpu = _layers(policy), 40_000, torch.device("cuda")
    whole = DeviceCopy(policy, gpu).bytes
    relay = RelayCopy(policy, gpu, names)
    made, said = choose(policy, gpu, names, None, cache, free=2 * (whole + cache))
    assert type(made) is DeviceCopy and said == ""
    made, said = choose(policy, gpu, names, None, cache, free=int(1.25 * (relay.bytes + cache)))
    assert isinstance(made, RelayCopy) and not made.cache_on_host and "KV cache on the device" in said
    made, said = choose(policy, gpu, names, None, cache, free=int(1.25 * (relay.bytes + cache // 2)))
    assert isinstance(made, RelayCopy) and made.cache_on_host and "KV cache on the host" in said
    assert f"{relay.streamed_bytes / 2**30:.1f} GiB a token" in said and "\n" not in said
    made, said = choose(policy, gpu, names, None, cache, free=relay.bytes)
    assert made is None and said.endswith("sampling on the host, from its copy there")
    assert relay.bytes < whole and relay.streamed_bytes < whole


def _scored_rows(vocab: int) -> list:
    """Three micro-batches of two right-padded rows, the completions labelled (a rollout batch's rows)."""
    from relaytrain.models.layered import MicroBatch

    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):
        ids = torch.randint(3, vocab, (2, 12), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0  # the second row is shorter
        labels = torch.where(mask.bool(), ids, -100)
        labels[:, :4] = -100  # the prompt is not labelled
        rows.append(MicroBatch(input_ids=ids, labels=labels, attention_mask=mask))
    return rows


def _layered(model):
    """A model seen as the decoder family's layered model, as a GRPO run sees it."""
    from relaytrain.models.decoder import LayeredDecoder
    from relaytrain.objectives import objective

    return LayeredDecoder(model, objective("grpo"))


def _lora_in_place(directory):
    """A Llama with non-zero LoRA adapters injected in place, as relaytrain adapts its models."""
    from peft import LoraConfig, inject_adapter_in_model

    base = AutoModelForCausalLM.from_pretrained(tiny_decoder(directory, layers=3))
    return inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                                   base).eval()


@pytest.mark.parametrize("kind", ["gemma2", "qwen3_moe", "lora"])
def test_a_relay_scores_every_micro_batch_of_a_batch_streaming_the_model_once(tmp_path, kind):
    """A relayed policy's scoring pass (`scoring.token_logps`) runs each block over every
    micro-batch while it is on the device: the log-probs the policy's own forwards give, the
    model streamed once (where a forward a micro-batch would stream it three times); with
    adapters, the reference view scores the base alone."""
    from relaytrain.rollout.scoring import ReferenceView, adapters_off, token_logps

    policy = _lora_in_place(tmp_path / kind) if kind == "lora" else _policy(kind, tmp_path / kind)
    rows = _scored_rows(policy.config.vocab_size)
    expected = token_logps(policy, rows, temperature=0.7)
    relay = RelayCopy(policy, CPU, decoder_layer_names(policy), layered=_layered)
    with relay.on_device() as model:
        got = token_logps(model, rows, temperature=0.7)
        assert relay.visits == len(relay.blocks) + 1  # every block once, and the first again for what comes next
        base = token_logps(ReferenceView(model), rows, temperature=0.7) if kind == "lora" else None
    for ours, theirs, mb in zip(got, expected, rows, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert torch.equal(ours != 0, mb.labels != -100)  # the labelled tokens alone, at their own positions
    if base is not None:
        with adapters_off(policy):
            unadapted = token_logps(policy, rows, temperature=0.7)
        for ours, theirs, adapted in zip(base, unadapted, expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(ours, adapted)
    assert all(t.device.type == "meta" for t in [*relay.model.parameters(), *relay.model.buffers()])
    plain = RelayCopy(policy, CPU, decoder_layer_names(policy))  # no layered view: a forward a micro-batch
    with plain.on_device() as model:
        assert not plain.scores_together and token_logps(model, rows[:1], temperature=0.7)[0].equal(got[0])
    assert plain.visits == len(plain.blocks) + 1


def test_a_relay_scores_in_groups_whose_hidden_states_fit():
    from relaytrain.rollout.on_device import score_groups

    rows = _scored_rows(100)
    per = 2 * 12 * 64 * 4  # a micro-batch's fp32 hidden states at width 64
    assert [len(g) for g in score_groups(rows, 64, free=1 << 40)] == [3]
    assert [len(g) for g in score_groups(rows, 64, free=2 * 2 * per)] == [2, 1]
    assert [len(g) for g in score_groups(rows, 64, free=per)] == [1, 1, 1]  # one at a time, at the least
