"""Sampling in the cost model (`cost.rollout`): the KV cache's closed form against the cache a decoder
fills, and a rollout batch's time, the weights read once a decoded token where the policy samples."""

from __future__ import annotations

import pytest
import torch

from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.rollout import kv_cache_bytes, sampling_cost, weight_bytes
from relaytrain.models import build_model
from relaytrain.run.compose import compose_config


def test_the_kv_cache_of_a_micro_batchs_sequences_is_the_closed_form():
    """A tiny Llama (grouped-query attention) prefilled with 6 sequences of data.seq_len tokens
    holds exactly the closed form's bytes of keys and values."""
    cfg = compose_config(["model=llama_tiny", "model.num_kv_heads=2", "data.seq_len=16"])
    model = build_model(cfg.model, 0, quiet=True).hf_model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.zeros((6, 16), dtype=torch.long), use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(ModelFacts.of(cfg), sequences=6, tokens=16)


def test_a_latent_attention_s_cache_is_the_closed_form(tmp_path):
    """A tiny DeepSeek-V3 caches its shared latent and rotary key (kv rank + rope wide), not every
    head's key and value: the closed form from its block shape, and the run's from its Hugging Face
    config, hold what it fills."""
    from transformers import AutoModelForCausalLM

    from relaytrain.models.pretrained import resolve
    from relaytrain.rollout.on_device import kv_cache_bytes as config_cache_bytes
    from tests.checkpoints import tiny_bias_balanced

    directory = tiny_bias_balanced(tmp_path / "checkpoint", "deepseek_v3")
    cfg = resolve(compose_config([f"model.pretrained={directory}", "data.seq_len=16"]))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.zeros((6, 16), dtype=torch.long), use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(ModelFacts.of(cfg), sequences=6, tokens=16)
    assert held == config_cache_bytes(model.config, sequences=6, tokens=16, dtype=torch.float32)


# ------------------------------------------------------------------ time

GRPO = ["model=llama3_8b", "objective=grpo", "objective.num_generations=8", "data.seq_len=1024",
        "objective.max_completion_length=512", "precision=cmp_bf16", "strategy.microbatch_size=2",
        "strategy.num_microbatches=2", "objective.rewards=[exact_answer]"]


def _facts(*overrides: str) -> ModelFacts:
    return ModelFacts.of(compose_config([*GRPO, *overrides]))


