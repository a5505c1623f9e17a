"""The fused forward of peft's LoRA linear layer (`models.adapter.fused`): peft's function, to
the bit where the scaling is a power of two and within fp32 rounding otherwise, forward and
backward, dropout included; peft's own forward wherever the layer is more than plain LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from relaytrain.models.adapter.fused import FusedLoraLinear, use_fused_forward


class Two(nn.Module):
    """Two linear layers, as a block's projections: peft adapts both."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 40)
        self.down = nn.Linear(40, 16, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def adapted(alpha: int = 8, **keys) -> tuple[nn.Module, nn.Module]:
    """The same random LoRA (r=4, every matrix non-zero) as peft builds it, and fused."""
    torch.manual_seed(0)
    model = Two()
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=alpha, target_modules=["up", "down"], **keys), model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    fused = copy.deepcopy(model)
    use_fused_forward(fused)
    return model, fused


def forward_backward(model: nn.Module, x: torch.Tensor, seed: int = 3):
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)  # the dropout masks: the same draws on both sides
    y = model(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("alpha, exact", [(8, True), (12, False)], ids=["scaling-2", "scaling-3"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_the_fused_forward_computes_pefts_function(alpha, exact, dropout):
    peft_model, fused = adapted(alpha, lora_dropout=dropout)
    assert all(type(m) is FusedLoraLinear for m in (fused.up, fused.down))
    x = torch.randn(3, 5, 16)
    theirs, ours = forward_backward(peft_model, x), forward_backward(fused, x)
    compare = torch.equal if exact else _within_fp32_rounding
    assert compare(ours[0], theirs[0]) and compare(ours[1], theirs[1])
    assert ours[2].keys() == theirs[2].keys() and len(ours[2]) == 4
    assert all(compare(ours[2][n], theirs[2][n]) for n in theirs[2])
    assert fused.state_dict().keys() == peft_model.state_dict().keys()


def _within_fp32_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal but for the roundings peft does and the fused product does not (a few fp32 ulps of
    the tensor's largest entry, which the sums of a backward spread to the small ones)."""
    return bool((ours - theirs).abs().max() <= 1e-5 * theirs.abs().max())


CASES = {
    "dora": {"keys": {"use_dora": True}},
    "lora_bias": {"keys": {"lora_bias": True}},
    "disabled": {"then": lambda m: [layer.enable_adapters(False) for layer in (m.up, m.down)]},
    "merged": {"then": lambda m: [layer.merge() for layer in (m.up, m.down)]},
    "autocast": {"context": lambda: torch.autocast("cpu", dtype=torch.bfloat16)},
}


@pytest.mark.parametrize("case", CASES)
def test_more_than_plain_lora_runs_pefts_forward(case):
    setup = CASES[case]
    models = adapted(12, **setup.get("keys", {}))
    for model in models:
        setup.get("then", lambda m: None)(model)
    peft_model, fused = models
    x = torch.randn(2, 3, 16)
    with setup.get("context", torch.no_grad)():
        assert fused.up._fusable_adapter(x, (), {}) is None
        assert torch.equal(fused(x), peft_model(x))  # peft's own forward, to the bit


def test_a_dry_run_and_half_inputs_run_pefts_forward():
    _, fused = adapted()
    assert fused.up._fusable_adapter(torch.randn(2, 16, device="meta"), (), {}) is None
    assert fused.up._fusable_adapter(torch.randn(2, 16, dtype=torch.bfloat16), (), {}) is None
    assert fused.up._fusable_adapter(torch.randn(2, 16), (), {}) == "default"
