"""QLoRA of a mixture: `model.quantize=nf4` holds the fused experts in NF4 too (`models/quantize_experts.py`).

The reference is the plain peft loop of `test_moe` over a checkpoint whose blocks' linear weights
and every expert's matrices were replaced by their NF4 round trip, made by bitsandbytes itself
(quantize_4bit, then dequantize_4bit, one matrix at a time): nothing of relaytrain's quantization
is on its path. A continued adapter on attention and on the experts (peft's `target_parameters`)
trained over the 4-bit base must equal it to float noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from relaytrain.cost.formulas import ModelFacts
from relaytrain.models import build_model
from relaytrain.models.pretrained import resolve
from relaytrain.models.quantize_experts import NF4Experts
from relaytrain.run.compose import compose, compose_config
from relaytrain.run.train import run
from tests.checkpoints import tiny_moe
from tests.models.test_lora import RUN_KEYS, adapters_of
from tests.models.test_moe import EXPERT_TENSORS, expert_adapter, moe_loop
from tests.models.test_qlora import nf4_round_trip

VARIANTS = {
    "l2l": ["strategy=l2l"],
    "baseline": ["strategy=baseline"],
    "pipe_flush": ["strategy=pipe_flush"],
    "fsdp_replicas": ["strategy=fsdp", "strategy.replicas=2"],
}
FAST = {"l2l"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a tiny Qwen3-MoE, a peft adapter on its attention and experts, the base rounded through NF4)."""
    root = tmp_path_factory.mktemp("qlora_moe")
    base = tiny_moe(root / "base", "qwen3_moe")
    return base, expert_adapter(base, root / "adapter"), nf4_round_trip(base, root / "rounded")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST else pytest.mark.slow) for v in VARIANTS])
def test_lora_over_4_bit_experts_equals_a_plain_peft_loop_over_the_round_trip(variant, moe, tmp_path):
    continues_over_4_bit_experts(*moe, variant, tmp_path)


@pytest.mark.slow  # GPT-OSS's experts are stored (in, out), with biases that stay as they are
def test_gpt_oss_lora_over_4_bit_experts_equals_a_plain_peft_loop_over_the_round_trip(tmp_path):
    base = tiny_moe(tmp_path / "base", "gpt_oss")
    continues_over_4_bit_experts(base, expert_adapter(base, tmp_path / "adapter"),
                                 nf4_round_trip(base, tmp_path / "rounded"), "l2l", tmp_path)


def continues_over_4_bit_experts(base: Path, adapter: Path, rounded: Path, variant: str, tmp_path: Path) -> None:
    """The adapter continued over the 4-bit base under `variant` equals the plain peft loop's over
    the round trip, to float noise, and so do the losses and the balancing term."""
    cfg = compose_config([f"model.pretrained={base}", f"adapter.pretrained={adapter}", "model.quantize=nf4",
                          *RUN_KEYS, *VARIANTS[variant]])
    results = run(cfg, tmp_path / "run", table=False)
    o = cfg.optim
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32), adapter,
                                          is_trainable=True)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    losses, terms = moe_loop(reference, torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                                          weight_decay=o.weight_decay), cfg)
    ours = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "run" / "model"))
    theirs = adapters_of(reference)
    assert ours.keys() == theirs.keys() and any("experts" in key for key in ours)
    for key, p in ours.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{variant} {key}: {m}")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert results["loss_terms"]["router_aux"] == pytest.approx(terms, rel=1e-5)


def test_the_experts_are_held_in_4_bits_and_read_as_their_round_trip(moe):
    """Every fused tensor is NF4 bytes under its own name, read dense as bitsandbytes' round trip
    of each expert's matrix; nothing but the adapters trains."""
    base, _, rounded = moe
    keys = [f"model.pretrained={base}", "adapter=qlora", f"adapter.target_parameters=[{','.join(EXPERT_TENSORS)}]"]
    cfg = resolve(compose_config(keys))
    model = build_model(cfg.model, adapter=cfg.adapter)
    reference = AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32).state_dict()
    experts = {name.replace(".base_layer", ""): m for name, m in model.hf_model.named_modules()
               if isinstance(m, NF4Experts)}
    assert sorted(experts) == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]  # layer 1 is dense
    for name, module in experts.items():
        for tensor in ("gate_up_proj", "down_proj"):
            stored = module._parameters[tensor]
            assert stored.dtype == torch.uint8 and not stored.requires_grad
            assert torch.equal(getattr(module, tensor), reference[f"{name}.{tensor}"])
    assert not any(p.requires_grad and "lora" not in name for name, p in model.hf_model.named_parameters())


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_a_dry_run_of_lora_on_the_experts_runs_under_autocast(adapter, moe, tmp_path):
    """On the meta device peft's fold asked torch for autocast on "meta", which it has not: the planner
    and train.device=meta failed on any LoRA on a mixture's experts. The fold computes in the
    weight's dtype there too: a dry run's autocast paused, as torch's is on a device."""
    base, _, _ = moe
    cfg = compose_config([f"model.pretrained={base}", f"adapter={adapter}", "precision=amp_bf16",
                          f"adapter.target_parameters=[{','.join(EXPERT_TENSORS)}]", "strategy=l2l",
                          "train.device=meta", "train.steps=1", "train.untimed_steps=0", "data.seq_len=16"])
    dry = run(cfg, tmp_path / "dry", table=False, quiet=True)
    assert dry["memory"]["device"]["peak_allocated_bytes"] > 0


def test_a_4_bit_qwen3_30b_a3b_base_weighs_under_0_35_of_its_bf16_one():
    """As the planner counts the published shape (one block built on the meta device): the frozen
    base in 4 bits, experts included, against the same base in bf16."""
    nf4 = ModelFacts.of(compose(["model=qwen3_30b_a3b", "adapter=qlora"]))
    dense = ModelFacts.of(compose(["model=qwen3_30b_a3b", "adapter=lora"]))
    ratio = nf4.whole(lambda part: nf4.frozen_part_bytes(part, 2)) / dense.whole(lambda part: dense.frozen_part_bytes(part, 2))
    assert ratio <= 0.35
