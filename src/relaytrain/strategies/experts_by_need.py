"""Experts streamed by need (`strategy.experts_by_need=true`, L2L): a block's frozen experts cross
to the device only where its router picked them.

A mixture's block is nearly all expert weights (97 % of Qwen3-30B-A3B's), and a small minibatch
routes its tokens to a few of them. Where no expert weight trains (LoRA, QLoRA, frozen experts),
the relay need not upload the others: Hugging Face's experts read an expert's matrices only for
the tokens routed to it (the eager loop over the experts hit, grouped_mm's groups, batched_mm's
gather), so an expert no token picked may hold anything.

- On arrival a streamed tensor is a zero tensor of its whole shape on the device (the device
  memory is a whole block's, as before: only the link's bytes are saved), with the pieces every
  expert reads (4-bit storage's second-level scales) filled.
- Before the experts compute (a forward pre-hook on the module: it is handed the router's picks,
  `top_k_index`), the experts picked and not yet there are uploaded, and the compute waits for them.
  This upload follows the router, so it cannot be prefetched: it is the price of the saving.
- The backward visits a block again with the same weights and the same inputs, so its router
  picks what the forward picked: the forward's picks are uploaded on arrival, with the rest of the
  part, prefetched; the hook still checks each micro-batch and uploads any expert missing.

So a step computes with the same values as one that uploads every expert, bit for bit
(tests/strategies/test_experts_by_need.py). The cost is one read of the picks by the host per
micro-batch and routed block (a device synchronisation on a GPU). The run's summary counts the
expert bytes uploaded against the whole experts' bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from relaytrain.models.quantize import BLOCK
from relaytrain.models.quantize_experts import EXPERTS_NDIM, NF4Experts, fused_tensors
from relaytrain.strategies.eps import Part
from relaytrain.strategies.transfers import Transfer, Transfers, UploadCounts
from relaytrain.utils.errors import ConfigError


def check_experts_by_need(strategy, adapter) -> None:
    """A full fine-tune trains the experts: every step needs them all."""
    if strategy.experts_by_need and adapter.name == "none":
        raise ConfigError("strategy.experts_by_need=true streams frozen experts, and a full fine-tune trains them "
                          "(every step needs them all): use it with adapter=lora or adapter=qlora")


@dataclass(frozen=True)
class ExpertSlices:
    """Where each expert's values lie in one frozen tensor's flat storage (elements of its dtype):
    `strided` pieces of (first element, elements per expert), expert e's at first + e x count, and
    `shared` spans (first, stop) that every expert reads."""

    experts: int
    strided: tuple[tuple[int, int], ...]
    shared: tuple[tuple[int, int], ...] = ()

    @classmethod
    def dense(cls, tensor: torch.Tensor) -> ExpertSlices:
        """A fused tensor, [experts, ...]: each expert's rows in one run."""
        return cls(tensor.shape[0], ((0, tensor.numel() // tensor.shape[0]),))

    @classmethod
    def nf4(cls, layout) -> ExpertSlices | None:
        """A fused tensor's 4-bit storage (`quantize_experts.ExpertsLayout`): each expert's codes and
        first-level scales, its own where its matrix is whole blocks of 64 (None: it is not, and the
        tensor travels whole); the second-level scales of double quantization are shared."""
        values = layout.values // layout.experts
        if values % BLOCK:
            return None
        spans = layout.matrix.spans()
        codes, _, _ = spans["codes"]
        scales, _, scale_dtype = spans["absmax"]
        strided = ((codes, values // 2), (scales, values // BLOCK * scale_dtype.itemsize))
        shared = tuple((start, start + size) for name, (start, size, _) in spans.items() if name not in ("codes", "absmax"))
        return cls(layout.experts, strided, shared)

    def spans(self, experts: list[int]) -> list[tuple[int, int]]:
        """The (first, stop) spans of `experts` (sorted), a run of consecutive experts as one span."""
        spans = []
        for first, last in _runs(experts):
            spans += [(start + first * count, start + (last + 1) * count) for start, count in self.strided]
        return spans


def _runs(experts: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted expert indices, as (first, last)."""
    runs: list[list[int]] = []
    for e in experts:
        if runs and runs[-1][1] == e - 1:
            runs[-1][1] = e
        else:
            runs.append([e, e])
    return [(first, last) for first, last in runs]


@dataclass(frozen=True)
class Streamed:
    """One frozen tensor of a part that travels by need: its position in `Part.frozen`, its name
    inside its experts module, where its experts lie."""

    position: int
    name: str
    slices: ExpertSlices


@dataclass(frozen=True)
class ExpertsModule:
    """A part's experts module whose frozen tensors travel by need."""

    part: int
    module: nn.Module
    tensors: tuple[Streamed, ...]

    @property
    def experts(self) -> int:
        return self.tensors[0].slices.experts


@dataclass
class ExpertVisit:
    """A part's streamed tensors on the device for one residency, and which experts are in them."""

    tensors: dict[int, torch.Tensor]  # position in Part.frozen -> the device tensor
    present: dict[int, set[int]] = field(default_factory=dict)  # id(experts module) -> experts uploaded
    transfer: Transfer | None = None  # the arrival's upload, acquired with the part's
    again: bool = False  # the part's second visit of the step (the backward's): it arrived with the forward's picks


class ExpertsByNeed:
    """The parts' streamed experts: their device tensors on arrival, the hooks that fill them."""

    def __init__(self, parts: list[Part], transfers: Transfers, dtype: torch.dtype,
                 visit_of: Callable[[int], ExpertVisit | None], counts: UploadCounts):
        self.parts, self.transfers, self.dtype, self.visit_of = parts, transfers, dtype, visit_of
        self.counts = counts  # the relay's: the streamed tensors' bytes add to them
        self.by_part: dict[int, list[ExpertsModule]] = {}
        for index, part in enumerate(parts):
            for m in _experts_modules(index, part):
                self.by_part.setdefault(index, []).append(m)
        if not self.by_part:
            raise ConfigError("strategy.experts_by_need=true: no frozen expert weights to stream (a dense model, or "
                              "experts that train: every step needs them all); it is for a mixture under "
                              "adapter=lora or adapter=qlora")
        # Each part's positions in its frozen tensors that travel by need (the others travel whole).
        self.positions = {index: frozenset(t.position for m in modules for t in m.tensors)
                          for index, modules in self.by_part.items()}
        self.wanted: dict[int, set[int]] = {}  # id(module) -> the experts this step picked so far
        self.recompute_misses = 0  # experts a backward visit picked that its forward had not (0: routed alike)
        self.handles = [m.module.register_forward_pre_hook(self._before_experts(m), with_kwargs=True)
                        for modules in self.by_part.values() for m in modules]

    def start_step(self) -> None:
        self.wanted.clear()

    def arrive(self, index: int) -> ExpertVisit:
        """Part `index`'s streamed tensors on the device: zeros, the shared pieces and the experts
        this step has picked so far (a backward visit: the forward's picks) uploaded."""
        part, modules = self.parts[index], self.by_part[index]
        visit = ExpertVisit({t.position: self.transfers.zeros(part.frozen[t.position].shape, self._dtype_of(part, t))
                             for m in modules for t in m.tensors})
        visit.again = any(id(m.module) in self.wanted for m in modules)
        pairs = []
        for m in modules:
            wanted = sorted(self.wanted.get(id(m.module), ()))
            visit.present[id(m.module)] = set(wanted)
            for t in m.tensors:
                self.counts.experts_whole += _nbytes(part.frozen[t.position])
                pairs += self._pairs(part, visit, t, list(t.slices.shared) + t.slices.spans(wanted))
        visit.transfer = self.transfers.upload_into(pairs, held=list(visit.tensors.values()))
        return visit

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    # -- the hook -----------------------------------------------------------------------------
    def _before_experts(self, m: ExpertsModule):
        def hook(module, args, kwargs):
            visit = self.visit_of(m.part)
            first = m.tensors[0]
            if visit is None or _held(module, first.name) is not visit.tensors[first.position]:
                return None  # not a relay visit (a rollout, a plain forward): the module holds its own weights
            picks = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            present = visit.present[id(module)]
            picked = {e for e in picks.unique().tolist() if e < m.experts}  # E: an expert-parallel sentinel
            self.wanted.setdefault(id(module), set()).update(picked)
            missing = sorted(picked - present)
            if missing:
                self.recompute_misses += len(missing) if visit.again else 0
                part = self.parts[m.part]
                pairs = [pair for t in m.tensors for pair in self._pairs(part, visit, t, t.slices.spans(missing))]
                self.transfers.acquire(self.transfers.upload_into(pairs))
                present.update(missing)
            return None

        return hook

    # -- uploads ------------------------------------------------------------------------------
    def _dtype_of(self, part: Part, t: Streamed) -> torch.dtype:
        """The device tensor's dtype: the relay's where the tensor is floating (the relay casts a
        frozen half base to it on upload), else its own (4-bit storage)."""
        host = part.frozen[t.position]
        return self.dtype if host.is_floating_point() else host.dtype

    def _pairs(self, part: Part, visit: ExpertVisit, t: Streamed, spans) -> list[tuple[torch.Tensor, torch.Tensor]]:
        host, device = part.frozen[t.position].reshape(-1), visit.tensors[t.position].view(-1)
        pairs = [(device[start:stop], host[start:stop]) for start, stop in spans]
        self.counts.experts += sum(_nbytes(h) for _, h in pairs)
        return pairs


def _experts_modules(index: int, part: Part) -> list[ExpertsModule]:
    """Part `index`'s experts modules with frozen tensors that can travel by need."""
    frozen = {name: position for position, name in enumerate(part.frozen_names)}
    found = []
    for prefix, module in part.module.named_modules():
        if not (isinstance(module, NF4Experts) or fused_tensors(module)):
            continue
        tensors = tuple(t for name in _own_parameters(module) if (t := _streamed(module, name, frozen, prefix)))
        if tensors:
            found.append(ExpertsModule(index, module, tensors))
    return found


def _own_parameters(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters(recurse=False)]


def _streamed(module: nn.Module, name: str, frozen: dict[str, int], prefix: str) -> Streamed | None:
    """`module`'s tensor `name` as a streamed tensor, where it is frozen, contiguous and per expert."""
    position = frozen.get(f"{prefix}.{name}" if prefix else name)
    if position is None:
        return None
    tensor = module._parameters[name]
    if not tensor.is_contiguous():
        return None
    if isinstance(module, NF4Experts) and name in module.nf4_layouts:
        slices = ExpertSlices.nf4(module.nf4_layouts[name])
    else:  # a fused tensor, or a per-expert one beside it (GPT-OSS's biases: [experts, width])
        per_expert = tensor.ndim >= 2 and tensor.shape[0] == _expert_count(module)
        slices = ExpertSlices.dense(tensor) if per_expert and tensor.is_floating_point() else None
    return None if slices is None else Streamed(position, name, slices)


def _expert_count(module: nn.Module) -> int:
    if isinstance(module, NF4Experts):
        return next(iter(module.nf4_layouts.values())).experts
    return next(p.shape[0] for p in module.parameters(recurse=False) if p.ndim == EXPERTS_NDIM)


def _held(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor `module` computes with as `name` now (under an adapter's parametrization, its original)."""
    if parametrize.is_parametrized(module, name):
        return module.parametrizations[name].original
    return module._parameters.get(name)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
