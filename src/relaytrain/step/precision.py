"""Dtype policy and loss scaling.

- fp32: everything in fp32.
- amp_bf16 / amp_fp16: fp32 weights, matmuls under autocast in half precision.
- cmp_bf16 / cmp_fp16 (cross mixed precision, L2L only): blocks travel to and run on the
  device in half precision while the eager param server keeps fp32 master weights and
  optimizer state on the host.
- amp_fp8 / cmp_fp8: amp_bf16 / cmp_bf16 with the blocks' linear layers computing in FP8
  (torchao's float8 training, `models/float8.py`): everything else as in bf16.
fp16 (amp or cmp) needs loss scaling: a step whose gradients overflow is skipped and the
scale lowered; it is never applied.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from relaytrain.dryrun import meta_autocast

# The reduced dtype of each policy; fp8's is bf16, what every operation but the blocks' FP8
# products computes in.
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    name: str
    half: torch.dtype | None  # the reduced dtype, None for fp32

    @classmethod
    def from_name(cls, name: str) -> Precision:
        return cls(name, None if name == "fp32" else _HALF[name.split("_")[1]])

    @property
    def autocast(self) -> bool:
        return self.name.startswith("amp")

    @property
    def cross(self) -> bool:
        return self.name.startswith("cmp")

    @property
    def needs_loss_scaling(self) -> bool:
        return self.half is torch.float16

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype weights have where they compute."""
        return self.half if self.cross else torch.float32

    def autocast_context(self, device: torch.device):
        """torch.autocast on `device`; on the meta device (a dry run, which stands for a GPU) the
        GPU's casting rule applied by hand, since torch.autocast has none there (`meta_autocast`)."""
        if not self.autocast:
            return contextlib.nullcontext()
        if device.type == "meta":
            return meta_autocast.autocast(self.half)
        return torch.autocast(device_type=device.type, dtype=self.half)


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss, check gradients, back off on overflow.

    Works on any list of gradient tensors (device or host), so the baseline and the eager
    param server share it. With `enabled=False` every call is a cheap no-op.
    """

    def __init__(self, enabled: bool, init_scale: float = 65536.0, growth_interval: int = 2000,
                 backoff: float = 0.5, growth: float = 2.0):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.backoff, self.growth = backoff, growth
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide grads by the scale in place; True when any is inf/NaN (the step must be skipped)."""
        if not self.enabled or not grads:
            return False
        if grads[0].device.type == "meta":  # a dry run: shapes only, nothing overflows
            torch._foreach_mul_(grads, 1.0 / self.scale)
            return False
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not found_inf:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        return found_inf

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff, 1.0)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0 and math.isfinite(self.scale * self.growth):
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
