"""AdamW with its moments in 8 or 4 bits (`optim.state_bits`): torchao's AdamW8bit and AdamW4bit.

The algorithm and the kernels are torchao's (`pip install 'relaytrain[lowbit]'`); relaytrain
only builds them from its keys and steps them where it steps AdamW (the eager param server's
parts, a whole-model strategy's optimizer). In torchao's scheme each moment of a tensor of at
least 4096 elements whose count the block divides is kept as codes on a quantization map, 8
bits (blocks of 256 elements) or 4 (blocks of 128), with one fp32 scale per block; smaller
tensors (norms, biases) keep fp32 moments. A step dequantizes both moments, makes AdamW's
update in fp32 and quantizes them again. torchao compiles that update once per tensor shape
(torch.compile, on a C++ compiler on the CPU): the first step of a run pays for it.

Checkpoints keep the codes and scales themselves (torchao's tensor subclasses, saved and loaded
by torch), so a resumed run steps the same states as the uninterrupted one, under any layout: a
tensor's moments cut into shares of whole blocks, or joined from them, are its codes and scales
cut or joined (`cut`, `joined`; a DTensor's: `placed_moment`, `whole_moment`), as torchao's own
slicing and gathering of them does for DCP along the first dim, and run by run along any other
(a tensor rank's columns).
Nothing is dequantized on the way: torchao's signed map is not symmetric (-0.993 to 1), so a
moment quantized again from its dequantized values would not be the same moment.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from relaytrain.step.host_loops import adamw_lowbit_host, fits, host_loops
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.tensors import local

BLOCK = {8: 256, 4: 128}  # torchao's default block of each width
# torchao's update on a CPU against torch's fused fp32 AdamW, per parameter: its quantization
# finds each code by a branchless binary search of the map (eight lookups and comparisons a
# value in 8 bits), and decoding looks the codes up again. Measured on the 2-core VM
# (2026-11-29, one 4 M-parameter tensor, 2 threads, compiled): 107.7 ms (8-bit) and 289.0 ms
# (4-bit) against 2.8 ms. The planner times a host update from fp32's bytes times this; on a
# GPU torchao's update is bandwidth-bound like AdamW's, and the bytes alone count there. On the
# host relaytrain's C++ loop makes the same update faster (`host_loops`).
HOST_TIME_VS_FP32 = {32: 1.0, 8: 38.0, 4: 100.0}
# relaytrain's C++ loop (`host_loops`, optim.host_loops), the same measure (2026-11-30, the 2-core
# AVX2 VM, medians of 7 alternating rounds, two runs): 8 bits 12.3 and 12.0 ms against fused fp32
# AdamW's 3.2 and 3.4; 4 bits 14.8 and 16.1 ms. (Before the loop's table and AVX2 path: 16 and 12.5 times.)
HOST_LOOP_TIME_VS_FP32 = {8: 3.7, 4: 4.7}
STATE_BITS = (32, *BLOCK)  # 32: torch's AdamW with fp32 moments
_CLASSES: dict[int, type] = {}
_COMPILED: dict = {}  # "update": torchao's per-tensor update, compiled (`_torchao_update`)


def state_bits(o) -> int:
    """The width of AdamW's moments the optimizer keys ask for; 32 for every other optimizer."""
    return o.get("state_bits", 32)


def host_time_vs_fp32(o) -> float:
    """A host update's time with the optimizer keys `o`, as so many times fp32 AdamW's."""
    bits = state_bits(o)
    return HOST_LOOP_TIME_VS_FP32[bits] if bits != 32 and o.get("host_loops", True) else HOST_TIME_VS_FP32[bits]


def state_words(bits: int) -> float:
    """fp32 words of AdamW state per parameter: two moments of `bits` and a scale per block each
    (the tensors torchao leaves in fp32 are too few to count)."""
    return 2.0 if bits == 32 else 2 * (bits / 32 + 1 / BLOCK[bits])


