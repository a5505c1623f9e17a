"""Expert parallelism (`strategy.expert_parallel=E`): the data-parallel workers, in groups of E
consecutive replicas, each hold 1/E of every routed block's experts, and every token visits the
worker that holds its expert.

As Megatron and torchtitan carve it, the experts degree divides the replicas: R workers form R/E
*expert groups* of E; worker i of a group holds experts [i n/E, (i+1) n/E) of every block's n
(the fused `experts.gate_up_proj` / `down_proj` and any other per-expert tensor, GPT-OSS's biases,
cut in place: the parameters stay the model's own, so names, the optimizer and the checkpoint
code see them as before), and peft's LoRA on them, each expert's rows of A and columns of B
(`ExpertAxis`). Everything else is replicated as under plain replicas.

A routed block's experts module computes (`ExpertParallel.forward`):

1. each (token, pick) assignment sorted by expert, so the picks of each owner are one run;
2. the rows sent to their owners in one all-to-all (`torch.distributed.nn`'s, which carries the
   gradient back the same way), with their experts' local indices;
3. the owner runs Hugging Face's own experts forward on what it received, one pick a row with
   weight 1 (its implementation, eager or grouped_mm, its activations, clamps and biases);
4. the outputs return by the inverse all-to-all, are weighted by the router's weights and added
   into each token's row in ascending expert order, as Hugging Face's loop adds them.

An expert's gradient is then the sum over every token of its group that picked it; summed over
the R/E workers that hold the same experts (`holder_group`) it is the plain loop's. Those
parameters are left out of DDP, which sums everything else over all R workers. Under FSDP (its R
shards the data-parallel workers) each share is a DTensor over the expert mesh
(`Layout.expert_mesh`) and its own FSDP unit over the holders (strategies/fsdp.py), so FSDP sums
its gradients over them and DCP writes it whole. A checkpoint and a saved model hold whole
tensors by name (`gathered`, `cut`), so a run saved at any E resumes at any other, or under
another strategy; 8- and 4-bit AdamW moments (`optim.state_bits`) as torchao's codes and
scales, whole blocks of each share (`check_moments`). A dry run (no process group) computes each
worker's share as if the routing were even: its own rows through its own experts, so its device
figures are one worker's (1/E of the experts' weights, gradients and optimizer state).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from relaytrain.models.quantize_experts import EXPERTS_NDIM, ExpertsLayout, NF4Experts, fused_tensors
from relaytrain.placement.layout import Layout
from relaytrain.step.lowbit import BLOCK, cut, gathered_parts, is_quantized, joined, quantizes
from relaytrain.utils.errors import ConfigError


def expert_parallel(strategy) -> int:
    """E, from the `strategy` config node (1: experts replicated; a strategy without the key shares none)."""
    return int(getattr(strategy, "expert_parallel", 1))


def check_expert_parallel(cfg, strategy, adapted_experts: bool = False) -> None:
    """`strategy.expert_parallel=E`: dividing the replicas of the layout of the run's `strategy`
    class, on a mixture whose experts divide by E, with what the placement supports so far;
    `adapted_experts`: whether the strategy shares out experts under an adapter (LoRA on them,
    4-bit ones) as the baseline does."""
    s = cfg.strategy
    size = expert_parallel(s)
    if size < 1:
        raise ConfigError(f"strategy.expert_parallel={size} must be at least 1")
    if size == 1:
        return
    layout = strategy.rank_layout(cfg)
    if s.replicas % size:
        raise ConfigError(f"strategy.expert_parallel={size} must divide strategy.replicas={s.replicas} (each group of "
                          f"{size} replicas shares every block's experts)")
    experts = cfg.model.num_experts or 0
    if experts % size or not experts:
        raise ConfigError(f"strategy.expert_parallel={size}: the model's {experts} experts a block do not divide "
                          f"over {size} workers" if experts else
                          f"strategy.expert_parallel={size}: the model has no experts (a dense model)")
    for dim in layout.mesh_dims:
        if dim not in ("replicate", "shard"):
            raise ConfigError(f"strategy.expert_parallel={size} with strategy.{dim}_parallel={getattr(layout, dim)} is "
                              f"not supported yet; set one to 1")
    if cfg.train.compile:
        raise ConfigError(f"strategy.expert_parallel={size} with train.compile=true is not supported yet (the "
                          f"experts' all-to-alls are not compiled here); drop one")
    if cfg.adapter.name != "none" and cfg.model.quantize != "none" and not adapted_experts:
        raise ConfigError(f"strategy.expert_parallel={size} shares 4-bit experts (model.quantize={cfg.model.quantize}) "
                          f"under strategy=baseline; not yet under strategy={s.name}")
    if cfg.adapter.name != "none" and cfg.adapter.target_parameters and not adapted_experts:
        raise ConfigError(f"strategy.expert_parallel={size} with LoRA on the experts (adapter.target_parameters) "
                          f"runs under strategy=baseline; not yet under strategy={s.name}")


class ExpertShards:
    """This worker's share of every routed block's experts, and the groups it talks to: the
    layout's expert groups (`Layout.expert_groups`)."""

    def __init__(self, model: nn.Module, layout: Layout, rank: int, simulated: bool, timeout,
                 mesh: DeviceMesh | None = None):
        degree = layout.experts
        if mesh is not None and any(isinstance(m, ParamWrapper) for block in model.blocks for m in block.modules()):
            raise ConfigError(f"strategy.expert_parallel={degree} under FSDP: the adapter adapts the experts "
                              f"(adapter.target_parameters, or target modules named gate_proj/up_proj/down_proj, as "
                              f"all-linear names a dense MLP's, which peft turns into LoRA on the fused experts), "
                              f"which runs under strategy=baseline only so far; use it, or name the modules "
                              f"(adapter.target_modules=[q_proj,k_proj,v_proj,o_proj])")
        self.degree, self.index = degree, layout.expert_share(rank)
        # The groups this worker exchanges tokens with and sums its experts' gradients over; none
        # in a dry run, which computes its rows through its own experts. Under FSDP they are the
        # dims of its expert `mesh` (`Layout.expert_mesh`), and each share is a DTensor over it.
        self.mesh, self.modules = mesh, []
        self.share_group = self.holder_group = None
        if mesh is not None:
            self.share_group = mesh.get_group("experts")
            self.holder_group = mesh.get_group("expert_data") if mesh.size(0) > 1 else None
        elif not simulated:  # every process makes every group, in one order
            shares, holders = layout.expert_groups()
            for ranks in shares:
                group = dist.new_group(ranks, timeout=timeout)
                self.share_group = group if rank in ranks else self.share_group
            for ranks in holders:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                self.holder_group = group if rank in ranks else self.holder_group
        self.params: dict[int, ExpertAxis] = {}  # id(parameter) -> where the whole tensor holds its experts
        self.storages: dict[int, ExpertsLayout] = {}  # id(4-bit storage) -> the whole tensor's layout
        for block in model.blocks:
            for module in block.modules():
                if fused_tensors(module) or isinstance(module, NF4Experts):
                    self._cut_module(module)
                elif isinstance(module, ParamWrapper):
                    self._cut_adapter(module)

    def _cut_module(self, module: nn.Module) -> None:
        if isinstance(module, NF4Experts):  # 4-bit experts: each storage cut to this worker's experts (frozen)
            experts = next(iter(module.nf4_layouts.values())).experts
            for name, layout in module.nf4_layouts.items():
                stored = module._parameters[name]
                module.nf4_layouts[name], stored.data = layout.share(stored.data, self.index, self.degree)
                self.storages[id(stored)] = layout
        else:
            experts = next(p.shape[0] for p in module.parameters(recurse=False) if p.ndim == EXPERTS_NDIM)
        local = experts // self.degree
        mine = slice(self.index * local, (self.index + 1) * local)
        axis = ExpertAxis(0, experts)
        with torch.no_grad():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.ndim >= 2 and p.shape[0] == experts:
                    share = p.data[mine].clone()
                    if self.mesh is not None:  # FSDP shards it over the holders: a DTensor of the whole
                        share = nn.Parameter(DTensor.from_local(share, self.mesh["experts"], [Shard(0)], run_check=False),
                                             requires_grad=p.requires_grad)
                        setattr(module, name, share)
                        p = share
                    else:
                        p.data = share
                    self.params[id(p)] = axis
        module.num_experts = local  # what Hugging Face's experts forward counts its experts by
        self.modules.append(module)
        module.__class__ = _parallel_class(type(module))
        module.expert_shards = self

    def _cut_adapter(self, wrapper: ParamWrapper) -> None:
        """peft's LoRA on a fused expert tensor, cut as its experts are: A holds r rows an expert,
        expert by expert; B's r x experts columns run expert-fastest (peft's `get_delta_factors`)."""
        experts = wrapper.num_experts
        with torch.no_grad():
            for name in wrapper.lora_A:
                r = wrapper.r[name]
                for p, axis in ((wrapper.lora_A[name].weight, ExpertAxis(0, experts, r)),
                                (wrapper.lora_B[name].weight, ExpertAxis(1, experts, r, minor=True))):
                    p.data = axis.share(p.data, self.index, self.degree)
                    self.params[id(p)] = axis
        wrapper.num_experts = experts // self.degree

    def holds(self, p: torch.Tensor) -> bool:
        """Whether `p` is a share of a trained expert tensor (its gradient summed over the holders)."""
        return id(p) in self.params

    def shares(self, p: torch.Tensor) -> bool:
        """Whether `p` differs from worker to worker of a group: a trained share, or a share of 4-bit
        experts' storage (frozen): what a replica must not take from another (DDP's broadcast)."""
        return id(p) in self.params or id(p) in self.storages

    def check_moments(self, named_params, bits: int) -> None:
        """8- or 4-bit AdamW moments (`optim.state_bits`) of a share are the whole tensor's when torchao
        decides alike on both (`lowbit.quantizes`) and a share holds whole blocks of consecutive
        values: one line naming the first share that would not."""
        block = BLOCK[bits]
        for name, p in named_params:
            axis = self.params.get(id(p))
            if axis is None or not quantizes(p.numel() * self.degree, block):
                continue
            if axis.minor or not quantizes(p.numel(), block):
                columns = ", every expert's columns of it" if axis.minor else ""
                raise ConfigError(f"optim.state_bits={bits} with strategy.expert_parallel={self.degree}: {name}'s share "
                                  f"({tuple(p.shape)}{columns}) would not "
                                  f"hold whole blocks of {block} of the whole tensor's moments as torchao quantizes "
                                  f"them; use optim.state_bits=32, or another strategy.expert_parallel")

    # -- gradients ----------------------------------------------------------------------------
    def expert_grads(self, params) -> list[torch.Tensor]:
        """The gradients of this worker's expert shares among `params`: summed over `holder_group`."""
        return [p.grad for p in params if self.holds(p) and p.grad is not None]

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """torch's global-norm clipping, every expert counted once: the replicated gradients' squares
        here, the experts' summed over the expert group."""
        with_grads = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grads]
        replicated = [p.grad for p in with_grads if not self.holds(p)]
        experts = [p.grad for p in with_grads if self.holds(p)]
        squares = torch.zeros((), device=grads[0].device)
        if experts:
            squares = torch.stack([n.float() for n in torch._foreach_norm(experts)]).square().sum()
        if self.share_group is not None:
            dist.all_reduce(squares, group=self.share_group)
        if replicated:
            squares = squares + torch.stack([n.float() for n in torch._foreach_norm(replicated)]).square().sum()
        norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm, foreach=True)
        return norm

    # -- whole tensors by name ------------------------------------------------------------------
    def gathered(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (a share of parameter `p`'s shape, or anything else) whole: the expert group's
        shares in order (a collective of the group where `p` is an expert tensor)."""
        if id(p) in self.storages and self.share_group is not None:  # 4-bit experts: every share's storage joined
            parts = [torch.empty_like(value) for _ in range(self.degree)]
            dist.all_gather(parts, value.contiguous(), group=self.share_group)
            return self.storages[id(p)].joined(parts)
        if not self.holds(p) or value.shape != p.shape:
            return value
        if self.share_group is None:  # a dry run holds its share alone
            return value
        if is_quantized(value):  # torchao's codes and scales of whole blocks (`check_moments`)
            return joined(gathered_parts(value, self.share_group, self.degree))
        parts = [torch.empty_like(value) for _ in range(self.degree)]
        dist.all_gather(parts, value.contiguous(), group=self.share_group)
        return self.params[id(p)].join(parts)

    def cut(self, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This worker's share of a whole tensor of expert parameter `p` (anything else as it is)."""
        axis = self.params.get(id(p))
        if axis is None or not axis.holds_all(whole):
            return whole
        if is_quantized(whole):  # codes and scales of its rows: whole blocks (`check_moments`)
            n = whole.shape[0] // self.degree
            return cut(whole, 0, self.index * n, (self.index + 1) * n)
        return axis.share(whole, self.index, self.degree)


class ExpertAxis(NamedTuple):
    """Where a tensor holds a block's `experts`: along `dim`, as experts x `inner` (expert-major:
    the fused tensors, LoRA's A) or, `minor`, inner x experts (LoRA's B)."""

    dim: int
    experts: int
    inner: int = 1
    minor: bool = False

    def holds_all(self, t: torch.Tensor) -> bool:
        return t.ndim > self.dim and t.shape[self.dim] == self.experts * self.inner

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """`t` with `dim` split in two, the experts' axis at `dim + minor`."""
        factors = (self.inner, -1) if self.minor else (-1, self.inner)
        return t.reshape(*t.shape[:self.dim], *factors, *t.shape[self.dim + 1:])

    def _merged(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:self.dim], -1, *t.shape[self.dim + 2:])

    def share(self, whole: torch.Tensor, index: int, degree: int) -> torch.Tensor:
        """Experts [index n/degree, (index + 1) n/degree) of a whole tensor, contiguous."""
        local = self.experts // degree
        return self._merged(self._split(whole).narrow(self.dim + self.minor, index * local, local)).clone()

    def join(self, shares: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor of every share, in order."""
        return self._merged(torch.cat([self._split(s) for s in shares], dim=self.dim + self.minor))


class ExpertParallel(nn.Module):
    """The behaviour an experts module's class gains: each assignment computed by the worker holding
    its expert (see the module)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        shards, local = self.expert_shards, self.num_experts
        k = top_k_index.shape[1]
        picks = top_k_index.reshape(-1)
        order = torch.argsort(picks, stable=True)  # by expert, each expert's in token order
        experts, token_of = picks[order], order // k
        rows = hidden_states[token_of]
        if shards.share_group is None:  # a dry run: this worker's rows through its own experts, an even routing
            out = self._local(rows, experts % local)
        else:
            out = self._dispatched(shards, rows, experts, local)
        weighted = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token_of, weighted.to(hidden_states.dtype))

    def _dispatched(self, shards: ExpertShards, rows: torch.Tensor, experts: torch.Tensor, local: int):
        owner = experts // local
        send = torch.bincount(owner, minlength=shards.degree)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=shards.share_group)
        send, receive = send.tolist(), receive.tolist()
        ids = torch.empty(sum(receive), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(ids, experts - owner * local, receive, send, group=shards.share_group)
        arrived = dist_nn.all_to_all_single(rows.new_empty((sum(receive), rows.shape[1])), rows.contiguous(),
                                            receive, send, group=shards.share_group)
        out = self._local(arrived, ids)
        return dist_nn.all_to_all_single(out.new_empty((sum(send), out.shape[1])), out.contiguous(), send, receive,
                                         group=shards.share_group)

    def _local(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Hugging Face's experts forward on rows of one pick each (weight 1: the output itself),
        over this worker's share of the experts (under FSDP: the gathered DTensors' local parts)."""
        weights = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
        with _local_shares(self):
            return super().forward(rows, ids.reshape(-1, 1), weights)


@contextmanager
def _local_shares(module: nn.Module):
    """`module`'s DTensor parameters (FSDP's gathered experts, sharded over the expert group) seen as
    this worker's share while Hugging Face's forward runs; `to_local` carries the gradient back."""
    held = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, p in held.items():
        module._parameters[name] = p.to_local()
    try:
        yield
    finally:
        module._parameters.update(held)


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _CLASSES[cls]