def test_a_decoded_token_reads_every_weight_once_where_the_policy_samples():
    """With the compute made negligible, a token costs the weights' bytes over the memory rate
    (the device holds them: a micro-batch at a time) or over the host link (a relay streams them
    once for the whole batch), plus the cache read; a copy uploads the weights once a batch;
    scoring passes are forwards of the whole rows."""
    facts = _facts()
    rows, tokens, forward_s = 16, 512, 1e-9
    weights = weight_bytes(facts)
    assert weights == facts.params * 2  # cmp_bf16: every weight in bf16
    cache = kv_cache_bytes(facts, rows, 1024 - tokens + tokens // 2)
    common = dict(rows=rows, microbatches=2, completion_tokens=tokens, scoring_passes=0)
    on_device = sampling_cost(facts, forward_s, forward_s, 3e12, 5e10, where="device", **common)
    assert on_device.parts["decode"] == pytest.approx(2 * tokens * (weights + cache) / 3e12)
    relay = sampling_cost(facts, forward_s, forward_s, 3e12, 5e10, where="relay", **common)
    both = kv_cache_bytes(facts, 2 * rows, 1024 - tokens + tokens // 2)  # the two micro-batches decode together
    assert relay.parts["decode"] == pytest.approx(tokens * (weights / 5e10 + both / 3e12))
    copy = sampling_cost(facts, forward_s, forward_s, 3e12, 5e10, where="copy", **common)
    assert copy.batch_s - on_device.batch_s == pytest.approx(weights / 5e10) == copy.parts["upload"]
    scored = sampling_cost(facts, 0.5, 0.25, 3e12, 5e10, where="device", **{**common, "scoring_passes": 2})
    assert scored.parts["scoring"] == pytest.approx(2 * 2 * (facts.num_layers * 0.5 + 0.25))
    assert scored.per_step(4) == pytest.approx(scored.batch_s / 4)


def test_a_slow_forward_bounds_the_token_instead():
    """Where a position's share of the forward outlasts reading the weights, it sets the pace."""
    facts = _facts()
    slow = sampling_cost(facts, 100.0, 0.0, 1e15, None, rows=16, microbatches=1, completion_tokens=8,
                         scoring_passes=0, where="device")
    assert slow.parts["decode"] == pytest.approx(8 * facts.num_layers * 100.0 / 1024, rel=1e-6)
    assert slow.parts["prefill"] == pytest.approx(facts.num_layers * 100.0 * (1024 - 8) / 1024)


@pytest.mark.parametrize(("strategy", "device", "model", "where"), [
    ("baseline", "h100_80gb", "llama3_8b", "where the model is"),
    ("l2l", "rtx4090_24gb", "llama3_8b", "a device copy of the host-held policy"),  # 15 GiB of bf16 weights, 2 of cache
    ("l2l", "h100_80gb", "llama3_70b", "relayed through the device"),  # 131 GiB of them
    ("fsdp", "h100_80gb", "llama3_8b", "a device copy of the host-held policy"),  # gathered on the first's host
])
def test_a_grpo_plan_adds_a_steps_share_of_its_rollout_batch(strategy, device, model, where):
    """The planner's step is the update's and a step's share of sampling (num_iterations steps
    share a batch), sampled where the run would: a host-held policy (L2L's, or the whole model
    FSDP's shards gather) copied or relayed."""
    from relaytrain.cost.profile import from_spec, load_spec
    from relaytrain.planner.candidates import GiB
    from relaytrain.planner.sampling import free_between_steps, sampling_for, with_sampling
    from relaytrain.strategies import strategy_class

    cfg = compose_config([*GRPO, f"model={model}", f"strategy={strategy}", "objective.num_iterations=2"])
    cls, facts = strategy_class(strategy), ModelFacts.of(cfg)
    spec = load_spec(device)
    profile = from_spec(spec, cfg, [facts.rows(2)])
    free = free_between_steps(spec["memory_gb"] * GiB * 0.9, facts)
    sampling = sampling_for(cfg, cls, facts, profile, 1, free)
    update = cls.cost_model.step_cost(cfg, facts, profile)
    step = with_sampling(update, sampling, cfg)
    assert step.step_s == pytest.approx(update.step_s + sampling.batch_s / 2)
    assert step.parts["sampling"] == pytest.approx(sampling.batch_s / 2) and where in step.notes[-1]
    relay = sampling.where == "relay"  # one stream a token for the whole batch; else one read a micro-batch's token
    floor = (1 if relay else 2) * 512 * weight_bytes(facts)
    rate = profile.host_to_device_bytes_per_s if relay else profile.memory_bytes_per_s
    assert sampling.parts["decode"] >= floor / rate


def test_a_4_bit_base_is_read_as_stored():
    """QLoRA: decoding reads the base's NF4 storage (under a third of bf16's bytes) and the
    adapter, so a 4-bit 70 B's copy fits an H200 where its bf16 one is relayed."""
    from relaytrain.cost.profile import from_spec, load_spec
    from relaytrain.planner.candidates import GiB
    from relaytrain.planner.sampling import free_between_steps, sampling_for
    from relaytrain.strategies import strategy_class

    lora, qlora = (compose_config([*GRPO, "model=llama3_70b", "strategy=l2l", f"adapter={a}"]) for a in ("lora", "qlora"))
    assert weight_bytes(ModelFacts.of(qlora)) < 0.32 * weight_bytes(ModelFacts.of(lora))  # embeddings and head stay bf16
    spec = load_spec("h200_141gb")
    where = {}
    for name, cfg in (("lora", lora), ("qlora", qlora)):
        facts = ModelFacts.of(cfg)
        profile = from_spec(spec, cfg, [facts.rows(2)])
        free = free_between_steps(spec["memory_gb"] * GiB * 0.9, facts)
        where[name] = sampling_for(cfg, strategy_class("l2l"), facts, profile, 1, free).where
    assert where == {"lora": "relay", "qlora": "copy"}


def test_a_decoded_token_pays_each_blocks_call_however_few_its_rows():
    """With the profile's decoded token (`DecodeTimes`), a token costs every block's call and the
    rest of the step (the larger of that and reading the weights), where a position's share of
    a forward over data.seq_len spread those calls thin; a timed one has read its cache already.
    A relay looks the token up at the whole batch's sequences and scores it in one stream a pass."""
    from relaytrain.cost.profile import DecodeTimes

    facts = _facts()
    asked = []

    def decode_at(sequences: int, reads_cache: bool = False) -> DecodeTimes:
        asked.append(sequences)
        return DecodeTimes(block_s=0.01, rest_s=0.05, reads_cache=reads_cache)

    common = dict(rows=16, microbatches=2, completion_tokens=512, scoring_passes=0)
    compute = facts.num_layers * 0.01 + 0.05
    cache = kv_cache_bytes(facts, 16, 1024 - 512 + 256) / 3e12
    spec = sampling_cost(facts, 1e-9, 1e-9, 3e12, 5e10, where="device", decode_at=decode_at, **common)
    assert spec.parts["decode"] == pytest.approx(2 * 512 * (compute + cache)) and asked == [16]
    timed = sampling_cost(facts, 1e-9, 1e-9, 3e12, 5e10, where="device",
                          decode_at=lambda n: decode_at(n, reads_cache=True), **common)
    assert timed.parts["decode"] == pytest.approx(2 * 512 * compute)
    relay = sampling_cost(facts, 0.5, 0.25, 3e12, 5e10, where="relay", decode_at=decode_at,
                          **{**common, "scoring_passes": 2})
    assert asked[-1] == 32  # the two micro-batches decode together
    streamed = weight_bytes(facts) / 5e10
    assert relay.parts["scoring"] == pytest.approx(2 * (2 * (facts.num_layers * 0.5 + 0.25) + streamed))


def test_a_spec_profile_prices_a_decoded_tokens_launches_and_a_measured_one_times_them():
    """A GPU's spec profile: a block's kernel overhead each block of a decoded token, the rest
    about two blocks' (their FLOPs at the sustained rate besides). This CPU: the rollout engine's decode
    step timed with the block and without it (`planner.sampling.time_decode`)."""
    from relaytrain.cost.profile import from_spec, load_spec, measure
    from relaytrain.planner.sampling import time_decode

    cfg = compose_config(GRPO)
    spec = load_spec("h100_80gb")
    decode = from_spec(spec, cfg, [4, 16], decode=True).timings[0].decode
    overhead = spec["kernel_overhead_s_per_block"]
    assert set(decode) == {4, 16}
    assert overhead < decode[4].block_s < decode[16].block_s and 2 * overhead < decode[4].rest_s
    assert not decode[4].reads_cache
    tiny = ["model=llama_tiny", "data.seq_len=16", "objective.max_completion_length=8"]
    measured = measure(compose_config([*GRPO, *tiny]), [2], [1], torch.device("cpu"), time_decode)
    (timings,) = measured.timings.values()
    assert set(timings.decode) == {2} and timings.decode[2].reads_cache
    assert timings.decode[2].block_s >= 0 and timings.decode[2].rest_s > 0  # a difference of two timings, and one
    assert timings.decode_at(4) == timings.decode[2].scaled(2.0)
    assert not from_spec(spec, cfg, [4]).timings[0].decode  # none asked: a task that samples nothing
