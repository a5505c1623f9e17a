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
