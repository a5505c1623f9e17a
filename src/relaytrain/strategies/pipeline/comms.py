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

from relaytrain.world import DoneWork


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

    def __init__(self, topology: Topology, rank: int, has_tied_weights: bool, timeout_s: float, dry: bool = False):
        self.topology = topology
        self.dry = dry  # a dry run on the meta device: the same buffers, nothing sent
        self.stage, self.replica = topology.position(rank)
        self.prev = rank - 1 if self.stage > 0 else None
        self.next = rank + 1 if self.stage < topology.stages - 1 else None
        self.timeout = timedelta(seconds=timeout_s)
        self.replica_group = self._replica_group()
        self.tied_group = self._tied_group() if has_tied_weights else None
        self.loss_group = self._loss_group()
        # gloo's point-to-point operations are independent of each other (each irecv is its own
        # posted buffer, matched by source and tag in posting order), so receives may be posted
        # ahead of time and the tied copies' sum exchanged point to point. NCCL queues all of a
        # pair's operations on one stream: there a receive posted early would block the sends
        # behind it, so those paths are gloo only.
        self.async_p2p = dry or dist.get_backend() == "gloo"
        # One pipeline (replicas == 1): the tied weights have exactly two copies, on the first and
        # the last stage; each sends its gradient to the other, which adds it (a + b == b + a
        # exactly, so both copies get bit-identical sums, as the all-reduce gives them).
        self.tied_peer = None
        if self.async_p2p and has_tied_weights and self.tied_group is not None and topology.replicas == 1:
            self.tied_peer = topology.rank(topology.stages - 1 if self.stage == 0 else 0, 0)

    def _replica_group(self):
        # Every rank must create every group, in the same order (torch.distributed's rule).
        mine = None
        if self.topology.replicas == 1:
            return None
        for stage in range(self.topology.stages):
            ranks = [self.topology.rank(stage, r) for r in range(self.topology.replicas)]
            group = self._new_group(ranks)
            if stage == self.stage:
                mine = group
        return mine

    def _tied_group(self):
        last = self.topology.stages - 1
        if last == 0:
            return None
        ranks = sorted(self.topology.rank(s, r) for s in (0, last) for r in range(self.topology.replicas))
        group = self._new_group(ranks)
        return group if self.stage in (0, last) else None

    def _loss_group(self):
        """The last stages of every replica, summing each batch's loss (gloo: a CPU scalar)."""
        if self.topology.replicas == 1:
            return None
        last = self.topology.stages - 1
        ranks = [self.topology.rank(last, r) for r in range(self.topology.replicas)]
        group = self._new_group(ranks, backend="gloo")
        return group if self.stage == last else None

    def _new_group(self, ranks: list[int], backend: str | None = None):
        if self.dry:
            return tuple(ranks)  # stands for the group: nothing goes through it
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    def send(self, tensor: torch.Tensor, to: int, tag: int = 0) -> dist.Work:
        return DoneWork() if self.dry else dist.isend(tensor, to, tag=tag)

    def recv(self, buffer: torch.Tensor, source: int) -> torch.Tensor:
        self.post_recv(buffer, source).wait(self.timeout)
        return buffer

    def post_recv(self, buffer: torch.Tensor, source: int, tag: int = 0) -> dist.Work:
        """Start receiving into `buffer`; `wait(timeout)` on the result before reading it."""
        return DoneWork() if self.dry else dist.irecv(buffer, source, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, group, async_op: bool = False):
        if self.dry:
            return DoneWork() if async_op else None
        return dist.all_reduce(tensor, group=group, async_op=async_op)


TIED_TAG = 1  # the tied-gradient exchange, apart from activations and gradients (tag 0)


class TiedExchange:
    """The receiving half of one batch's tied-gradient exchange (`Comms.tied_peer`), posted
    before this stage's last backward of the batch so the partner's gradient arrives while
    that backward runs."""

    def __init__(self, comms: Comms, like: list[torch.Tensor]):
        self.buffers = [torch.empty_like(t) for t in like]
        self.works = [comms.post_recv(b, comms.tied_peer, tag=TIED_TAG) for b in self.buffers]