def lowbit_adamw(groups: list[dict], o) -> torch.optim.Optimizer:
    """torchao's AdamW with `o.state_bits`-bit moments over relaytrain's parameter groups."""
    optimizer = optimizer_class(o.state_bits)(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    optimizer.use_host_loops = bool(o.get("host_loops", True))
    return optimizer


def optimizer_class(bits: int) -> type:
    """torchao's AdamW8bit or AdamW4bit with the interface relaytrain steps optimizers through."""
    if bits not in _CLASSES:
        # torch's compile cache says once that torchao's state tensors give it no stable hash:
        # nothing a run can act on (the update is only compiled again in a new process).
        warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
        base = getattr(_torchao_optim(bits), f"AdamW{bits}bit")
        _CLASSES[bits] = type(f"LowBitAdamW{bits}", (_HostLoop, base), {"name": f"torchao AdamW{bits}bit"})
    return _CLASSES[bits]


def check_available(bits: int) -> None:
    """Refuse in one line where torchao is missing."""
    if bits != 32:
        _torchao_optim(bits)


def in_a_dispatch_mode() -> bool:
    """Whether this thread runs under a TorchDispatchMode (a dry run's memory tracker). torch's
    `is_in_torch_dispatch_mode()` reads one flag for the whole process, which modes entered and
    left on several threads in turns (a dry run's ranks) can leave set; the mode stack
    itself is the thread's own."""
    return torch._C._len_torch_dispatch_stack() > 0


class _Stepped:
    """`update()` and `drop_grads()`, as the eager param server steps its parts (`StepEachGroup`);
    under a dispatch mode (a dry run's memory tracker, which torch.compile refuses) the update
    runs uncompiled: the same operations and allocations."""

    name = "torchao"

    @property
    def kernel(self) -> str:
        return self.name

    def step(self, closure=None):
        if not self._uncompiled():
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)

    def update(self) -> None:
        self.step()

    def _uncompiled(self) -> bool:
        """Under a dry run: its tracker's thread, or a thread stepping its meta tensors (the EPS's;
        an optimizer's tensors never change device, so that is asked once, not every step)."""
        if "_on_meta" not in self.__dict__:
            self._on_meta = any(p.device.type == "meta" for group in self.param_groups for p in group["params"])
        return self._on_meta or in_a_dispatch_mode()

    def drop_grads(self) -> None:
        self.zero_grad(set_to_none=True)

    def _new_buffer(self, p: torch.Tensor, signed: bool):
        """A moment of `p` as torchao makes it, but for FSDP's shards (a DTensor) decided on the
        whole tensor, as the plain loop decides: torchao asks the local shard, which would keep
        fp32 moments of a tensor the plain loop quantizes (4096 elements over two shards). The
        shard's blocks are the whole tensor's (`check_quantized_shards`)."""
        if not isinstance(p, DTensor):
            return super()._new_buffer(p, signed)
        shard = p.to_local()
        if quantizes(p.numel(), self.block_size) and shard.numel():
            out = self._subclass_zeros(shard, signed, self.block_size)
        else:
            out = torch.zeros_like(shard)
        return DTensor.from_local(out, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()).to(p.device)


def quantizes(numel: int, block: int) -> bool:
    """torchao's rule: a tensor of at least 4096 elements whose count the block divides gets
    quantized moments; any other keeps fp32 ones."""
    return numel >= 4096 and numel % block == 0


