"""Who talks to whom: ranks laid out as replicas x stages, point-to-point transfers, gradient sums.

Where a rank sits is the run's layout's (`placement.layout`, its `replicate` and `stage` dims):
rank r = replica * stages + stage, so each pipeline (replica) is a run of consecutive ranks.
Activations flow to the next rank, gradients to the previous one (round the ring under an
interleaved schedule, where the last stage's chunk feeds the first stage's next chunk); each
boundary between virtual stages is a message stream of its own (`route`). Gradients of a stage are
summed over its replicas (the paper's equi-replicated stages); a weight held by both the
first and the last stage (GPT-2's tied embedding and LM head) is summed over all their
copies, so every copy takes the same update and the tie holds.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from relaytrain.placement.layout import Layout
from relaytrain.placement.world import DoneWork
from relaytrain.strategies.pipeline.schedule import Action, Op, message

POLL_S = (5e-5, 1e-3)  # NCCL: how often a watcher asks whether a transfer has completed (backing off)
CLOSE_S = 5.0  # how long closing waits for a watcher thread (they are idle unless a transfer hangs)


class Comms:
    """This rank's links: neighbours for transfers, process groups for gradient sums."""

    def __init__(self, layout: Layout, rank: int, has_tied_weights: bool, timeout_s: float, dry: bool = False,
                 lanes: bool = False):
        self.layout, self.rank = layout, rank
        self.dry = dry  # a dry run on the meta device: the same buffers, nothing sent
        place = layout.coordinates(rank)
        self.stage, self.replica = place.stage, place.replicate
        # Neighbours round the ring of this replica's stages (the ends meet only when interleaved).
        self.prev = layout.rank_of(stage=(self.stage - 1) % layout.stage, replicate=self.replica)
        self.next = layout.rank_of(stage=(self.stage + 1) % layout.stage, replicate=self.replica)
        self.timeout = timedelta(seconds=timeout_s)
        self.replica_group = self._replica_group()
        self.tied_group = self._tied_group() if has_tied_weights else None
        self.loss_group = self._loss_group()
        # gloo's point-to-point operations are independent of each other (each irecv is its own
        # posted buffer, matched by source and tag in posting order), so receives may be posted
        # ahead of time and the tied copies' sum exchanged point to point. NCCL queues all of a
        # pair's operations on one stream: there a receive posted early would block the sends
        # behind it. With `lanes` (message-driven execution) activations and gradients travel on
        # a process group each, so every pair has one NCCL communicator and stream per
        # direction, and a receive posted early holds up only the later receives of its own
        # direction, which come after it anyway.
        gloo = dry or dist.get_backend() == "gloo"
        self.act_group = self.grad_group = None  # None: the default group
        if lanes and not gloo:
            everyone = list(range(layout.size))
            self.act_group, self.grad_group = self._new_group(everyone), self._new_group(everyone)
        self.async_p2p = gloo or self.act_group is not None  # receives may be posted ahead
        self.poll = not gloo  # NCCL: a transfer's completion is a CUDA event, seen by polling
        # One pipeline (replicas == 1): the tied weights have exactly two copies, on the first and
        # the last stage; each sends its gradient to the other, which adds it (a + b == b + a
        # exactly, so both copies get bit-identical sums, as the all-reduce gives them).
        self.tied_peer = None
        if gloo and has_tied_weights and self.tied_group is not None and layout.replicate == 1:
            self.tied_peer = layout.rank_of(stage=layout.stage - 1 if self.stage == 0 else 0)

    def _replica_group(self):
        """This stage's copies in every replica, summing its gradients."""
        if self.layout.replicate == 1:
            return None
        mine = None
        for ranks in self.layout.groups("replicate"):  # every rank makes every group, in one order (torch's rule)
            group = self._new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _tied_group(self):
        last = self.layout.stage - 1
        if last == 0:
            return None
        ranks = sorted(self.layout.rank_of(stage=s, replicate=r) for s in (0, last) for r in range(self.layout.replicate))
        group = self._new_group(ranks)
        return group if self.stage in (0, last) else None

    def _loss_group(self):
        """The last stages of every replica, summing each batch's loss (gloo: a CPU scalar)."""
        if self.layout.replicate == 1:
            return None
        last = self.layout.stage - 1
        group = self._new_group(self.layout.group(self.layout.rank_of(stage=last), "replicate"), backend="gloo")
        return group if self.stage == last else None

    def _new_group(self, ranks: list[int], backend: str | None = None):
        if self.dry:
            return tuple(ranks)  # stands for the group: nothing goes through it
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    def send(self, tensor: torch.Tensor, to: int, tag: int = 0, group=None) -> dist.Work:
        return DoneWork() if self.dry else dist.isend(tensor, to, tag=tag, group=group)

    def recv(self, buffer: torch.Tensor, source: int) -> torch.Tensor:
        self.post_recv(buffer, source).wait(self.timeout)
        return buffer

    def post_recv(self, buffer: torch.Tensor, source: int, tag: int = 0, group=None) -> dist.Work:
        """Start receiving into `buffer`; `wait(timeout)` on the result before reading it."""
        return DoneWork() if self.dry else dist.irecv(buffer, source, tag=tag, group=group)

    def route(self, action: Action) -> tuple[int, object, int]:
        """The peer rank, process group and tag of a transfer action (receive or send): one tag
        per boundary and direction, so each stream keeps its own order."""
        peer, gradient, boundary = message(action, self.stage, self.layout.stage)
        group = self.grad_group if gradient else self.act_group
        return self.layout.rank_of(stage=peer, replicate=self.replica), group, MESSAGE_TAG + 2 * boundary + gradient

    def all_reduce(self, tensor: torch.Tensor, group, async_op: bool = False):
        if self.dry:
            return DoneWork() if async_op else None
        return dist.all_reduce(tensor, group=group, async_op=async_op)