class GradReduction:
    """One batch's gradients being summed in the background.

    Everything travels in one flat buffer laid out [untied grads, tied grads]: the replica
    group sums the first part, the tied group (all copies of the tied weights) the second, so
    each tensor is reduced exactly once, with one collective per group. A parameter that got
    no gradient (None, the same on every replica: it is the model's structure) takes no room
and comes back as None.

    With one pipeline there is nothing to sum over replicas, so no flat copy is made: the
    untied gradients stay as they are, and on gloo (`Comms.tied_peer`) the two tied copies
    swap gradients point to point (`TiedExchange`), each adding the other's.
    """

    def __init__(self, comms: Comms, grads: list[torch.Tensor | None], num_tied: int, tied: TiedExchange | None = None):
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # the caller keeps these alive until delivered
        self.timeout = comms.timeout
        # Nothing to sum over replicas, and the tied copies (if any) swap point to point.
        self.p2p = comms.replica_group is None and (comms.tied_peer is not None or comms.tied_group is None or not num_tied)
        if self.p2p:
            self._exchange(comms, grads, num_tied, tied)
            return
        self.shapes = [None if g is None else g.shape for g in grads]
        like = next(g for g in grads if g is not None)
        self.flat = torch.cat([like.new_zeros(0) if g is None else g.reshape(-1) for g in grads])
        tied_elems = sum(g.numel() for g in grads[len(grads) - num_tied:] if g is not None) if num_tied else 0
        split = self.flat.numel() - tied_elems
        self.works = []
        if comms.replica_group is not None:
            self.works.append(comms.all_reduce(self.flat[:split], comms.replica_group, async_op=True))
        if comms.tied_group is not None and tied_elems:
            self.works.append(comms.all_reduce(self.flat[split:], comms.tied_group, async_op=True))

    def _exchange(self, comms: Comms, grads: list[torch.Tensor | None], num_tied: int, tied: TiedExchange | None) -> None:
        """One pipeline: nothing to sum over replicas, so no flat copy; the tied gradients go to
        the partner as they are and the partner's come back into `tied`'s buffers."""
        split = len(grads) - num_tied
        self.grads, self.exchange = grads, None
        if num_tied and comms.tied_peer is not None:
            self.exchange = tied if tied is not None else TiedExchange(comms, grads[split:])
            for g in grads[split:]:
                g = g.contiguous()
                self.sends.append((comms.send(g, comms.tied_peer, tag=TIED_TAG), g))

    def tensors(self) -> list[torch.Tensor]:
        """The gradient memory this reduction holds until it is applied."""
        if self.p2p:
            return [g for g in self.grads if g is not None] + (self.exchange.buffers if self.exchange else [])
        return [self.flat]

    def ready(self) -> bool:
        """Whether `finish` would return without waiting."""
        if self.p2p:
            return self.exchange is None or all(w.is_completed() for w in self.exchange.works)
        return all(w.is_completed() for w in self.works)

    def finish(self) -> list[torch.Tensor | None]:
        """Wait for the sums; return the gradients shaped like the parameters (None: none)."""
        if self.p2p:
            grads = list(self.grads)
            if self.exchange is not None:
                split = len(grads) - len(self.exchange.buffers)
                for i, (work, theirs) in enumerate(zip(self.exchange.works, self.exchange.buffers, strict=True)):
                    work.wait(self.timeout)
                    grads[split + i] = theirs.add_(grads[split + i])
            return grads
        for work in self.works:
            work.wait(self.timeout)
        sizes = [0 if shape is None else shape.numel() for shape in self.shapes]
        pieces = self.flat.split(sizes)
        return [None if shape is None else piece.view(shape) for piece, shape in zip(pieces, self.shapes, strict=True)]
