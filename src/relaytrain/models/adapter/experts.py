"""LoRA on a mixture's fused experts (`adapter.target_parameters`): peft's `ParamWrapper`, as
relaytrain runs it.

peft adapts a 3-D expert tensor by folding its delta into the parameter for the duration of the
forward, through `torch.nn.utils.parametrize`: for one adapter its low-rank factors in one
`baddbmm` (`_LoraFactorsProxy`), else its whole delta weight. Two places need it done otherwise,
with the same arithmetic, so each wrapper takes `ExpertsParamWrapper`'s class (its parameters,
state dict and saved files stay peft's):

- **4-bit experts** (`models/quantize_experts.py`): the parameter is NF4 bytes, which a
  parametrization cannot stand in for a float tensor; the delta is folded into the dequantized
  tensor instead (`NF4Experts.folded`), in its dtype, as peft casts its factors to its parameter's.
- **A dry run**, on the meta device: peft's fold turns autocast off with `torch.autocast("meta")`,
  which torch does not have (a dry run's autocast is relaytrain's, `dryrun.meta_autocast`); the
  same `baddbmm` runs with that paused, so the planner and `train.device=meta` count what a real
  step allocates.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.nn.utils import parametrize

from relaytrain.dryrun import meta_autocast
from relaytrain.models.quantize_experts import NF4Experts


def adapted_experts(layer: nn.Module) -> tuple[list[str], list[str]]:
    """A built block's fused expert tensors (names as Hugging Face's layer holds them,
    `mlp.experts.gate_up_proj`) and those no adapter adapts, read off the modules peft made: a
    ParamWrapper adapts its `parameter_name` of the experts module it wraps. peft decides this
    itself: beside `target_parameters`, it turns target modules named gate_proj / up_proj /
    down_proj on a mixture (what all-linear names where the model has a dense MLP or a shared
    expert) into LoRA on the fused experts, transformers 5's layout of the old per-expert linears."""
    experts, adapted = [], set()
    for name, module in layer.named_modules():
        plain = name.replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            adapted.add(f"{plain}.{module.parameter_name}")
        elif isinstance(module, NF4Experts):
            experts += [f"{plain}.{tensor}" for tensor in module.nf4_layouts]
        else:
            experts += [f"{plain}.{tensor}" for tensor, p in module.named_parameters(recurse=False) if p.dim() == 3]
    return experts, [name for name in experts if name not in adapted]


def expert_adapters(module: nn.Module) -> list[nn.Module]:
    """The LoRA factors (peft's lora_A and lora_B) of every ParamWrapper in `module`: its adapters on
    fused expert tensors, which expert parallelism cuts with the experts."""
    return [part for m in module.modules() if isinstance(m, ParamWrapper) for part in (m.lora_A, m.lora_B)]


def use_experts_param_wrappers(model: nn.Module) -> None:
    """Every peft ParamWrapper of `model` takes ExpertsParamWrapper's class."""
    for module in model.modules():
        if type(module) is ParamWrapper:
            module.__class__ = ExpertsParamWrapper


class _Factors(nn.Module):
    """peft's one-adapter fold, `W + scaling * lhs @ rhs` in one `baddbmm` in W's dtype, autocast off."""

    def __init__(self, lhs: torch.Tensor, rhs: torch.Tensor, scaling: float):
        super().__init__()
        self.lhs, self.rhs, self.scaling = lhs, rhs, scaling

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        off = meta_autocast.paused() if weight.device.type == "meta" else torch.autocast(weight.device.type, enabled=False)
        with off:
            return torch.baddbmm(weight, self.lhs.to(weight.dtype), self.rhs.to(weight.dtype), alpha=self.scaling)


class ExpertsParamWrapper(ParamWrapper):
    """peft's ParamWrapper, folding over 4-bit experts and on the meta device (see the module)."""

    def _quantized(self) -> bool:
        return isinstance(self.get_base_layer(), NF4Experts)

    def get_param(self):
        if self._quantized():  # peft reads its shape, dtype and device, never its values
            return self.get_base_layer().stand_in(self.parameter_name)
        return super().get_param()

    def _fold(self, adapters: list[str]) -> nn.Module:
        """peft's fold of `adapters`: its factors for one adapter, else its delta weight."""
        if len(adapters) == 1 and self.num_experts > 1:
            return _Factors(*self.get_delta_factors(adapters[0]))
        delta = sum(self.get_delta_weight(a) for a in adapters)
        return _Delta(delta)

    @contextmanager
    def _activate_lora(self, active_adapters: list[str]):
        adapters = [a for a in active_adapters if a in self.lora_A]
        meta = self.get_param().device.type == "meta"
        if not adapters or not (self._quantized() or meta):
            with super()._activate_lora(active_adapters):
                yield
            return
        fold = self._fold(adapters)
        if self._quantized():
            with self.get_base_layer().folded(self.parameter_name, fold):
                yield
            return
        base = self.get_base_layer()
        parametrize.register_parametrization(base, self.parameter_name, fold)  # checked once, as peft's is
        try:
            with parametrize.cached():
                yield
        finally:
            parametrize.remove_parametrizations(base, self.parameter_name, leave_parametrized=False)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        if self._quantized():
            raise NotImplementedError("a LoRA over 4-bit experts merges into the unquantized base "
                                      "(adapter.merge_on_save builds it), never into its NF4 bytes")
        super().merge(safe_merge, adapter_names)


class _Delta(nn.Module):
    """peft's fold of several adapters: `W + delta`, in W's dtype."""

    def __init__(self, delta: torch.Tensor):
        super().__init__()
        self.delta = delta

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta.to(weight.dtype)
