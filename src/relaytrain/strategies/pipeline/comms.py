"""Who talks to whom: ranks laid out as replicas x stages, point-to-point transfers, gradient sums.

Rank r = replica * stages + stage: each pipeline (replica) is a run of consecutive ranks.
Activations flow to the next rank, gradients to the previous one. Gradients of a stage are
summed over its replicas (the paper's equi-replicated stages); a weight held by both the
first and the last stage (GPT-2's tied embedding and LM head) is summed over all their
copies, so every copy takes the same update and the tie holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    stages: int
    replicas: int

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a rank."""
        replica, stage = divmod(rank, self.stages)
        return stage, replica

    def describe(self, rank: int) -> str:
        stage, replica = self.position(rank)
        return f"rank {rank} (stage {stage} of {self.stages}, replica {replica})"


class Comms:
    """This rank's links: neighbours for transfers, process groups for gradient sums."""

    def __init__(self, topology: Topology, rank: int, has_tied_weights: bool, timeout_s: float):
        self.topology = topology
        self.stage, self.replica = topology.position(rank)
        self.prev = rank - 1 if self.stage > 0 else None
        self.next = rank + 1 if self.stage < topology.stages - 1 else None
        self.timeout = timedelta(seconds=timeout_s)
        self.replica_group = self._replica_group()
        self.tied_group = self._tied_group() if has_tied_weights else None

    def _replica_group(self):
        # Every rank must create every group, in the same order (torch.distributed's rule).
        mine = None
        if self.topology.replicas == 1:
            return None
        for stage in range(self.topology.stages):
            ranks = [self.topology.rank(stage, r) for r in range(self.topology.replicas)]
            group = dist.new_group(ranks, timeout=self.timeout)
            if stage == self.stage:
                mine = group
        return mine

    def _tied_group(self):
        last = self.topology.stages - 1
        if last == 0:
            return None
        ranks = sorted(self.topology.rank(s, r) for s in (0, last) for r in range(self.topology.replicas))
        group = dist.new_group(ranks, timeout=self.timeout)
        return group if self.stage in (0, last) else None

    def send(self, tensor: torch.Tensor, to: int) -> dist.Work:
        return dist.isend(tensor, to)

    def recv(self, buffer: torch.Tensor, source: int) -> torch.Tensor:
        dist.irecv(buffer, source).wait(self.timeout)
        return buffer


class GradReduction:
    """One batch's gradients (and the last stage's loss) being summed in the background.

    Everything travels in one flat buffer laid out [loss?, untied grads, tied grads]: the
    replica group sums the first part, the tied group (all copies of the tied weights) the
    second, so each tensor is reduced exactly once, with one collective per group.
    """

    def __init__(self, comms: Comms, grads: list[torch.Tensor], num_tied: int, loss: torch.Tensor | None):
        parts = ([loss.reshape(1).float()] if loss is not None else []) + [g.reshape(-1) for g in grads]
        self.flat = torch.cat(parts)
        self.shapes = [g.shape for g in grads]
        self.has_loss = loss is not None
        self.timeout = comms.timeout
        tied_elems = sum(g.numel() for g in grads[len(grads) - num_tied:]) if num_tied else 0
        split = self.flat.numel() - tied_elems
        self.works = []
        if comms.replica_group is not None:
            self.works.append(dist.all_reduce(self.flat[:split], group=comms.replica_group, async_op=True))
        if comms.tied_group is not None and tied_elems:
            self.works.append(dist.all_reduce(self.flat[split:], group=comms.tied_group, async_op=True))

    def finish(self) -> tuple[float | None, list[torch.Tensor]]:
        """Wait for the sums; return (summed loss or None, gradients shaped like the parameters)."""
        for work in self.works:
            work.wait(self.timeout)
        flat = self.flat[1:] if self.has_loss else self.flat
        sizes = [s.numel() for s in self.shapes]
        grads = [g.view(shape) for g, shape in zip(flat.split(sizes), self.shapes, strict=True)]
        return (float(self.flat[0]) if self.has_loss else None), grads


class StopVotes:
    """Every rank agrees on whether to stop (SIGINT/SIGTERM asked for it) without pausing the pipeline.

    Each rank votes at its REDUCE_GRADS(b) with the signal it was asked to stop by (0: none);
    the votes are combined (max) in the background and read a batch or two later, when every
    rank has long voted (`schedule.stop_vote_lag`), so all ranks read the same answer. The
    votes travel on their own gloo group: CPU tensors whatever the backend, and never queued
    behind a gradient sum.
    """

    def __init__(self, world_size: int, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(list(range(world_size)), timeout=self.timeout, backend="gloo")
        self.pending: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def cast(self, batch: int, signum: int) -> None:
        ballot = torch.tensor([signum], dtype=torch.int64)
        self.pending[batch] = ballot, dist.all_reduce(ballot, dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self, batch: int) -> int:
        ballot, work = self.pending.pop(batch)
        work.wait(self.timeout)
        return int(ballot)

    def settle(self, signum: int) -> int:
        """All ranks at once: read the votes still out, vote once more; the signal to stop with, or 0."""
        for batch in list(self.pending):
            signum = max(signum, self.result(batch))
        ballot = torch.tensor([signum], dtype=torch.int64)
        dist.all_reduce(ballot, dist.ReduceOp.MAX, group=self.group)
        return int(ballot)
