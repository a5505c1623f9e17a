"""Optimizers (AdamW, LAMB, SGD, Muon with AdamW: `muon.py`): their config schemas, parameter groups and learning-rate schedules.

Each optimizer's schema (`optim=<name>`: its keys beyond `config.OptimConfig`'s) is a dataclass
registered here with `@register_optimizer(name)`; `compose` stores every registered one in
Hydra's ConfigStore as `optim/<name>_schema`, which configs/optim/<name>.yaml extends, so Hydra
refuses a key the chosen optimizer does not have.

Every strategy builds its optimizers here, so the same config means the same update rule
whether the step runs on the device (baseline), on the host per block (the eager param
server) or per pipeline stage. The learning rate is set by the training loop each step from
`lr_at(updates applied)`, which keeps the schedule position a plain integer (trivial to checkpoint).

The eager param server asks for the *flat* variants (`build_optimizer(..., flat=True)`): the
same update rules, bit for bit, with their state in one buffer per kind (`relaytrain.step.flat`)
and, for fused AdamW, one kernel call per parameter group.

Host AdamW (`optim.host_kernel`). The flat AdamW steps host tensors only, so it may run
DeepSpeed's cpu_adam op instead of torch's fused kernel (`DeepSpeedAdamW`): the same rule to
fp32 rounding, with its own vectorised C++ (its speed against torch's: docs/benchmarks.md,
`eps_vs_deepspeed_cpu_adam`). `deepspeed` asks for it; `auto` times both kernels once a
process where DeepSpeed is installed and its op builds (`pip install relaytrain[fast]`) and
takes the faster, said in one line; a missing or failing op falls back to torch's kernel, said
in one line when it was asked for or installed. The default is
`torch`: it keeps the host update bit for bit the device optimizer's (`strategy.offload=host`
resumes a device run exactly, and the EPS's tests check it so). The optimizers on a device
are always torch's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.sgd import sgd

from relaytrain.schema.config import Choice, OptimConfig
from relaytrain.step.decay import decays
from relaytrain.step.flat import FlatState
from relaytrain.step.lowbit import lowbit_adamw
from relaytrain.step.lowbit import state_words as lowbit_state_words
from relaytrain.step.muon import FlatMuonWithAdamW, MuonWithAdamW, muon_groups
from relaytrain.step.stepping import AdamWRule, StepEachGroup
from relaytrain.utils.errors import first_line

# --------------------------------------------------------------------------- schemas

_SCHEMAS: dict[str, type[OptimConfig]] = {}


def register_optimizer(name: str):
    """Class decorator: make an `OptimConfig` dataclass the schema of `optim=<name>`."""

    def add(schema: type[OptimConfig]) -> type[OptimConfig]:
        if name in _SCHEMAS and _SCHEMAS[name] is not schema:
            raise ValueError(f"optimizer {name!r} is registered twice ({_SCHEMAS[name].__qualname__}, "
                             f"{schema.__qualname__})")
        if not (dataclasses.is_dataclass(schema) and issubclass(schema, OptimConfig)) or schema.name != name:
            raise TypeError(f"optimizer {name!r}: {schema.__qualname__} must be an OptimConfig dataclass whose "
                            f"name defaults to {name!r}")
        _SCHEMAS[name] = schema
        return schema

    return add


def optimizer_schemas() -> dict[str, type[OptimConfig]]:
    """Every registered optimizer's schema by name."""
    return dict(sorted(_SCHEMAS.items()))


class HostKernel(Choice):
    """Which kernel steps AdamW on the host (the eager param server's masters)."""

    auto = "auto"  # the faster of the two here (timed once a process, said in one line), torch where DeepSpeed's op is missing
    torch = "torch"  # torch's fused AdamW (optim.fused)
    deepspeed = "deepspeed"  # DeepSpeed's cpu_adam op (falls back to torch, said once, when it cannot load)


class OrthogonalizeOn(Choice):
    """Where Muon's Newton-Schulz steps run for masters held on the host (an eager param
    server's) beside a GPU."""

    auto = "auto"  # the faster of the two here (timed once a process, said in one line); the host beside no GPU
    host = "host"  # where the masters and their momentum are
    device = "device"  # the run's GPU: the update shipped in bf16 (where the iteration starts anyway) and back


