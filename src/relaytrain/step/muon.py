"""Muon (`optim=muon`): torch's Muon for the blocks' weight matrices, AdamW for every other
parameter, as one optimizer.

Muon (Keller Jordan, 2024; Moonlight, Kimi K2) as `torch.optim.Muon` computes it: momentum on the
gradient (Nesterov's by default), the update orthogonalized by five Newton-Schulz steps in
bf16, its rate scaled by the matrix's shape (`adjust_lr_fn`), decoupled weight decay. It is a
rule for the hidden 2-D matrices only; embeddings, the head, norms, biases and a mixture's
routers take AdamW, with keys of their own (`optim.adamw_*`), as Moonlight and torchtitan split.

The split reads a parameter's name as the strategies hand it over (`takes_muon`): a matrix is
Muon's when it lies in a block (a whole model's `blocks.N.…`, a pipeline stage's
`model.blocks.N.…`, an eager-param-server part's `block.N.…`) and is no router (`is_router`: a module named `gate` or `…_gate`, the routers of
every mixture relaytrain trains; `gate_proj` and the experts' `gate_up_proj` are matrices). An
adapter's `lora_A`/`lora_B` in a block are matrices too; DoRA's magnitudes are vectors.

One optimizer, not two: one state dict for the checkpoints, one set of groups the schedule sets
(`set_lr` gives each group the schedule's rate times its `lr_scale`: 1 for Muon's groups,
`adamw_lr / lr` for AdamW's, so both follow the same warm-up and decay), built wherever a
strategy builds its optimizer. Each group steps by torch's own rules (Muon's Newton-Schulz and
rate scaling from `torch.optim._muon`, AdamW's fused kernel or functional `adam`), so a run
equals a plain loop of `torch.optim.Muon` and `torch.optim.AdamW` over the same split.

A mixture's fused experts ([experts, out, in]) are orthogonalized one expert's matrix at a time:
torch's Muon applied to each slice, each scaled by its own shape.

Masters held on the host (L2L's eager param server, offloaded pipeline stages) beside a GPU
step on the host, but the Newton-Schulz steps (about five products of every matrix with itself,
each step) may run on the GPU instead (`optim.orthogonalize_on`, `orthogonalizing_device`): the
update shipped there in bf16, where torch's iteration starts anyway, and the result back, on a
stream of its own beside the compute. `auto` times both once a process on the largest matrix
and takes the faster, said in one line.

Under FSDP a matrix is a DTensor split over the replicas. The momentum stays split (elementwise);
the update is gathered whole (one all-gather of the matrix per step, the same bytes as the
forward's gather of its weights), orthogonalized on every rank alike, and each rank keeps its
own rows: the same numbers as one process's, at the price of every rank computing every
matrix's Newton-Schulz steps.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from relaytrain.step.decay import decays
from relaytrain.step.flat import FlatState
from relaytrain.step.stepping import AdamWRule, StepEachGroup

BLOCKS = ("blocks", "block")  # a layered model's blocks.N (a pipeline stage's model.blocks.N), an EPS part's block.N


def in_a_block(name: str) -> bool:
    """Whether the parameter named `name` lies in one of the model's blocks."""
    parts = name.split(".")
    return any(a in BLOCKS and b.isdigit() for a, b in itertools.pairwise(parts))


