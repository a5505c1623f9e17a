"""`strategy=fsdp`: the whole-model strategy (whole_model.py) with every weight sharded, by
torch's fully sharded data parallelism (FSDP2, `fully_shard`; ZeRO stage 3).

R workers each train on their share of every micro-batch, as the baseline's replicas do, but
none holds the whole model: every parameter, its gradient and its optimizer state are split
in R shards along their first dimension (the layout's shard dim; with sequence parallelism
all R x S workers of its shard and sequence dims shard between them). `fully_shard` is applied to each block and then to
the root (the embeddings and the head together, so a tied embedding and LM head stay one
parameter): before a unit computes, its parameters are all-gathered; after it, they are
dropped again (`strategy.reshard_after_forward=true`: gathered once more for the backward,
ZeRO-3) or kept until its backward (`false`, ZeRO-2-like); its gradients are
reduce-scattered, so each worker updates only its shards. Micro-batches before the last skip
the reduce-scatter (`set_requires_gradient_sync(False)`): one per step. Without resharding
after forward they also keep the parameters gathered after their backward
(`set_reshard_after_backward(False)`): the peak already holds every block gathered, so this
costs no memory and leaves one all-gather a step instead of one per micro-batch, the bytes of
one DDP all-reduce in all. ZeRO-3 gathers twice per micro-batch: that is its memory's price.

Semantics are the plain loop's. Every micro-batch's loss is divided by the whole minibatch's
item count, so the workers' gradients must be summed, not averaged: every sharded unit reduces
with a plain SUM and a divide factor of 1 (gloo has no pre-multiplied sum, so the factor alone
would not do). Clipping sees the whole model's norm (torch's `clip_grad_norm_` reduces over
the shards, in another order than one process: the norm may differ in its last bit), and the
fp16 overflow check is agreed across the workers. `amp_bf16` / `amp_fp16` mean what they mean
under the baseline: fp32 parameters (gathered and reduced in fp32) and the forward under
`torch.autocast`, so LayerNorm, softmax and the residual adds stay fp32. FSDP's
`MixedPrecisionPolicy` with a half `param_dtype` would instead run every op in half: another
arithmetic under the same flag, so it is not used. `strategy.offload=host` is its `CPUOffloadPolicy` (the shards and the optimizer in host
memory), refused on a CPU device, where it would change nothing.

With `strategy.recompute=block`, `strategy.stash=host` keeps each block's input in host memory
until its recompute, as the baseline's does (`strategies/stash.py`).

Checkpoints are `torch.distributed.checkpoint` directories keyed by Hugging Face name (the
checkpoint layer writes them beside the parts): a run resumes exactly on the same number of
workers and by name on any other (DCP reshards), from a baseline's checkpoint, and the
baseline resumes from FSDP's. With one worker the strategy makes a process group of one.

With `strategy.expert_parallel=E` (placement/experts.py) each group of E workers shares every
block's experts, 1/E each, tokens sent to their holder by all-to-all; each share is a DTensor over
the expert mesh and its own unit, sharded over the R/E workers holding it (`_share_experts`).

A dry run cannot run FSDP's collectives on the meta device: it runs the same model unsharded
and reports its activations as tracked, with weights, gradients and optimizer state divided
by R and the gathered units added by FSDP's closed form, labelled so.

With `strategy.tensor_parallel=T` (R x T workers, a 2-D mesh as torchtitan's): the blocks are
split over the tensor dim first (placement/tensor_parallel.py), then `fully_shard` shards every
parameter over the shard dim's submesh, so a split weight is a DTensor over both dims (each
worker 1/(R x T) of it) and the rest over the shard dim alone. Checkpoints stay DCP directories
of whole tensors by name, so they resume at any R and T and under any strategy. T > 1 needs R > 1
(with one worker per tensor part there is nothing to shard: that is the baseline's
`strategy.tensor_parallel`) and no host offload (untried with split weights).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
from torch.distributed.tensor import DTensor, distribute_tensor

from relaytrain.placement.experts import ExpertShards, check_expert_parallel, expert_parallel
from relaytrain.placement.layout import Layout
from relaytrain.placement.tensor_parallel import clip_grad_norm_ as clip_split_grad_norm_
from relaytrain.placement.tensor_parallel import tensor_parallel
from relaytrain.placement.tensor_parallel import whole as _whole
from relaytrain.records.checkpoint import OPTIMIZER_PREFIX, Checkpoint, sharded_contents
from relaytrain.records.optimizer_state import load_optimizer_state
from relaytrain.schema.config import (
    ExpertParallelConfig,
    Offload,
    Recompute,
    SequenceParallelConfig,
    StrategyConfig,
    TensorParallelConfig,
    WorkersConfig,
)
from relaytrain.step.lowbit import check_quantized_shards, is_quantized, placed_moment, state_bits
from relaytrain.step.optim import set_lr
from relaytrain.strategies import register
from relaytrain.strategies.base import optimizer_tensors
from relaytrain.strategies.sequence_parallel import CutSequenceCost, sequence_parallel
from relaytrain.strategies.stash import Stash
from relaytrain.strategies.whole_model import STATE, WholeModel
from relaytrain.strategies.whole_model_cost import FsdpCost, gathered_params, unit_bytes
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.tensors import local as _local

# torch warns when an FSDP unit's output is a view, since an in-place op on it would skip the unit's
# pre-backward hook. A routed block's output is one by design (models/moe.py's `_Balance` returns
# `out.view_as(out)` to carry the balancing term's backward); nothing writes to a block's output in
# place, and the mixtures' FSDP runs equal the plain loop (tests/models/test_moe*.py).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDecoderBlock\) returned a view tensor")


@dataclass
class FsdpConfig(ExpertParallelConfig, TensorParallelConfig, SequenceParallelConfig, WorkersConfig, StrategyConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True  # true: ZeRO-3, parameters gathered again for backward; false: kept from forward to backward
    offload: Offload = Offload.none  # host: parameter, gradient and optimizer shards in host memory (needs a CUDA device)
    recompute: Recompute = Recompute.none  # none, or block: keep each block's input, recompute it in backward
    stash: Stash = Stash.device  # with recompute=block, where each block's input waits for its recompute: device, or host (out after its forward, back prefetched before its backward)


class FsdpSequenceCost(CutSequenceCost, FsdpCost):
    """FsdpCost, on each worker's tokens where sequences are cut."""