@register_optimizer("adamw")
@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"
    eps: float = 1e-6  # added to the second-moment root
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # moment decay rates
    fused: bool = True  # torch's fused kernel, on CPU and CUDA
    host_kernel: HostKernel = HostKernel.torch  # kernel of the host-side (EPS) AdamW: torch (bit for bit the device's), deepspeed (pip install relaytrain[fast]) or auto (the faster of the two here, timed once a process)
    state_bits: int = 32  # bits of each moment: 32 (torch's AdamW), or 8 or 4 (torchao's AdamW8bit / AdamW4bit, blockwise quantized; pip install relaytrain[lowbit])


@register_optimizer("lamb")
@dataclass
class LambConfig(OptimConfig):
    name: str = "lamb"
    lr: float = 1e-3
    eps: float = 1e-6  # added to the second-moment root
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # moment decay rates


@register_optimizer("muon")
@dataclass
class MuonConfig(OptimConfig):
    """torch.optim.Muon's keys and defaults for the blocks' matrices; adamw_* for every other
    parameter (`relaytrain.step.muon`)."""

    name: str = "muon"
    lr: float = 1e-3  # Muon's rate (before its shape scaling, adjust_lr_fn)
    weight_decay: float = 0.1  # decoupled, on Muon's matrices
    momentum: float = 0.95  # the momentum buffer's decay
    nesterov: bool = True  # orthogonalize Nesterov's look-ahead (torch's default) rather than the buffer
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # the quintic's a, b, c
    eps: float = 1e-7  # floor of the norm the update is divided by before the iterations
    adjust_lr_fn: str | None = None  # the rate's shape scaling: null or original (sqrt(max(1, out/in))), or match_rms_adamw (0.2 sqrt(max(out, in)))
    adamw_lr: float | None = None  # AdamW's rate on embeddings, head, norms, biases and routers (null: optim.lr); the schedule scales both alike
    adamw_weight_decay: float | None = None  # AdamW's decay on embeddings and head (null: optim.weight_decay); norms and biases take none
    adamw_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's moment decay rates
    adamw_eps: float = 1e-6  # AdamW's epsilon
    fused: bool = True  # AdamW's fused kernel, on CPU and CUDA
    orthogonalize_on: OrthogonalizeOn = OrthogonalizeOn.auto  # where the Newton-Schulz steps of host-held masters run beside a GPU (l2l, offloaded stages): auto (the faster, timed once a process), host or device


@register_optimizer("sgd")
@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    lr: float = 1e-2
    weight_decay: float = 0.0
    momentum: float = 0.0  # heavy-ball momentum (0: plain SGD)