TIED_TAG = 1  # the tied-gradient exchange, apart from evaluation's messages (tag 0)
MESSAGE_TAG = 2  # activations and gradients: MESSAGE_TAG + 2 x boundary (+ 1 for a gradient)


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


# ----------------------------------------------------------------------- transfers in flight


class Watcher:
    """Sees point-to-point transfers complete without the stage blocking on them.

    gloo marks a send or a receive complete only inside `wait()` (`is_completed()` stays False
    until then, and a second `wait()` on a receive blocks), so one thread per channel waits on
    its transfers in posting order, the order they complete in, and flags each one done; `wait`
    releases the GIL, so a waiting thread costs nothing. NCCL's transfers are CUDA events that
    `is_completed()` can query: there the thread polls. A dry run's transfers are done at once.

    A transfer may also be handed over unstarted (`watch(..., start=...)`): the channel's thread
    starts it, in the channel's order, then waits for it. The mailbox posts its gloo receives so,
    under either execution: on the stage's own thread `dist.irecv` blocked for 2-7 ms at a time
    while the same pair's other transfers were in flight (11-13 ms a step on a GPT-2 stage under
    message-driven execution; 7 ms of a 198 ms step on the second stage of static interleaved
    1F1B, which receives three times as often; measured on 2 cores), time the stage now spends
    computing.
    """

    def __init__(self, timeout: timedelta, poll: bool):
        self.timeout, self.poll = timeout, poll
        self.done: set = set()
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        self.channels: dict[Hashable, queue.Queue] = {}
        self.threads: list[threading.Thread] = []

    def watch(self, channel: Hashable, key: Hashable, work=None, start: Callable[[], object] | None = None) -> None:
        """Follow `work` (flagged as `key` once complete) after the earlier ones of `channel`; or,
        with `start`, start the transfer on the channel's thread (after the earlier ones of
        `channel` completed), then follow it."""
        if isinstance(work, DoneWork):
            self._flag(key)
            return
        if channel not in self.channels:
            self.channels[channel] = queue.Queue()
            thread = threading.Thread(target=self._follow, args=(self.channels[channel],), daemon=True,
                                      name=f"relaytrain-watch-{channel}")
            thread.start()
            self.threads.append(thread)
        self.channels[channel].put((key, work, start))

    def is_done(self, key: Hashable) -> bool:
        with self.changed:
            return key in self.done

    def wait_any(self, keys: Iterable[Hashable]) -> Hashable:
        """Block until one of `keys` is done (within the timeout); return it."""
        keys = list(keys)
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self.changed:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"a transfer failed: {self.error}") from self.error
                hit = next((k for k in keys if k in self.done), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no transfer of {keys} completed within {self.timeout.total_seconds():.0f} s")
                self.changed.wait(left)

    def forget(self, key: Hashable) -> None:
        with self.changed:
            self.done.discard(key)

    def close(self) -> None:
        """Stop the threads. Each drops its transfers as soon as they complete, so none outlives the
        process group (a gloo work destroyed after its group aborts the process)."""
        for channel in self.channels.values():
            channel.put(None)
        for thread in self.threads:
            thread.join(timeout=CLOSE_S)

    def _follow(self, channel: queue.Queue) -> None:
        while (item := channel.get()) is not None:
            key, work, start = item
            del item
            try:
                if start is not None:
                    work, start = start(), None
                self._poll(work) if self.poll else work.wait(self.timeout)
            except BaseException as err:  # noqa: BLE001 - handed to the stage by wait_any
                with self.changed:
                    self.error = err
                    self.changed.notify_all()
                return
            finally:
                del work
            self._flag(key)

    def _poll(self, work) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = POLL_S[0]
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a transfer did not complete within {self.timeout.total_seconds():.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])

    def _flag(self, key: Hashable) -> None:
        with self.changed:
            self.done.add(key)
            self.changed.notify_all()


