"""A device copy of a host-held policy (`rollout.on_device`): the same weights, the same samples,
nothing left behind. On this CPU the "device" is the CPU: the copy's making, filling and freeing
are what is checked; a CUDA machine runs the same code with a real transfer."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from relaytrain.rollout.on_device import DeviceCopy, fits, kv_cache_bytes
from relaytrain.rollout.sampling import Sampling, sample, sample_key
from tests.checkpoints import chat_tokenizer, tiny_decoder


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
    assert fits(10**15, 10**15, torch.device("cpu"))  # the host is where a CPU run samples anyway