# --------------------------------------------------------------------------- building


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only; biases and norm weights are not decayed. Parameters
    split over tensor-parallel ranks (DTensors) go in groups of their own: a fused kernel takes one kind."""
    groups: dict[tuple[bool, bool], list] = {}  # (not decayed, split) -> parameters; decayed first
    for name, p in named_params:
        if p.requires_grad:
            groups.setdefault((not decays(name, p), isinstance(p, DTensor)), []).append(p)
    return [{"params": params, "weight_decay": 0.0 if plain else weight_decay, "decayed": not plain}
            for (plain, _), params in sorted(groups.items())]


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], o, flat: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer; `flat`: its variant with flat state (FlatAdamW, FlatLamb, FlatSGD,
    FlatMuonWithAdamW). `named_params`' names say which matrices Muon takes (`step.muon`)."""
    if o.name == "muon":
        return (FlatMuonWithAdamW if flat else MuonWithAdamW)(muon_groups(named_params, o))
    groups = param_groups(named_params, o.weight_decay)
    decayed = [group.pop("decayed") for group in groups]  # by kind, whatever weight_decay is (LAMB's trust ratio)
    if o.name == "adamw" and o.state_bits != 32:
        return lowbit_adamw(groups, o)
    if o.name == "adamw":
        # torch's fused AdamW runs on CPU and CUDA: one kernel over all tensors of a group. A dry
        # run (meta device) takes the multi-tensor kernel: the same state, no fused kernel there.
        meta = any(p.device.type == "meta" for g in groups for p in g["params"])
        kind = torch.optim.AdamW
        if flat:
            kind = DeepSpeedAdamW if not meta and deepspeed_cpu_adam(str(o.host_kernel)) else FlatAdamW
        return kind(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=o.fused and not meta,
                    foreach=True if meta else None)
    if o.name == "lamb":
        for group, by_kind in zip(groups, decayed, strict=True):  # the trust ratio where weight decay is (see Lamb)
            group["trust_ratio"] = by_kind
        return (FlatLamb if flat else Lamb)(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return (FlatSGD if flat else torch.optim.SGD)(groups, lr=o.lr, momentum=o.momentum, foreach=True)


_DEEPSPEED: dict = {}  # "op": DeepSpeed's cpu_adam module once loaded, or "failure": why it did not load
_DEEPSPEED_IDS = itertools.count(1 << 20)  # the op's optimizer table is shared with DeepSpeedCPUAdam's ids (0, 1, ...)


def deepspeed_cpu_adam(host_kernel: str):
    """DeepSpeed's cpu_adam op when `optim.host_kernel` (auto, torch, deepspeed) asks for it and
    it loads, else None: the host AdamW then runs torch's kernel. `auto` takes the op only where
    it steps faster than torch's fused AdamW on this machine (`faster_kernel`)."""
    if host_kernel == "torch":
        return None
    op = _loaded_cpu_adam(host_kernel)
    if op is None or host_kernel != "auto":
        return op
    return op if faster_kernel() == "deepspeed" else None


def _loaded_cpu_adam(host_kernel: str):
    """The op, loaded once a process; a failure is said in one line, once, unless `auto` found
    DeepSpeed simply not installed."""
    if not _DEEPSPEED:
        try:
            _DEEPSPEED["op"] = _load_cpu_adam()
        except Exception as err:  # noqa: BLE001 - any failure to import or build means torch's kernel
            _DEEPSPEED["failure"] = err
    failure = _DEEPSPEED.get("failure")
    absent = isinstance(failure, ModuleNotFoundError) and failure.name == "deepspeed"
    if failure is not None and not _DEEPSPEED.get("said") and (host_kernel == "deepspeed" or not absent):
        _DEEPSPEED["said"] = True
        reason = first_line(failure)
        print(f"relaytrain: optim.host_kernel={host_kernel}: DeepSpeed's cpu_adam op is unavailable "
              f"({type(failure).__name__}: {reason}); the host optimizer runs torch's AdamW "
              f"(pip install relaytrain[fast] installs DeepSpeed)", file=sys.stderr, flush=True)
    return _DEEPSPEED.get("op")


def faster_kernel() -> str:
    """"deepspeed" or "torch": which of DeepSpeed's cpu_adam op and torch's fused AdamW steps
    4 M host parameters faster on this machine at this thread's torch threads (the median of 5
    steps each, after one), timed once a process and said in one line (`optim.host_kernel=auto`)."""
    if "faster" not in _DEEPSPEED:
        seconds = kernel_step_seconds()
        _DEEPSPEED["faster"] = min(seconds, key=seconds.get)
        print(f"relaytrain: optim.host_kernel=auto: AdamW over 4 M host parameters takes "
              f"{seconds['deepspeed'] * 1e3:.1f} ms a step with DeepSpeed's cpu_adam and {seconds['torch'] * 1e3:.1f} ms "
              f"with torch's fused kernel here; the host optimizer runs "
              f"{'DeepSpeed' if _DEEPSPEED['faster'] == 'deepspeed' else 'torch'}'s", file=sys.stderr, flush=True)
    return _DEEPSPEED["faster"]


def kernel_step_seconds(elements: int = 1 << 22) -> dict[str, float]:
    """Seconds of one AdamW step over `elements` host parameters, by kernel: the median of 5
    after a first (warm-up) step."""
    seconds = {}
    for name, kind in (("deepspeed", DeepSpeedAdamW), ("torch", FlatAdamW)):
        p = nn.Parameter(torch.zeros(elements))
        optimizer = kind([{"params": [p], "weight_decay": 0.0}], lr=1e-3, fused=True)
        times = []
        for _ in range(6):
            p.grad = torch.full_like(p, 1e-3)
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[1:])
    return seconds