@register("fsdp")
class Fsdp(WholeModel):
    """One worker of R, holding 1/R of every parameter, gradient and optimizer state."""

    Config = FsdpConfig
    cost_model = FsdpSequenceCost  # what the planner asks: whole_model_cost.py's closed forms

    @classmethod
    def rank_layout(cls, cfg) -> Layout:
        s = cfg.strategy
        return Layout(shard=s.replicas, sequence=sequence_parallel(s), tensor=tensor_parallel(s),
                      experts=expert_parallel(s))

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        s, size = cfg.strategy, tensor_parallel(cfg.strategy)
        if size > 1 and s.replicas == 1:
            raise ConfigError(f"strategy=fsdp strategy.tensor_parallel={size} with strategy.replicas=1 has no dim to "
                              f"shard over; use strategy=baseline strategy.tensor_parallel={size}, or "
                              f"strategy.replicas=2 or more")
        for key, degree in (("tensor_parallel", size), ("expert_parallel", expert_parallel(s))):
            if degree > 1 and s.offload == Offload.host:
                raise ConfigError(f"strategy.offload=host with strategy.{key}={degree} is not supported yet; drop one")
        if size > 1 and state_bits(cfg.optim) != 32:  # DCP reshards torchao's moments along the first dim only
            raise ConfigError(f"optim.state_bits={cfg.optim.state_bits} with strategy=fsdp strategy.tensor_parallel={size}: "
                              f"FSDP's shards of a tensor rank's columns of 8- or 4-bit moments are not checked yet; "
                              f"use strategy=baseline for tensor parallelism with them, or optim.state_bits=32")
        check_expert_parallel(cfg, cls)

    @classmethod
    def check_device(cls, cfg, device: torch.device) -> None:
        if cfg.strategy.offload == Offload.host and device.type == "cpu":
            raise ConfigError("strategy.offload=host keeps the shards in host memory apart from the device's; on a "
                              "CPU device they are there already: use strategy.offload=none")

    @classmethod
    def state_layout(cls, cfg) -> dict:
        return {**super().state_layout(cfg), "sharded": True}

    # -- the placement: 1/(R x S) of everything on each worker ------------------------------------
    def _place_weights(self) -> None:
        # Sequence parallelism: every worker holds a shard (the mesh is all R x S of them, each
        # gradient summed over all), and its tokens of its replica's sequences.
        self.num_shards = self.layout.shard * self.layout.sequence
        self.sharded = not self.world.simulated
        self.own_group = False
        self.experts = None  # the experts' shares (`strategy.expert_parallel`), made by `_shard`
        if self.sharded:
            self._shard(self.model, self.cfg)
            bits = state_bits(self.cfg.optim)
            if bits != 32:  # torchao's blocks of each shard the whole tensor's (`lowbit._new_buffer`)
                check_quantized_shards(self._trained(), bits)
        else:
            self.model.to(self.device)
            if self.layout.experts > 1:  # its rows through its own experts (an even routing), as the baseline's dry run
                self.experts = ExpertShards(self.model, self.layout, self.world.rank, simulated=True, timeout=None)

    def _shard(self, model, cfg) -> None:
        """fully_shard every block, then the root; a process group of one where the run has none."""
        if not dist.is_initialized():
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
            self.own_group = True
        offloaded = cfg.strategy.offload == Offload.host
        if not offloaded:
            model.to(self.device)
        mesh = self.layout.submesh(self.device.type, "shard", "sequence")
        policy = dict(mesh=mesh, reshard_after_forward=bool(cfg.strategy.reshard_after_forward),
                      offload_policy=CPUOffloadPolicy() if offloaded else None)
        self._share_experts(model, policy["reshard_after_forward"])
        for block in model.blocks:
            fully_shard(block, **{k: v for k, v in policy.items() if v is not None})
        fully_shard(self.net, **{k: v for k, v in policy.items() if v is not None})
        on_gloo = dist.get_backend() == "gloo"
        for unit in (m for m in self.net.modules() if isinstance(m, FSDPModule)):  # the setters do not recurse
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
            if on_gloo:  # see ReduceScatterByAllReduce
                unit.set_custom_reduce_scatter(ReduceScatterByAllReduce())

    def _share_experts(self, model, reshard_after_forward: bool) -> None:
        """Expert parallelism (`strategy.expert_parallel=E`, placement/experts.py): each worker's
        share of every routed block's experts, a DTensor over the expert mesh's "experts" dim, is
        its own FSDP unit sharded over the workers holding the same share ("expert_data"): its
        gradients are summed over them alone, and a checkpoint holds every expert whole by name."""
        if self.layout.experts == 1:
            return
        expert_mesh = self.layout.expert_mesh(self.device.type)
        self.experts = ExpertShards(model, self.layout, self.world.rank, simulated=False, timeout=self.world.timeout,
                                    mesh=expert_mesh)
        for module in self.experts.modules:
            fully_shard(module, mesh=expert_mesh["expert_data"], reshard_after_forward=reshard_after_forward)

    def _clip(self, max_norm: float) -> None:
        """Over experts shared out, the gradients mix two meshes' DTensors: summed by tensor_parallel.py's."""
        if self.experts is None:
            super()._clip(max_norm)
        else:
            clip_split_grad_norm_(self.params, max_norm)

    def _microbatch(self, last: bool) -> contextlib.AbstractContextManager:
        if self.sharded:  # one reduce-scatter a step: with the last micro-batch's backward
            self.net.set_requires_gradient_sync(last)
            if not self.cfg.strategy.reshard_after_forward:  # and one all-gather (see the module)
                self.net.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def _holds_parts(self) -> bool:
        return self.sharded  # its shards: an overflow anywhere skips the step everywhere

    # -- state ------------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return list(dict.fromkeys(self.hf_names[n] for n, _ in self._trained()))

    def _trained(self):
        """(name, parameter) of what trains: what checkpoints hold (an adapter's base is left out)."""
        return ((n, p) for n, p in self.net.model.named_parameters() if p.requires_grad)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on the first worker (every worker gathers: a collective)."""
        whole = {self.hf_names[n]: _whole(p).detach().cpu() for n, p in self.net.model.named_parameters()}
        return whole if self.world.rank == 0 else None

    def state_dict(self) -> dict:
        """This worker's part: only what is not sharded (the loss scaler); the shards go to the
        checkpoint's sharded directory (`sharded_state_dict`)."""
        return {"weights": {}, "optimizer": {}, "scaler": self.scaler.state_dict(), "extra": None}

    def sharded_state_dict(self) -> dict | None:
        """Every shard this worker holds, keyed by Hugging Face name (optimizer state: under
        optimizer/<name>/<state>), for torch.distributed.checkpoint."""
        if not self.sharded:
            return None
        out = {}
        for name, p in self._trained():
            hf = self.hf_names[name]
            out[hf] = p
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{OPTIMIZER_PREFIX}{hf}/{key}"] = value
        return out

    def load_checkpoint(self, found: Checkpoint) -> None:
        """A sharded checkpoint straight into the shards (DCP reshards to this run's workers);
        any other by name, each worker keeping its shards of the whole tensors."""
        if not (found.sharded and self.sharded):
            super().load_checkpoint(found)
            return
        self._prime_optimizer()
        saved = sharded_contents(found.sharded_dir)
        # A parameter that had no gradient yet has no optimizer state there: it keeps none here
        # either (not the primed one), so its first update counts as its first, as uninterrupted.
        state = {k: v for k, v in self.sharded_state_dict().items() if k in saved or not k.startswith(OPTIMIZER_PREFIX)}
        with_state = {k[len(OPTIMIZER_PREFIX):].rsplit("/", 1)[0] for k in saved if k.startswith(OPTIMIZER_PREFIX)}
        for name, p in self._trained():
            if self.hf_names[name] not in with_state:
                self.optimizer.state.pop(p, None)
        dcp.load(state, checkpoint_id=found.sharded_dir)
        for key, value in state.items():  # non-tensor state (a step count) comes back in the dict
            if key.startswith(OPTIMIZER_PREFIX) and not torch.is_tensor(value):
                hf, field = key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
                self.optimizer.state[self._param(hf)][field] = value
        part = found.state_for([], self.world.rank)
        if part.get("scaler"):
            self.scaler.load_state_dict(part["scaler"])

    def load_state_dict(self, state: dict) -> None:
        """Whole tensors by name (another strategy's checkpoint): each worker keeps its shards."""
        with torch.no_grad():
            for name, p in self._trained():
                _local(p).copy_(_local(self._my_shard(state["weights"][self.hf_names[name]], p)))
        by_name = {hf: {k: self._my_shard(v, self._param(hf)) if _is_whole(v, self._param(hf)) else v
                        for k, v in fields.items()}
                   for hf, fields in state["optimizer"].items()}
        names = {p: self.hf_names[n] for n, p in self.net.model.named_parameters()}
        load_optimizer_state([self.optimizer], lambda p: names[p], by_name)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def _param(self, hf: str) -> torch.Tensor:
        return next(p for n, p in self.net.model.named_parameters() if self.hf_names[n] == hf)

    def _my_shard(self, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This worker's shard of a whole tensor, as FSDP splits `like` (no collective)."""
        if not isinstance(like, DTensor):
            return whole
        if is_quantized(whole):  # torchao's codes and scales of this worker's rows: whole blocks (`_place_weights`)
            return placed_moment(whole, like)
        return distribute_tensor(whole.to(like.device).detach(), like.device_mesh, like.placements,
                                 src_data_rank=None)

    def _prime_optimizer(self) -> None:
        """Make the optimizer's state exist (it is made lazily, by a first step) so a checkpoint can
        be loaded into it: one step on zero gradients at learning rate 0, then overwritten."""
        if self.optimizer.state:
            return
        for p in self.params:
            p.grad = torch.zeros_like(p)
        set_lr(self.optimizer, 0.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_holders(self) -> dict[str, list]:
        # Every weight: an adapter's frozen base (4-bit or not) is sharded too, as what trains.
        return {"weights": [_local(p) for p in self.net.parameters()],
                "gradients": [_local(p.grad) for p in self.params if p.grad is not None],
                "optimizer state": [_local(t) for t in optimizer_tensors([self.optimizer])]}

    def simulated_memory(self, tracker) -> dict:
        """The dry run ran the model unsharded (and unsplit): its activations as tracked, its
        weights, gradients and optimizer state as FSDP holds them (1/(R x S) each, of a tensor
        rank's share under T; none with offload) plus the units gathered at once: FSDP's closed
        form, said so."""
        figures = tracker.figures()
        offloaded = self.cfg.strategy.offload == Offload.host
        by_kind, peak = self._kept_state(figures, shards=self.num_shards, scale=self._every_expert())
        if offloaded:
            peak -= sum(by_kind[kind] for kind in STATE)
            by_kind.update(dict.fromkeys(STATE, 0))
        param_bytes = self.precision.weight_dtype.itemsize  # fp32 gathers under amp_* (see the module)
        ends = sum(unit_bytes(part, param_bytes) for part in (self.model.embed, self.model.head))
        block = int(unit_bytes(self.model.blocks[0], param_bytes) * self.kept["block"])  # a tensor rank's share
        by_kind["parameters gathered"] = gathered_params(self.cfg, ends, block, len(self.model.blocks))
        split = (f", each tensor rank's 1/{self.layout.tensor} of the blocks' split layers"
                 if self.layout.tensor > 1 else "")
        return {**figures, "peak_allocated_bytes": peak + by_kind["parameters gathered"], "by_kind": by_kind,
                "closed_form": True,
                "note": f"simulated activations (a dry run of the unsharded{' and unsplit' if split else ''} model on "
                        f"the meta device); weights, gradients and optimizer state as FSDP shards them{split}, and the "
                        f"gathered units by its closed form (the meta device runs no collectives)"}

    def _every_expert(self) -> dict[str, float] | None:
        """A dry run sharing the experts out holds a worker's share of them (its gathered blocks'),
        and FSDP keeps 1/R of every expert all the same: the tracked weights, and the gradients and
        optimizer state of what trains, scaled to every expert's."""
        if self.experts is None:
            return None
        params = {id(p): p for p in self.model.parameters()}.values()

        def whole_over_share(ps) -> float:
            ps = list(ps)
            held = sum(p.numel() for p in ps)
            shared = sum(p.numel() for p in ps if self.experts.holds(p))
            return (held + shared * (self.experts.degree - 1)) / max(held, 1)

        trained = whole_over_share(p for p in params if p.requires_grad)
        return {"weights": whole_over_share(params), "gradients": trained, "optimizer state": trained}

    def report(self) -> dict:
        s, out = self.cfg.strategy, super().report()
        shards = f"{s.replicas} workers, reshard after forward: {s.reshard_after_forward}, offload: {s.offload}"
        size = expert_parallel(s)
        shared = {"expert parallel": f"every block's experts over {size} workers"} if size > 1 else {}
        return {**out, "summary": {"shards": shards, **shared, **out["summary"]}}

    def close(self) -> None:
        super().close()
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()


class ReduceScatterByAllReduce(DefaultAllocMixin, ReduceScatter):
    """FSDP's reduce-scatter as an all-reduce of its input, then this worker's slice, for gloo.

    gloo's all-reduce is a pipelined ring; its reduce-scatter is not, and takes longer although
    it moves half the bytes: a block's 12.6 MB of gradients on two workers, 17-19 ms against
    10-12 ms (`scripts/bench_gloo_collectives.py`, docs/benchmarks.md). The input is FSDP's own
    staging buffer, summed in place. gloo's all-gather is as fast as its all-reduce at these
    sizes, so FSDP keeps its own; NCCL keeps FSDP's own reduce-scatter."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        dist.all_reduce(input_tensor, op=op, group=group)
        n = output_tensor.numel()
        output_tensor.copy_(input_tensor.view(-1).narrow(0, dist.get_rank(group) * n, n).view_as(output_tensor))
        return None


def _is_whole(value, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == like.shape and isinstance(like, DTensor)
