"""Replicas (`Peers`, L2L's `strategy.replicas`): the EPS among several workers.

Several workers relay the same parts over their own rows of every minibatch; a part's
gradients are summed over them as soon as its backward has finished (the collective runs
while the parts below compute), then the part is updated once. Two placements of the EPS state:
- `replicated`: every worker all-reduces the gradients and steps every part: R copies of
  the gradients and optimizer state, no further traffic;
- `sharded` (ZeRO-style): each part has one owner worker, balanced by size. Its gradients
  are reduced to the owner only, the owner alone keeps the part's gradients and optimizer
  state and steps it, then broadcasts the updated fp32 weights (its buffer, one tensor:
  every worker lays a part out alike). Host memory per worker falls from 4 to 1 + 3/R fp32
  words per parameter (AdamW), and each update runs once, not R times, for the same
  traffic (a reduce plus a broadcast is an all-reduce's volume).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from relaytrain.placement.world import DoneWork
from relaytrain.strategies.eps.parts import Part


class Peers:
    """This worker among the replicas: who owns which part, and the collectives between them.

    Two process groups, because two threads issue collectives and each group must see the
    same order on every worker: the caller's (gradient sums, in backward order) and the EPS
    worker's (updated weights, clipping norms, overflow votes, in its task order).
    """

    def __init__(self, rank: int, size: int, sharded: bool, timeout, dry: bool = False):
        self.rank, self.size, self.sharded = rank, size, sharded
        self.timeout = timeout
        self.dry = dry  # a dry run on the meta device: the same buffers, nothing moves
        self.grads_group = None if dry else dist.new_group(list(range(size)), timeout=timeout)
        self.updates_group = None if dry else dist.new_group(list(range(size)), timeout=timeout)
        self.reduce_s = 0.0  # wall time the gradient sums ran (one after another on their group)
        self.exposed_s = 0.0  # the part of it after the backward had finished: what the step waited for
        self._last_done = 0.0
        self._backward_end = 0.0

    def assign(self, parts: list[Part]) -> list[int]:
        """Owner rank of every part: all local when replicated; else parts that share a master
        (tied weights) go together, largest first, to the least-loaded worker."""
        if not self.sharded:
            return [self.rank] * len(parts)
        groups: list[list[int]] = []
        for index, part in enumerate(parts):
            ids = {id(p) for p in part.masters}
            joined = [g for g in groups if ids & {id(p) for i in g for p in parts[i].masters}]
            merged = [index] + [i for g in joined for i in g]
            groups = [g for g in groups if g not in joined] + [sorted(merged)]
        load = [0] * self.size
        owners = [0] * len(parts)
        for group in sorted(groups, key=lambda g: (-sum(parts[i].num_params for i in g), g[0])):
            rank = min(range(self.size), key=lambda r: (load[r], r))
            load[rank] += sum(parts[i].num_params for i in group)
            for i in group:
                owners[i] = rank
        return owners

    def start_reduce(self, flat: torch.Tensor, owner: int) -> dist.Work:
        """Sum `flat` over the replicas, on every worker (replicated) or on the owner (sharded)."""
        issued = time.perf_counter()
        if self.dry:
            work = DoneWork()
        elif self.sharded:
            work = dist.reduce(flat, dst=owner, group=self.grads_group, async_op=True)
        else:
            work = dist.all_reduce(flat, group=self.grads_group, async_op=True)
        work.get_future().add_done_callback(lambda _: self._done(issued))
        return work

    def _done(self, issued: float) -> None:
        now = time.perf_counter()
        self.reduce_s += now - max(issued, self._last_done)  # sums queue behind each other on the group
        self._last_done = now

    def backward_finished(self, at: float) -> None:
        """Called once the step's last gradients are handed over; what runs after is exposed."""
        self._backward_end = at

    def step_finished(self) -> None:
        self.exposed_s += max(0.0, self._last_done - self._backward_end)

    def wait(self, work: dist.Work | None) -> None:
        if work is not None:
            work.wait(self.timeout)

    def broadcast(self, tensors: list[torch.Tensor], owner: int) -> None:
        if self.dry:
            return
        works = [dist.broadcast(t, src=owner, group=self.updates_group, async_op=True) for t in tensors]
        for work in works:
            work.wait(self.timeout)

    def total(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """`value` summed (or `op`) over the replicas, from the EPS worker's thread."""
        if not self.dry:
            dist.all_reduce(value, op=op, group=self.updates_group)
        return value

    def sum_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """From the caller's thread, after every gradient sum of the step (the same order everywhere)."""
        if not self.dry:
            dist.all_reduce(value, group=self.grads_group)
        return value