def check_quantized_shards(params, bits: int) -> None:
    """Each shard (a DTensor's local part: FSDP's rows, a tensor rank's rows or columns) of a tensor
    whose moments are quantized holds whole blocks of the whole tensor, so its moments are the
    plain loop's: along the innermost dim a shard cuts, its run of consecutive values (torch.chunk's
    share, every shard but the last alike, times the values of the dims inside it) divides by the
    block. One line naming the first that does not, the same on every worker."""
    block = BLOCK[bits]
    for name, p in params:
        if not isinstance(p, DTensor) or not quantizes(p.numel(), block):
            continue
        share = list(p.shape)
        for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
            if placement.is_shard():
                share[placement.dim] = -(-share[placement.dim] // size)
        split = [d for d in range(p.ndim) if share[d] != p.shape[d]]
        if split and math.prod(share[split[-1]:]) % block:
            raise ConfigError(f"optim.state_bits={bits}: {name}'s shards ({tuple(share)} of {tuple(p.shape)}) cut "
                              f"torchao's blocks of {block} values, so its moments would not be the whole tensor's; "
                              f"use another strategy.replicas or strategy.tensor_parallel, or optim.state_bits=32")


def is_quantized(t) -> bool:
    """Whether state tensor `t` (or a DTensor's local part) holds torchao's codes and scales."""
    t = local(t)
    return hasattr(t, "codes") and hasattr(t, "qmap")


def moment_like(shape: torch.Size, bits: int, field: str | None, dtype=torch.float32) -> torch.Tensor:
    """An empty optimizer state `field` of a tensor of `shape`, as an optimizer with `bits`-bit
    states keeps it: AdamW's moments as torchao's codes and scales where torchao quantizes them,
    anything else as a tensor of `dtype`."""
    if bits == 32 or field not in MOMENTS or not quantizes(math.prod(shape), BLOCK[bits]):
        return torch.empty(shape, dtype=dtype)
    like = torch.zeros(()).expand(shape)  # the shape, without its bytes
    return optimizer_class(bits)._subclass_zeros(like, field == "exp_avg", BLOCK[bits])


def cut(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """Indices [start, end) of state tensor `t` along `dim`, a copy of its own; of a quantized
    moment, its codes and scales of those values (whole blocks: `check_quantized_shards`)."""
    if not is_quantized(t):
        return t.narrow(dim, start, end - start).clone()
    shape = [*t.shape[:dim], end - start, *t.shape[dim + 1:]]
    out = type(t).zeros(shape, t.signed, t.block_size, t.codes.device)
    outer, n = math.prod(t.shape[:dim]), t.shape[dim]
    for name in ("codes", "scale"):  # each run of consecutive values: a row of (outer, the rest)
        inner = getattr(t, name).reshape(outer, -1)
        lo, hi = inner.shape[1] * start // n, inner.shape[1] * end // n
        if lo * n != inner.shape[1] * start or hi * n != inner.shape[1] * end:
            raise ValueError(f"a cut [{start}, {end}) of dim {dim} of {tuple(t.shape)} splits a block of {t.block_size}")
        getattr(out, name).copy_(inner[:, lo:hi].reshape(getattr(out, name).shape))
    return out


def owned(t: torch.Tensor) -> torch.Tensor:
    """A copy of state tensor `t` of its own (a quantized moment's codes and scales copied too)."""
    return cut(t, 0, 0, t.shape[0])


def joined(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Parts of a tensor along `dim` (`cut`'s), in order, as one tensor; quantized moments' codes
    and scales joined run by run."""
    if not is_quantized(parts[0]):
        return torch.cat(parts, dim)
    first = parts[0]
    shape = [*first.shape[:dim], sum(p.shape[dim] for p in parts), *first.shape[dim + 1:]]
    whole = type(first).zeros(shape, first.signed, first.block_size, first.codes.device)
    outer = math.prod(first.shape[:dim])
    for name in ("codes", "scale"):
        runs = torch.cat([getattr(p, name).reshape(outer, -1) for p in parts], dim=1)
        getattr(whole, name).copy_(runs.reshape(getattr(whole, name).shape))
    return whole


def gathered_parts(moment: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank of `group`'s quantized `moment` (a collective), in rank order: codes and scales gathered."""
    names, context = moment.__tensor_flatten__()
    inner = {}
    for name in names:
        t = getattr(moment, name).contiguous()
        inner[name] = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(inner[name], t, group=group)
    return [type(moment).__tensor_unflatten__({n: inner[n][i] for n in names}, context, moment.shape, moment.stride())
            for i in range(size)]


def whole_moment(t: DTensor) -> torch.Tensor:
    """A quantized moment placed as a DTensor, whole: each sharded mesh dim's parts gathered and
    joined, the innermost first (a collective of its mesh)."""
    part = t.to_local()
    for mesh_dim in reversed(range(t.device_mesh.ndim)):
        placement = t.placements[mesh_dim]
        if placement.is_shard():
            size = t.device_mesh.size(mesh_dim)
            part = joined(gathered_parts(part, t.device_mesh.get_group(mesh_dim), size), placement.dim)
    return part


def placed_moment(whole: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's part of a whole quantized moment, placed as parameter `like` is (no collective)."""
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    part = owned(whole)  # cut further along every dim the placement cuts
    for d in range(like.ndim):
        if shape[d] != like.shape[d]:
            part = cut(part, d, offset[d], offset[d] + shape[d])
    return DTensor.from_local(part.to(like.device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


class _HostLoop(_Stepped):
    """A host tensor's update runs relaytrain's C++ loop (`host_loops`, unless
    `optim.host_loops=false`), torchao's algorithm and state without its compiled loop, scalar
    on a CPU; anything else (device tensors, tensors whose moments torchao leaves in fp32, a dry
    run) torchao's own update, one tensor at a time (FSDP's shards: their local parts)."""

    use_host_loops = True  # optim.host_loops (`lowbit_adamw` sets it)

    @property
    def kernel(self) -> str:
        host = all(p.device.type == "cpu" for group in self.param_groups for p in group["params"])
        return f"{self.name}, relaytrain's host loop" if host and self._loops() is not None else self.name

    def _loops(self):
        return None if self._uncompiled() else host_loops(self.use_host_loops)

    @torch.no_grad()
    def step(self, closure=None):
        if any(group["amsgrad"] for group in self.param_groups):
            return super().step(closure)
        op = self._loops()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if "step" not in state:  # as torchao makes it
                    state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(p, True),
                                 exp_avg_sq=self._new_buffer(p, False))
                state["step"] += 1
                rule = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"])
                # FSDP's shards step their own blocks: an element's update is its own (`_new_buffer`).
                value, grad, moments = local(p.detach()), local(p.grad), [local(state[k]) for k in MOMENTS]
                if op is not None and fits(value, *moments):
                    adamw_lowbit_host(op, value, grad, state["step"], *moments, *rule)
                else:
                    _torchao_update(value, grad, state["step"], moments, rule, compiled=not self._uncompiled())
        return loss


MOMENTS = ("exp_avg", "exp_avg_sq")


def _torchao_update(p: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, moments: list, rule: tuple,
                    compiled: bool = True) -> None:
    """torchao's own update of one plain tensor (a shard's local part: torchao's optimizer
    compiling over DTensors crashes a CPU worker here), compiled as its optimizer compiles it
    (the wrapper made once, not per tensor and step), or eager in a dry run."""
    from torchao.optim.adam import single_param_adam

    if "update" not in _COMPILED:
        _COMPILED["update"] = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    lr, beta1, beta2, weight_decay, eps = rule
    with torch._dynamo.utils.disable_cache_limit():
        (_COMPILED["update"] if compiled else single_param_adam)(p, grad, step, *moments, None, lr, beta1, beta2,
                                                                 weight_decay, eps, True, False)


def _torchao_optim(bits: int):
    try:  # quiet at import: relaytrain/__init__.py lowers torchao's logger
        import torchao.optim
    except ImportError as err:
        raise ConfigError(f"optim.state_bits={bits} keeps AdamW's moments with torchao, which is not installed "
                          f"({err}); pip install 'relaytrain[lowbit]'") from err
    return torchao.optim