def _load_cpu_adam():
    """Import DeepSpeed (quietly: it logs its accelerator guess) and load its cpu_adam op, built
    by torch's JIT with ninja and the C++ compiler the first time (about a minute) and cached under
    ~/.cache/torch_extensions. The CPU builder's, whatever the accelerator: the op steps host tensors."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
    finally:
        logging.disable(previous)
    return CPUAdamBuilder().load(verbose=False)


def state_words(o) -> float:
    """fp32 words of optimizer state per parameter: two moments for AdamW and LAMB, SGD's momentum.
    Muon's matrices keep one (the momentum), its AdamW parameters two: counted as two, the bound
    for the embeddings and head that the largest part holds."""
    if o.name == "sgd":
        return 1 if o.momentum else 0
    return lowbit_state_words(o.state_bits) if o.name == "adamw" else 2


def lr_at(step: int, o, total_steps: int) -> float:
    """Learning rate for optimizer update `step` (0-based) under the optim keys `o` over
    `total_steps` (`Schedule.at`)."""
    return Schedule(o.lr, o.warmup_steps, str(o.schedule), total_steps).at(step)


@dataclass(frozen=True)
class Schedule:
    """A run's learning rate at each optimizer update: optim.lr, optim.warmup_steps and
    optim.schedule over train.steps, as plain values (a run resolves it once)."""

    lr: float
    warmup_steps: int
    schedule: str  # after warm-up: constant, linear or cosine decay to 0
    total_steps: int

    def at(self, step: int) -> float:
        """Learning rate for optimizer update `step` (0-based): linear warm-up, then the schedule.

        `step` counts the updates applied before this one: the trainer passes it, not the training
        step, so a step an fp16 overflow skipped consumes no warm-up (as Hugging Face's Trainer and
        accelerate, whose scheduler does not step on a skipped update). Warm-up update k uses
        lr*(k+1)/warmup, reaching lr at the last warm-up update; Hugging Face's
        `get_linear_schedule_with_warmup` uses lr*k/warmup, whose first update has LR 0 and changes
        nothing but the optimizer's moments. relaytrain keeps every update a real one, at the price of
        being one update ahead of HF's ramp (equal at k = warmup); the decay that follows is HF's."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / decay_steps, 1.0)
        if self.schedule == "linear":
            return self.lr * (1.0 - progress)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate `lr` for every group, times the group's `lr_scale` where it has one
    (Muon's AdamW groups: optim.adamw_lr / optim.lr)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):  # torchao's optimizers keep it a tensor (`step.lowbit`)
            group["lr"].fill_(lr * group.get("lr_scale", 1.0))
        else:
            group["lr"] = lr * group.get("lr_scale", 1.0)


class Lamb(StepEachGroup, torch.optim.Optimizer):
    """LAMB (You et al., 2019): Adam's direction with a per-tensor trust ratio ||w|| / ||update||.

    A group with `trust_ratio=False` takes the ratio as 1 (plain Adam times lr): `build_optimizer`
    sets it for the tensors left out of weight decay (biases, norm weights), as BERT's reference
    LAMB excludes them from layer adaptation (`exclude_from_layer_adaptation` defaults to the
    weight-decay exclusions) and NVIDIA's FusedLAMB adapts only tensors with nonzero decay. It
    follows the kind of tensor, as BERT's does: with `optim.weight_decay=0` the matrices still
    get their ratio (FusedLAMB would drop it everywhere, leaving Adam).

    The trust ratio is per tensor, so updating one block at a time (the eager param server)
    gives exactly the update of one whole-model step. Implemented with torch's multi-tensor
    (`_foreach`) kernels: one launch per operation over all tensors of a group.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 trust_ratio: bool = True):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "trust_ratio": trust_ratio})

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:
                state["step"] = 0
                state["exp_avg"] = self._zeros("exp_avg", p)
                state["exp_avg_sq"] = self._zeros("exp_avg_sq", p)
            state["step"] += 1
        self._lamb(group, params, grads, states)

    def _zeros(self, key: str, p: torch.Tensor) -> torch.Tensor:
        """New state `key` of `p` (`FlatState` puts it in its flat buffer instead)."""
        return torch.zeros_like(p)

    def _lamb(self, group, params, grads, states) -> None:
        beta1, beta2 = group["betas"]
        step = states[0]["step"]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # Adam direction with bias correction, plus decoupled weight decay.
        m_hat = torch._foreach_div(exp_avg, 1 - beta1**step)
        denom = torch._foreach_sqrt(torch._foreach_div(exp_avg_sq, 1 - beta2**step))
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m_hat, denom)
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        if not group["trust_ratio"]:
            torch._foreach_add_(params, update, alpha=-group["lr"])
            return
        w_norms = torch._foreach_norm(params)
        u_norms = torch._foreach_norm(update)
        for p, u, w_norm, u_norm in zip(params, update, w_norms, u_norms, strict=True):
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            p.add_(u * trust, alpha=-group["lr"])


class FlatAdamW(StepEachGroup, AdamWRule, FlatState, torch.optim.AdamW):
    """torch's AdamW with its moments in flat buffers (`FlatState`), stepped by `AdamWRule`. Fused,
    each parameter group is one call of torch's fused kernel, without the Python torch.optim puts
    around it.

    That Python (`_init_group`, grouping the tensors by device and dtype, checks) was paid per
    part and group, and was most of what the eager param server's per-part updates cost beyond
    one whole-model step (docs/benchmarks.md). The kernel, its arguments and the step counts
    are the ones `torch.optim.AdamW(fused=True)` uses, so the numbers are bit for bit its own
    (torch.amp's GradScaler, which hands a fused step its scale, is not used: relaytrain
    unscales itself). Unfused (a dry run, `optim.fused=false`), torch's functional `adam` runs,
    as AdamW's step would.
    """

    @property
    def kernel(self) -> str:
        return "torch fused" if all(group["fused"] for group in self.param_groups) else "torch"

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        self._adamw(group, params)


class DeepSpeedAdamW(FlatAdamW):
    """FlatAdamW whose update runs DeepSpeed's cpu_adam op (`optim.host_kernel`): one call per
    tensor, on the same flat views and the same state in torch's format (a float32 step tensor
    and the two moments), so a checkpoint is the same file under either kernel and resumes
    under the other.

    The op's rule is torch's AdamW up to fp32 rounding (tests/test_host_adam.py): AdamW mode
    with bias correction, weight decay as `p -= lr * wd * p` before the Adam step, `eps`
    added to the bias-corrected root of the second moment. It writes through the tensors'
    memory, so a group runs it only when every parameter is a contiguous fp32 host tensor with
    an fp32 gradient (the flat views are); any other group, and AMSGrad or maximize, which it
    does not have, take torch's update.
    """

    kernel = "deepspeed cpu_adam"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._op = _DEEPSPEED["op"]  # build_optimizer loaded it
        self._id = next(_DEEPSPEED_IDS)
        d = self.defaults
        self._op.create_adam(self._id, d["lr"], *d["betas"], d["eps"], d["weight_decay"], True, False)

    def __del__(self):
        if hasattr(self, "_id"):
            self._op.destroy_adam(self._id)

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        if group["amsgrad"] or group["maximize"] or not all(map(_fits_cpu_adam, params)):
            super()._update(group, params)
            return
        states = [self._state(p, group) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        for p, state, step in zip(params, states, steps, strict=True):
            self._op.adam_update(self._id, int(step), group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                 True, p, p.grad, state["exp_avg"], state["exp_avg_sq"])


def _fits_cpu_adam(p: torch.Tensor) -> bool:
    """Whether the op can step `p` in place: it reads and writes raw fp32 memory on the host."""
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.grad.dtype == torch.float32
            and p.is_contiguous())


class FlatLamb(FlatState, Lamb):
    """LAMB with its moments in flat buffers. Its math stays per tensor (the trust ratio is)."""


class FlatSGD(StepEachGroup, FlatState, torch.optim.SGD):
    """torch's SGD with its momentum in a flat buffer: torch's functional `sgd` (foreach: one
    call per operation and group) over the flat views. torch makes a momentum buffer as a copy
    of the first gradient it sees; that copy moves into the flat buffer right after the step."""

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        rule = {"weight_decay": group["weight_decay"], "momentum": group["momentum"], "lr": group["lr"],
                "dampening": group["dampening"], "nesterov": group["nesterov"], "maximize": group["maximize"],
                "foreach": group["foreach"], "fused": group["fused"]}
        grads = [p.grad for p in params]
        if not group["momentum"]:
            sgd(params, grads, [], **rule)
            return
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        fresh = [p for p, buffer in zip(params, buffers, strict=True) if buffer is None]
        sgd(params, grads, buffers, **rule)  # fills the missing buffers with copies of the gradients
        for p, buffer in zip(params, buffers, strict=True):
            self.state[p]["momentum_buffer"] = buffer
        self._adopt(fresh)
