"""`strategy=baseline`: the whole-model strategy (whole_model.py) with every weight replicated.

Every worker holds the whole model, its gradients and its optimizer state. One worker is
Algorithm 1 of the L2L paper. With `strategy.replicas=R`, R workers each run it on their share
of every micro-batch, the model wrapped in torch's `DistributedDataParallel`: gradients are
summed over the workers in buckets while the last micro-batch's backward runs (`no_sync` for the
micro-batches before it), so each step makes one all-reduce, overlapped with compute. DDP's own
hook averages over the workers; the whole-model strategy's losses are already divided by the
whole minibatch's item count, so `_sum_hook` sums instead. With sequence parallelism DDP's sum
runs over all R x S workers.

With `strategy.tensor_parallel=T` each of the T workers of a replica holds its share of every
block (placement/tensor_parallel.py) and the whole rest. DDP does not take DTensor parameters, so
R > 1 replicas sum each worker's own parts over the replicate dim themselves (`_sum_gradients`:
all-reduces of flat buckets, after the last micro-batch's backward, not overlapped with it).
Checkpoints and saved models hold whole tensors by name, as at T=1: every tensor rank gathers
its parts (`full_state`), rank 0 writes, and loading cuts them again, so a run saved at any T
resumes at any other, or under another strategy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from relaytrain.placement.experts import ExpertShards, check_expert_parallel
from relaytrain.placement.tensor_parallel import (
    full_optimizer_state,
    full_state,
    load_full_optimizer_state,
    load_full_state,
    local,
)
from relaytrain.records.checkpoint import (
    load_model_state,
    model_state,
    trained_named_parameters,
    unique_named_parameters,
)
from relaytrain.schema.config import (
    ExpertParallelConfig,
    Recompute,
    SequenceParallelConfig,
    StrategyConfig,
    TensorParallelConfig,
    WorkersConfig,
)
from relaytrain.step.lowbit import state_bits
from relaytrain.strategies import register
from relaytrain.strategies.base import optimizer_tensors
from relaytrain.strategies.sequence_parallel import CutSequenceCost
from relaytrain.strategies.stash import Stash
from relaytrain.strategies.whole_model import WholeModel
from relaytrain.strategies.whole_model_cost import BUCKET_BYTES, BaselineCost


@dataclass
class BaselineConfig(ExpertParallelConfig, TensorParallelConfig, SequenceParallelConfig, WorkersConfig, StrategyConfig):
    name: str = "baseline"
    recompute: Recompute = Recompute.none  # none, or block: keep each block's input, recompute it in backward
    stash: Stash = Stash.device  # with recompute=block, where each block's input waits for its recompute: device, or host (out after its forward, back prefetched before its backward)


def _sum_hook(group, bucket):  # no annotations: DDP checks them, and these would be strings
    """All-reduce a bucket of gradients as a sum (DDP's own hook averages over the workers)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


class BaselineSequenceCost(CutSequenceCost, BaselineCost):
    """BaselineCost, on each worker's tokens where sequences are cut."""


@register("baseline")
class Baseline(WholeModel):
    """The whole model on every worker: replicas summing their gradients (DDP)."""

    Config = BaselineConfig
    cost_model = BaselineSequenceCost  # what the planner asks: whole_model_cost.py's closed forms

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        check_expert_parallel(cfg, cls, adapted_experts=True)

    def _place_weights(self) -> None:
        self.model.to(self.device)
        self.experts = (ExpertShards(self.model, self.layout, self.world.rank, self.world.simulated,
                                     self.world.timeout) if self.layout.experts > 1 else None)
        if self.experts is not None and state_bits(self.cfg.optim) != 32:
            self.experts.check_moments(trained_named_parameters(self.model), state_bits(self.cfg.optim))
        if self.synced and not self.split:  # DDP does not take split blocks' DTensors
            # The module is on its device already and a micro-batch is moved there before the
            # call. With gradients as bucket views DDP adds no device memory, so a dry run's
            # figure (no DDP: no process group) holds for the real run. Experts held in shares
            # are summed over their holders alone (`_sum_gradients`), and left out of DDP with
            # 4-bit experts' shares of storage, which its first broadcast would make rank 0's.
            if self.experts is not None:
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    self.net, [name for name, p in self.net.named_parameters() if self.experts.shares(p)])
            self.loss_of = DistributedDataParallel(self.net, device_ids=None, gradient_as_bucket_view=True,
                                                   bucket_cap_mb=BUCKET_BYTES / 2**20,
                                                   process_group=self.gradient_group)
            self.loss_of.register_comm_hook(self.gradient_group, _sum_hook)

    def _microbatch(self, last: bool) -> contextlib.AbstractContextManager:
        wrapped = self.loss_of is not self.net  # DDP
        return self.loss_of.no_sync() if wrapped and not last else contextlib.nullcontext()

    def _sum_gradients(self) -> None:
        """What DDP does not sum: split weights' replicas (DDP does not take DTensors), each
        worker's gradient parts over the replicas of its tensor part; experts held in shares, each
        over the workers holding it. In flat buckets of DDP's size."""
        if self.synced and self.experts is not None and self.experts.holder_group is not None:
            _sum_in_buckets(self.experts.expert_grads(self.params), self.experts.holder_group)
        if self.synced and self.split:
            _sum_in_buckets([local(p.grad) for p in self.params if p.grad is not None], self.gradient_group)

    def _clip(self, max_norm: float) -> None:
        if self.experts is None:
            super()._clip(max_norm)
        else:
            self.experts.clip_grad_norm_(self.params, max_norm)

    def _holds_parts(self) -> bool:
        return self.split or self.experts is not None

    def report(self) -> dict:
        figures = super().report()
        if self.experts is not None:
            figures["summary"] = {"expert parallel": f"every block's experts over {self.experts.degree} workers",
                                  **figures["summary"]}
        return figures

    def memory_holders(self) -> dict[str, list]:
        # Every weight: an adapter's frozen base (4-bit or not) is on the device as well as what trains.
        return {"weights": list(self.net.model.parameters()), "gradients": [p.grad for p in self.params],
                "optimizer state": optimizer_tensors([self.optimizer])}

    # -- state ----------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return [name for name, _ in trained_named_parameters(self.model)]

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Rank 0's, whole; split blocks gathered from their tensor ranks first (every worker calls this)."""
        if self.split:
            whole = full_state(self.model)
            return whole if self.world.rank == 0 else None
        if self.experts is not None:  # the experts' shares gathered (a collective)
            whole = {name: self.experts.gathered(p, p.detach()) for name, p in unique_named_parameters(self.model)}
            return whole if self.world.rank == 0 else None
        if self.world.rank != 0:  # every worker holds the same weights
            return None
        return {name: p.detach() for name, p in unique_named_parameters(self.model)}

    def state_dict(self) -> dict | None:
        """Rank 0's share holds everything, whole by name (every worker calls this: split blocks
        and their optimizer state are gathered); the other workers' hold nothing."""
        if self.split:
            state = self._whole_state()  # a collective
            return state if self.world.rank == 0 else None
        if self.experts is not None:
            state = self._whole_expert_state()  # a collective
            return state if self.world.rank == 0 else None
        if self.world.rank != 0:  # and the same optimizer state
            return None
        params = [p for _, p in trained_named_parameters(self.model)]
        return model_state(self.model, params, [self.optimizer], self.scaler)

    def _whole_expert_state(self) -> dict:
        """`model_state` as an E=1 run holds it: each expert tensor and its optimizer state gathered."""
        params = [p for _, p in trained_named_parameters(self.model)]
        state = model_state(self.model, [], [], self.scaler)
        state["weights"] = {self.model.hf_name(p): self.experts.gathered(p, p.detach()).cpu() for p in params}
        state["optimizer"] = {self.model.hf_name(p): {key: self.experts.gathered(p, v).cpu() if torch.is_tensor(v) else v
                                                      for key, v in self.optimizer.state[p].items()}
                              for p in params if p in self.optimizer.state}
        return state

    def _cut_expert_state(self, state: dict) -> dict:
        """A whole state (by name) with each expert tensor and its optimizer state cut to this worker's share."""
        weights, optimizer = dict(state["weights"]), dict(state["optimizer"])
        for name, p in trained_named_parameters(self.model):
            if name in weights:
                weights[name] = self.experts.cut(p, weights[name])
            if name in optimizer:
                optimizer[name] = {key: self.experts.cut(p, v) if torch.is_tensor(v) else v
                                   for key, v in optimizer[name].items()}
        return {**state, "weights": weights, "optimizer": optimizer}

    def _whole_state(self) -> dict:
        """This worker's share as a T=1 run's rank 0 holds it (`model_state`), gathered from the tensor ranks."""
        trained = {name for name, _ in trained_named_parameters(self.model)}
        weights = {name: t for name, t in full_state(self.model).items() if name in trained}
        return {"weights": weights, "optimizer": full_optimizer_state(self.model, [self.optimizer]),
                "scaler": self.scaler.state_dict(), "extra": None}

    def load_state_dict(self, state: dict) -> None:
        """Whole tensors by name (from any T, any strategy; `state_for` found every one), split
        ones cut as this worker holds them."""
        if self.experts is not None:
            state = self._cut_expert_state(state)
        if not self.split:
            load_model_state(self.model, [self.optimizer], self.scaler, state)
            return
        load_full_state(self.model, state["weights"])
        load_full_optimizer_state(self.model, [self.optimizer], state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _sum_in_buckets(grads: list[torch.Tensor], group) -> None:
    """Each gradient summed over `group`, in flat buckets of DDP's size (one all-reduce each)."""
    for bucket in _buckets(grads, BUCKET_BYTES):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(summed)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """`tensors` in consecutive groups of at most `limit` bytes each (a larger tensor alone)."""
    out, size = [[]], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return [bucket for bucket in out if bucket]