def is_router(name: str) -> bool:
    """A mixture's router (Qwen's and OLMoE's `mlp.gate`, Mixtral's `block_sparse_moe.gate`,
    Qwen2-MoE's `shared_expert_gate`): AdamW's, as Moonlight keeps them."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""  # the module the weight belongs to
    return module == "gate" or module.endswith("_gate")


def takes_muon(name: str, p: torch.Tensor) -> bool:
    """Whether Muon steps `p` (named `name`): a matrix (or a stack of experts' matrices) in a
    block that is no router: what weight decay reaches there (`decays`: no bias, whatever its shape)."""
    return decays(name, p) and in_a_block(name) and not is_router(name)


def muon_groups(named_params: Iterable[tuple[str, nn.Parameter]], o) -> list[dict]:
    """The parameter groups of `optim=muon` (`o`): Muon's matrices, then AdamW's decayed tensors
    (embeddings, head) and undecayed ones (norms, biases); DTensors in groups of their own (a
    fused kernel takes one kind)."""
    muon_rule = {"kind": "muon", "lr": o.lr, "lr_scale": 1.0, "weight_decay": o.weight_decay,
                 "momentum": o.momentum, "nesterov": o.nesterov, "ns_coefficients": tuple(o.ns_coefficients),
                 "eps": o.eps, "ns_steps": o.ns_steps, "adjust_lr_fn": o.adjust_lr_fn}
    adamw_lr = o.lr if o.adamw_lr is None else o.adamw_lr
    adamw_decay = o.weight_decay if o.adamw_weight_decay is None else o.adamw_weight_decay
    groups: dict[tuple[bool, bool, bool], list] = {}  # (AdamW's, not decayed, split) -> parameters; Muon's first
    for name, p in named_params:
        if p.requires_grad:
            adamw = not takes_muon(name, p)
            groups.setdefault((adamw, adamw and not decays(name, p), isinstance(p, DTensor)), []).append(p)
    # As build_optimizer's AdamW: a dry run (the meta device) takes the multi-tensor rule, no fused kernel there.
    meta = any(p.device.type == "meta" for params in groups.values() for p in params)
    adamw_rule = {"kind": "adamw", "lr": adamw_lr, "lr_scale": adamw_lr / o.lr if o.lr else 1.0,
                  "betas": tuple(o.adamw_betas), "eps": o.adamw_eps, "fused": o.fused and not meta, "amsgrad": False,
                  "maximize": False, "foreach": True if meta else None, "capturable": False}
    return [{**adamw_rule, "params": params, "weight_decay": 0.0 if plain else adamw_decay} if adamw
            else {**muon_rule, "params": params} for (adamw, plain, _), params in sorted(groups.items())]


class MuonWithAdamW(StepEachGroup, AdamWRule, torch.optim.Optimizer):
    """Muon's groups and AdamW's (`AdamWRule`, FlatAdamW's own update) in one optimizer (the
    module's docstring). `orthogonalize_on`: where the Newton-Schulz steps run (None: where the
    parameters are)."""

    def __init__(self, groups: list[dict]):
        super().__init__(groups, {})
        self.orthogonalize_on: torch.device | None = None

    def muon_shapes(self) -> list[torch.Size]:
        """The shapes of the matrices Muon orthogonalizes (a stack of experts' counts each)."""
        return [p.shape[-2:] for group in self.param_groups if group["kind"] == "muon" for p in group["params"]]

    @property
    def kernel(self) -> str:
        return "torch muon + adamw"

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        if group["kind"] == "muon":
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = self._zeros("momentum_buffer", p)
                _muon_step(p, p.grad, state["momentum_buffer"], group, self.orthogonalize_on)
            return
        self._adamw(group, params)

    def _zeros(self, key: str, p: torch.Tensor) -> torch.Tensor:
        """New state `key` of `p` (`FlatState` puts it in its flat buffer instead)."""
        return torch.zeros_like(p)


class FlatMuonWithAdamW(FlatState, MuonWithAdamW):
    """Muon with AdamW, its momenta and moments in flat buffers (the eager param server's)."""


@torch.no_grad()
def _muon_step(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict,
               on: torch.device | None = None) -> None:
    """torch's Muon on `p`: a matrix, or a stack of matrices (a mixture's experts) each stepped
    as torch steps a matrix; a DTensor's update gathered whole first (the module's docstring);
    the Newton-Schulz steps `on` that device where given (`orthogonalized`)."""
    momentum, lr = group["momentum"], group["lr"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    split = isinstance(p, DTensor)
    whole = update.full_tensor() if split else update
    matrices = whole.reshape(-1, *whole.shape[-2:])
    if whole.device.type == "meta":  # a dry run: the shapes and the temporaries' sizes, not the values
        orthogonal = torch.empty_like(matrices)
    else:
        orthogonal = torch.stack([orthogonalized(m, group, on) for m in matrices])
    orthogonal = orthogonal.reshape(whole.shape).to(whole.dtype)
    if split:
        orthogonal = distribute_tensor(orthogonal, p.device_mesh, p.placements, src_data_rank=None).to_local()
    local = p.to_local() if split else p
    local.mul_(1 - lr * group["weight_decay"])
    local.add_(orthogonal, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], whole.shape[-2:]))


def orthogonalized(m: torch.Tensor, group: dict, on: torch.device | None = None) -> torch.Tensor:
    """torch's Newton-Schulz steps on the matrix `m` (bf16 out), run `on` that device where
    given: `m` shipped there in bf16 (the iteration's first step, so the same values) on a
    stream of its own, the result brought back to `m`'s device."""
    def steps(x: torch.Tensor) -> torch.Tensor:
        return _zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])

    if on is None:
        return steps(m)
    if on.type != "cuda":  # a CPU "device" is the host: the same path, no stream
        return steps(m.bfloat16().to(on)).to(m.device)
    stream = _STREAMS.get(on) or _STREAMS.setdefault(on, torch.cuda.Stream(on))
    with torch.cuda.stream(stream):
        out = steps(m.bfloat16().to(on, non_blocking=True)).to(m.device)
    stream.synchronize()  # the host reads it next
    return out


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # each GPU's stream for the Newton-Schulz steps
_CHOSEN: dict[tuple, torch.device | None] = {}  # orthogonalize_on=auto's choice, by (shape, device), once a process