class Mailbox:
    """This stage's incoming activations and gradients, keyed by their receive action (its op,
    chunk and micro-batch).

    Each receive lands in a buffer of its own (shaped as `shape_of` its op says: the hidden
    state, or a flat buffer that also carries a mixture's routing, `routing.Framing`), posted
    ahead of the action that reads it where the backend allows (`Comms.async_p2p`) and taken by
    that action. With `watch` (message-driven execution), and on gloo under any execution,
    the receives are followed by the watcher, and the stage can also see which have arrived
    without waiting for them.
    """

    def __init__(self, comms: Comms, shape_of: Callable[[Op], tuple[int, ...]], device: torch.device,
                 watcher: Watcher, watch: bool):
        self.comms, self.shape_of, self.device = comms, shape_of, device
        # gloo: the watcher's threads post the receives under either execution (see Watcher).
        self.watcher = watcher if watch or not watcher.poll else None
        self.posted: dict[Action, tuple[dist.Work | None, torch.Tensor]] = {}

    def post(self, receive: Action) -> None:
        buffer = torch.empty(self.shape_of(receive.op), dtype=torch.float32, device=self.device)
        source, group, tag = self.comms.route(receive)
        channel = ("recv", receive.op.value)
        if self.watcher is not None and not self.watcher.poll and not self.comms.dry:
            # gloo: the channel's thread posts it, in posting order (see Watcher); `take` never
            # waits on the work itself there.
            self.posted[receive] = (None, buffer)
            self.watcher.watch(channel, receive, start=lambda: self.comms.post_recv(buffer, source, tag, group))
            return
        work = self.comms.post_recv(buffer, source, tag, group)
        self.posted[receive] = (work, buffer)
        if self.watcher is not None:
            self.watcher.watch(channel, receive, work)

    def is_posted(self, receive: Action) -> bool:
        return receive in self.posted

    def arrived(self, receive: Action) -> bool:
        return self.watcher is not None and self.watcher.is_done(receive)

    def wait_any(self, receives: Iterable[Action]) -> None:
        """Block until one of these posted receives has arrived (with `watch` only)."""
        self.watcher.wait_any(receives)

    def take(self, receive: Action) -> torch.Tensor:
        """The received tensor, once it has arrived (posting the receive now if it was not)."""
        if receive not in self.posted:
            self.post(receive)
        work, buffer = self.posted.pop(receive)
        if self.watcher is None:
            work.wait(self.comms.timeout)
            return buffer
        self.watcher.wait_any([receive])
        self.watcher.forget(receive)
        if self.watcher.poll:
            work.wait(self.comms.timeout)  # NCCL: orders the compute stream after the (completed) receive
        return buffer


class Outbox:
    """Sends in flight, each tensor kept alive until delivered and then dropped.

    gloo completes a send only once the peer has posted its receive, and says so only inside
    `wait()`: the watcher follows them, so a long run holds only what is really in flight.
    """

    def __init__(self, comms: Comms, watcher: Watcher):
        self.comms, self.watcher = comms, watcher
        self.in_flight: dict[int, torch.Tensor] = {}
        self.ids = itertools.count()

    def send(self, tensor: torch.Tensor, to: int, tag: int = 0, group=None) -> None:
        tensor = tensor.contiguous()
        self.keep(self.comms.send(tensor, to, tag=tag, group=group), tensor, to, tag)

    def keep(self, work: dist.Work, tensor: torch.Tensor, to: int, tag: int = 0) -> None:
        """Follow a send made elsewhere (GradReduction's tied exchange)."""
        self._drop_delivered()
        key = next(self.ids)
        self.in_flight[key] = tensor
        self.watcher.watch(("send", to, tag), key, work)

    def flush(self) -> None:
        """Wait until every send has been delivered."""
        for key in list(self.in_flight):
            self.watcher.wait_any([key])
        self._drop_delivered()

    def _drop_delivered(self) -> None:
        for key in [k for k in self.in_flight if self.watcher.is_done(k)]:
            del self.in_flight[key]
            self.watcher.forget(key)
