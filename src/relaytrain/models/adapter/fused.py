"""peft's LoRA linear layer with a faster forward of the same function.

peft computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`: the rank-r product is written
out at the size of the base's output, scaled into a second such tensor and added into a third,
three passes and two temporaries for a product of r (8) columns. `torch.addmm` adds the scaled
product into the base's output inside the matrix product instead. On this project's 2-core CPU,
on scripts/bench_lora.py's widest layer (256 tokens, 1024 -> 2816, r = 8; medians of 50 calls
interleaved), peft's forward took 0.76 ms more than the base's 8.2 ms and the fused one 0.33 ms;
forward and backward, 3.0 and 1.8 ms more than the frozen base's 16.6 ms.

It is the same function with one rounding less (the scaled product is not rounded before the
add): where the scaling alpha / r is a power of two (16 / 8 by default) the result is peft's to
the bit, else within an fp32 ulp or two. So it is used only in fp32, and only for plain LoRA:
one active adapter, no variant (DoRA), no lora_bias, neither merged nor disabled, no per-row
adapter names, no autocast, on the CPU or a CUDA device. Anything else runs peft's own forward
(tests/models/test_lora_fused.py checks both).
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

# Where it runs. A dry run (the meta device) keeps peft's forward: its autocast is relaytrain's
# own (`meta_autocast`), which torch.is_autocast_enabled cannot see; counting peft's temporaries
# there errs on the safe side for an fp32 run.
REAL_DEVICES = ("cpu", "cuda")


class FusedLoraLinear(LoraLinear):
    """peft's `lora.Linear` (saving, merging and loading unchanged) with the fused forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fusable_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        # An fp32 input outside autocast gives an fp32 base output: F.linear refuses mixed dtypes,
        # and an NF4 base dequantizes in its input's dtype.
        result = self.base_layer(x)
        low_rank = self.lora_A[adapter](self.lora_dropout[adapter](x))
        fused = torch.addmm(result.reshape(-1, result.shape[-1]), low_rank.reshape(-1, low_rank.shape[-1]),
                            self.lora_B[adapter].weight.t(), alpha=self.scaling[adapter])
        return fused.view(result.shape)

    def _fusable_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """The one adapter the fused forward computes, or None where peft's forward must run."""
        if args or kwargs or self.disable_adapters or self.merged or x.dtype != torch.float32:
            return None
        if x.device.type not in REAL_DEVICES or torch.is_autocast_enabled(x.device.type):
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant:
            return None
        adapter = active[0]
        down, up = self.lora_A[adapter], self.lora_B[adapter]
        if up.bias is not None or down.weight.dtype != torch.float32 or up.weight.dtype != torch.float32:
            return None
        return adapter


def use_fused_forward(model: nn.Module) -> None:
    """Every plain peft LoRA linear layer of `model` takes the fused forward (its class only
    changes; its parameters, buffers and state dict stay peft's)."""
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