def orthogonalizing_device(o, device: torch.device, shapes: list[torch.Size]) -> torch.device | None:
    """Where Muon's Newton-Schulz steps run for host-held masters beside `device` (None: the
    host): `optim.orthogonalize_on` host, device, or auto, which takes the host beside no GPU and
    otherwise the faster for the largest of `shapes` (timed once a process, said in one line)."""
    chosen = str(o.orthogonalize_on)
    if not shapes or chosen == "host" or device.type == "meta":
        return None
    if chosen == "device":
        return device
    if device.type != "cuda":
        return None
    shape = tuple(max(shapes, key=lambda s: s.numel()))
    key = (shape, device)
    if key not in _CHOSEN:
        host_s, device_s = (_newton_schulz_seconds(shape, on) for on in (None, device))
        _CHOSEN[key] = device if device_s < host_s else None
        print(f"relaytrain: optim.orthogonalize_on=auto: Newton-Schulz over a {shape[0]} x {shape[1]} matrix takes "
              f"{host_s * 1e3:.1f} ms on the host and {device_s * 1e3:.1f} ms on {device} with its copies; Muon "
              f"orthogonalizes on the {'device' if _CHOSEN[key] is not None else 'host'}", file=sys.stderr, flush=True)
    return _CHOSEN[key]


def orthogonalize_beside(optimizers: list, device: torch.device, o) -> None:
    """Every Muon among `optimizers` (host-held masters' beside `device`: an eager param server's
    parts) orthogonalizing where `orthogonalizing_device` decides for their matrices."""
    muons = [optimizer for optimizer in optimizers if isinstance(optimizer, MuonWithAdamW)]
    on = orthogonalizing_device(o, device, [shape for m in muons for shape in m.muon_shapes()]) if muons else None
    for optimizer in muons:
        optimizer.orthogonalize_on = on


def _newton_schulz_seconds(shape: tuple, on: torch.device | None, repeats: int = 3) -> float:
    """Median seconds of torch's default Newton-Schulz steps on a host matrix of `shape`, run `on`
    that device (its copies included) or on the host, after one untimed."""
    m = torch.randn(shape)
    group = {"ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "eps": 1e-7}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        orthogonalized(m, group, on)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
