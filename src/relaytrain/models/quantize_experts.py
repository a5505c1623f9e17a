"""`model.quantize=nf4` on a mixture's fused experts: each expert's matrices in NF4.

A sparse-MLP block's experts are fused 3-D tensors (`experts.gate_up_proj`, `experts.down_proj`:
[experts, rows, columns]), not `nn.Linear`s, so the linear layers' `NF4Linear` passes them by;
in a mixture they are nearly all of a block's weights (97 % of Qwen3-30B-A3B's). Here a fused
tensor's experts are stacked into one matrix and quantized as `models.quantize` quantizes a linear
weight (bitsandbytes' NF4, one absmax scale per block of 64 weights, so each expert's matrix is
its own blocks; double quantization alike: `ExpertsLayout`), held in one frozen uint8 parameter
under the tensor's own name: `mlp.experts.gate_up_proj` is its 4-bit bytes, so every strategy
carries it as it carries an `NF4Linear`'s (the EPS keeps it once on the host, the relay uploads it
as it is, FSDP2 shards it).

The experts module keeps Hugging Face's class and forward (eager, grouped_mm, a dry run's), which
reads `self.gate_up_proj`: the module's class gains a property of that name that dequantizes the
whole tensor on the module's device (one bitsandbytes call) in its input's dtype, once per visit (the forward,
or a recompute), the copy dropped when the forward returns. What backward keeps of it is what
autograd keeps of any weight the experts multiply by: one block's dense experts while that block
waits for its backward (under l2l, or `strategy.recompute=block`, one block's at a time).

LoRA on the experts (`adapter.target_parameters`) folds its delta into the dequantized tensor
through `folded` (`models/adapter/experts.py`), bit for bit what peft computes over the NF4 round
trip (tests/models/test_qlora_moe.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from relaytrain.models.quantize import BLOCK, NESTED_BLOCK, Layout, dequantize, pack, work_device
from relaytrain.utils.errors import ConfigError

EXPERTS_NDIM = 3  # [experts, rows, columns]: a mixture's fused expert tensor
# The pieces of a fused tensor's NF4 storage that run expert by expert (the rest, double
# quantization's offset and second-level map, belong to the whole tensor): what a share cuts.
SHARED_PIECES = ("codes", "absmax", "absmax2")


@dataclass(frozen=True)
class ExpertsLayout:
    """One fused tensor's storage: its experts' matrices stacked into one matrix of `experts` x
    rows rows, in NF4 as `models.quantize` holds a linear weight. A matrix of a multiple of 64
    values (every published mixture's) is whole blocks, so each expert's scales are its own, as
    if quantized alone; under double quantization the second-level blocks of 256 scales run on
    across experts, as they run across a linear weight's rows. One bitsandbytes call reads it."""

    experts: int
    matrix: Layout  # of the stacked matrix: (experts x rows, columns)
    dtype: torch.dtype  # the dense tensor's, as loaded

    @classmethod
    def of(cls, weight: torch.Tensor, double: bool) -> ExpertsLayout:
        experts, rows, columns = weight.shape
        return cls(experts, Layout((experts * rows, columns), double), weight.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        rows, columns = self.matrix.shape
        return (self.experts, rows // self.experts, columns)

    @property
    def values(self) -> int:
        return self.matrix.shape[0] * self.matrix.shape[1]

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def pack(self, weight: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        if weight.device.type == "meta":  # a dry run: the storage's size, no values
            return torch.empty(self.nbytes, dtype=torch.uint8, device="meta")
        return pack(weight.reshape(self.matrix.shape), self.matrix, device)

    def share(self, storage: torch.Tensor, index: int, degree: int) -> tuple[ExpertsLayout, torch.Tensor]:
        """Experts [index n/degree, (index + 1) n/degree) of `storage` (expert parallelism): their
        layout and storage, their codes and scales as quantized with the others (each expert's
        blocks its own; under double quantization a share's scales must be whole groups of 256,
        whose second-level scales and the tensor's offset it keeps), so they dequantize to the
        same values. A share that would cut a block or a group is refused in one line."""
        part, (_, rows, columns) = self._share_layout(degree), self.shape
        local, blocks, group = part.experts, part.matrix.blocks, NESTED_BLOCK if self.matrix.double else 1
        if rows * columns % BLOCK or blocks % group:
            raise ConfigError(f"strategy.expert_parallel={degree} over 4-bit experts: a share of {local} experts of "
                              f"{rows} x {columns} is not whole blocks of {BLOCK} values"
                              + (f" and groups of {group} scales (double quantization)" if group > 1 else "")
                              + "; use another strategy.expert_parallel, or model.quantize_double=false")
        if storage.device.type == "meta":
            return part, torch.empty(part.nbytes, dtype=torch.uint8, device="meta")
        whole, out = self.matrix.unpack(storage), torch.zeros(part.nbytes, dtype=torch.uint8, device=storage.device)
        for name, view in part.matrix.unpack(out).items():  # offset and code2: the whole tensor's
            n = view.numel() if name in SHARED_PIECES else None
            view.copy_(whole[name] if n is None else whole[name][index * n:(index + 1) * n])
        return part, out

    def joined(self, shares: list[torch.Tensor]) -> torch.Tensor:
        """The whole storage of every share's (`share`'s), in order: the inverse of cutting it."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=shares[0].device)
        pieces = [self._share_layout(len(shares)).matrix.unpack(s) for s in shares]
        for name, view in self.matrix.unpack(out).items():
            view.copy_(torch.cat([p[name] for p in pieces]) if name in SHARED_PIECES else pieces[0][name])
        return out

    def _share_layout(self, degree: int) -> ExpertsLayout:
        """The layout of 1/`degree` of the experts, stacked and stored as the whole's are."""
        local, (_, rows, columns) = self.experts // degree, self.shape
        return ExpertsLayout(local, Layout((local * rows, columns), self.matrix.double), self.dtype)

    def dequantize(self, storage: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if storage.device.type == "meta":
            return torch.empty(self.shape, dtype=dtype, device="meta")
        return dequantize(storage, self.matrix, dtype).view(self.shape)


class NF4Experts(nn.Module):
    """The behaviour a quantized experts module's class gains (`quantize_experts`): its fused
    tensors read dense, once per visit, with an adapter's delta folded in where one is active."""

    nf4_layouts: dict[str, ExpertsLayout]

    def dense(self, name: str) -> torch.Tensor:
        """The fused tensor `name`, dequantized in the dtype of the visit's input (that of the
        hidden states, which the block's other weights share: bf16 under a bf16 device copy), or
        outside a visit in the dtype it was loaded in. Outside a visit a parameter FSDP2 has sharded
        is itself: FSDP2 finds its parameters by name, and unshards them before the visit."""
        visit = self.__dict__.get("_visit")
        if visit is not None and name in visit:
            return visit[name]
        stored = self._parameters[name]
        if visit is None and isinstance(stored, DTensor):
            return stored
        layout = self.nf4_layouts[name]
        dtype = self.__dict__.get("_visit_dtype") or layout.dtype
        weight = layout.dequantize(stored, dtype)
        fold = self.__dict__.get("_folds", {}).get(name)
        weight = weight if fold is None else fold(weight)
        if visit is not None:
            visit[name] = weight
        return weight

    def stand_in(self, name: str) -> torch.Tensor:
        """The dense tensor's shape, dtype and device, without its values or memory (peft reads
        no more of the parameter it adapts)."""
        layout = self.nf4_layouts[name]
        return torch.empty((), dtype=layout.dtype, device=self._parameters[name].device).expand(layout.shape)

    @contextmanager
    def folded(self, name: str, fold):
        """While an adapter's forward runs: `name` reads `fold(dense)`."""
        folds = self.__dict__.setdefault("_folds", {})
        folds[name] = fold
        try:
            yield
        finally:
            folds.pop(name, None)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        outer = "_visit" in self.__dict__
        if not outer:
            self.__dict__.update(_visit={}, _visit_dtype=hidden_states.dtype)
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            if not outer:
                del self.__dict__["_visit"], self.__dict__["_visit_dtype"]

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: nf4{', double' if layout.matrix.double else ''}"
                         for name, layout in self.nf4_layouts.items())


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _quantized_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with NF4Experts' behaviour and a dequantizing property for each fused tensor of
    `names` (a property is the class's, and shadows the parameter of its name)."""
    if (cls, names) not in _CLASSES:
        properties = {name: property(lambda self, name=name: self.dense(name)) for name in names}
        _CLASSES[cls, names] = type(f"NF4{cls.__name__}", (NF4Experts, cls), properties)
    return _CLASSES[cls, names]


def fused_tensors(module: nn.Module) -> list[str]:
    """The names of `module`'s own fused expert tensors (3-D floating parameters)."""
    return [name for name, p in module.named_parameters(recurse=False)
            if p.ndim == EXPERTS_NDIM and p.is_floating_point()]


def quantize_experts(module: nn.Module, double: bool, device: torch.device | None = None) -> None:
    """`module`'s fused expert tensors held in NF4 (in place; a module without any is left as it is)."""
    names = fused_tensors(module)
    if not names:
        return
    layouts = {}
    for name in names:
        weight = module._parameters[name].detach()
        layout = ExpertsLayout.of(weight, double)
        module._parameters[name] = nn.Parameter(layout.pack(weight, device), requires_grad=False)
        layouts[name] = layout
    module.__class__ = _quantized_class(type(module), tuple(names))
    module.nf4_layouts = layouts


def quantize_blocks_experts(model, double: bool, device: torch.device | None = None) -> None:
    """Every fused expert tensor of `model`'s blocks held in NF4 (beside `quantize.quantize_blocks`,
    which takes their linear layers), where it quantizes (`quantize.work_device`)."""
    for block in model.blocks:
        for module in list(block.layer.modules()):
            quantize_experts(module, double, work_device(device))


def quantized_values(module: nn.Module) -> tuple[int, int]:
    """(dense values, storage bytes) of `module`'s experts held in NF4 (none: (0, 0))."""
    if not isinstance(module, NF4Experts):
        return 0, 0
    layouts = module.nf4_layouts.values()
    return sum(layout.values for layout in layouts), sum(layout.nbytes for layout in layouts)
