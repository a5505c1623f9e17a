"""The eager param server (EPS): the host owns the model; each part is updated as soon as
its gradients for the whole minibatch exist (the package docstring has the whole picture).

Exactness. Two things need every gradient before any update: global-norm clipping
(`optim.grad_clip > 0`) and the fp16 overflow check (a step with an inf/NaN anywhere is
skipped everywhere). In those cases the EPS *defers*: the worker still folds each part's
gradients into the masters eagerly, but the optimizer steps run once, at the end of
backward, after clipping with the baseline's own `clip_grad_norm_` over all master grads
(or after finding an overflow, in which case no weight changes). Exact, at the cost of
the overlap of optimizer and backward.

Carrying updates into the next step (`carry`, L2L's `strategy.overlap_next_step`). Backward
ships the parts last to first, and the next forward needs them first to last: a step that
waited for its last updates would leave the host's update of the lowest parts exposed. With
`carry` the step ends without waiting, the worker steps the queued parts lowest first, and
the next forward waits only for the part it is about to upload (`await_part`). Each task
carries the learning rate of its step. It needs eager updates on one worker whose parts share
no master (a tied head's gradient sums into the embeddings' before their step): elsewhere the
step waits as before. Exact: no part is read before its update lands.

Pipeline stages (`strategy.offload=host`, strategies/pipeline/offload.py) use the same server
for their host-resident masters: a shipment may carry its own learning rate (2BW queues one
batch's update while the next batch's is being computed) and a continuation the worker runs
right after the part's update (the stage uploads the new weights into its device buffer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from relaytrain.step.flat import KeptTensors
from relaytrain.step.muon import orthogonalize_beside
from relaytrain.step.optim import build_optimizer, set_lr
from relaytrain.step.precision import LossScaler
from relaytrain.strategies.eps.parts import (
    Part,
    accumulate,
    build_parts,
    flat_masters,
    refresh_wires,
)
from relaytrain.strategies.eps.peers import Peers
from relaytrain.strategies.eps.table import ELEMENTWISE, HeldRows
from relaytrain.strategies.eps.worker import EpsStats, Worker

if TYPE_CHECKING:
    from relaytrain.step.rounding import Bf16Masters


@dataclass
class Shipment:
    """One part's minibatch gradients on their way to the EPS."""

    grads: list[torch.Tensor | None]  # aligned with the part's masters; host tensors once `ready`
    ready: torch.cuda.Event | None = None  # the device-to-host copy completes at this event
    reduction: dist.Work | None = None  # the sum over replicas completes with this work (then `flat` holds it)
    flat: torch.Tensor | None = None  # the gradients flattened for the sum; `grads` are views of it
    lr: float | None = None  # the learning rate of this update (None: the one `set_lr` last set)
    then: Callable[[], None] | None = None  # run on the worker right after the part's update


class EagerParamServer:
    """fp32 masters + optimizer state per part on the host, updated on a background worker.

    `modules`: the parts in relay order (embeddings, blocks..., head); their trainable
    parameters are the masters, the frozen ones (an adapter's base) only travel, kept in
    `frozen_dtype` where given. `wire_dtype`: the dtype parts compute in on the device. `pin`:
    keep host tensors that cross to a CUDA device in pinned memory (asynchronous DMA), and
    give the background worker the caller's kernel threads (the host's cores are not computing
    the device's work; on a CPU device the worker takes one, beside the caller's compute).
    `bf16`: keep the masters in bf16 and step them through its fp32 stand-ins (`step.rounding`).
    `device`: the one the parts compute on (Muon may run its Newton-Schulz steps there).
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], optim_cfg, scaler: LossScaler,
                 wire_dtype: torch.dtype = torch.float32, pin: bool = False, peers: Peers | None = None,
                 frozen_dtype: torch.dtype | None = None, carry: bool = False, bf16: Bf16Masters | None = None,
                 device: torch.device | None = None):
        self.scaler, self.grad_clip, self.peers, self.bf16 = scaler, optim_cfg.grad_clip, peers, bf16
        self.defer = self.grad_clip > 0 or scaler.enabled
        self.parts = build_parts(modules, wire_dtype, pin, frozen_dtype, self.bf16)
        self.owners = peers.assign(self.parts) if peers else [0] * len(self.parts)
        self.rank = peers.rank if peers else 0
        for part, owner in zip(self.parts, self.owners, strict=True):
            if owner == self.rank and part.owned:
                named = zip(self.stepped_names(part), part.stepped, strict=True)
                part.optimizer = build_optimizer(named, optim_cfg, flat=True)
        if device is not None:
            orthogonalize_beside([part.optimizer for part in self.parts], device, optim_cfg)
        # The baseline's parameter order (model.parameters()), so clipping sums the same way.
        self.my_masters = [p for part in self.local_parts() for p in part.stepped]
        kernels = sorted({part.optimizer.kernel for part in self.parts if part.optimizer is not None})
        self.stats = EpsStats(host_kernel=", ".join(kernels) or None)
        self._overflow = False
        self._held: dict[int, HeldRows] = {}  # part -> the rows its early table update left out
        self._grads = KeptTensors()  # the fp32 .grads of half-precision gradients, reused every step
        self._table_done = threading.Event()
        self._table_done.set()
        self._worker = Worker(threads=torch.get_num_threads() if pin else 1)
        self.carry = carry and not self.defer and peers is None and not _shared_masters(self.parts)
        self._lr: float | None = None  # the step's learning rate, given to each of its tasks
        self._pending = [0] * len(self.parts)  # per part: its queued or running tasks
        self._pending_changed = threading.Condition()
        # Who runs the updates a forward waits for: on a CPU the caller, whose OpenMP team is warm
        # (`Worker`); beside a GPU the worker, whose team has the host's cores, so that one team
        # alone steps every part (two teams of that size make libgomp stop spinning between regions).
        self._caller_takes_over = not pin

    # -- caller side --------------------------------------------------------------------
    @staticmethod
    def stepped_names(part: Part) -> list[str]:
        """The names the optimizer knows part's parameters by, as within the model (`block.3.…`):
        Muon's split reads them."""
        return [f"{part.name}.{name}" for name in part.owned_names]

    def master(self, p: nn.Parameter) -> nn.Parameter:
        """The master a parameter the optimizer steps stands for (itself with fp32 masters)."""
        return p if self.bf16 is None else self.bf16.master_of.get(id(p), p)

    def local_parts(self) -> list[Part]:
        """The parts whose update this worker runs (all of them without sharding)."""
        return [part for part, owner in zip(self.parts, self.owners, strict=True) if owner == self.rank]

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.rank

    def set_lr(self, lr: float) -> None:
        """The learning rate of the updates submitted from now on (a part's earlier update, still
        queued, keeps its own step's)."""
        self._lr = lr

    def submit(self, index: int, grads: list[torch.Tensor | None] | Shipment,
               ready: torch.cuda.Event | None = None) -> None:
        """Queue part `index`'s minibatch gradients (aligned with its masters, host tensors).

        `ready`: an event the copies into `grads` complete at; the worker waits on it. The
        EPS takes ownership of `grads` (fp32 ones become the master `.grad` without a copy).
        With replicas, a `Shipment` also carries the sum over them still under way.
        """
        shipment = grads if isinstance(grads, Shipment) else Shipment(grads, ready)
        if shipment.lr is None:
            shipment.lr = self._lr
        self._put(index, lambda: self._apply(index, shipment))

    def landed(self, index: int) -> bool:
        """Whether part `index` has no update queued or running."""
        return not self._pending[index]

    def await_part(self, index: int) -> None:
        """Carrying updates into the next step: return once part `index`'s updates have landed
        (on a CPU this thread runs the queued ones, lowest part first, until they have). The
        time spent here is the EPS's exposed time."""
        if self.landed(index):
            return
        start = time.perf_counter()
        if self._caller_takes_over:
            self._worker.join(until=lambda: self.landed(index))
        else:
            with self._pending_changed:  # after a failure the worker skips the rest: raise, not hang
                while not self._pending_changed.wait_for(lambda: self.landed(index), timeout=0.05):
                    self._worker.raise_if_failed()
            self._worker.raise_if_failed()
        self.stats.exposed_s += time.perf_counter() - start

    def drain(self) -> None:
        """Every queued update lands (before a checkpoint, an evaluation, the end); the wait
        counts as exposed."""
        start = time.perf_counter()
        self._worker.join()
        self.stats.exposed_s += time.perf_counter() - start

    def can_update_table_early(self, index: int, table: nn.Parameter) -> bool:
        """Whether `update_table_early` applies: an update per element (AdamW, SGD), not deferred,
        one worker, fp32 masters, and part `index` owns `table`."""
        part = self.parts[index]
        return (not self.defer and self.peers is None and self.bf16 is None and isinstance(part.optimizer, ELEMENTWISE)
                and any(p is table for p in part.owned))

    def update_table_early(self, index: int, table: nn.Parameter, rows: torch.Tensor) -> None:
        """Update embedding table `table` of part `index` now, except its `rows`.

        An input embedding's gradient from its own backward is zero outside the rows the
        minibatch looked up; the rest of its gradient (a tied head's) is known once the head
        is done. So every other row's update is final before the backward reaches the
        embeddings. The worker steps the whole table now, keeping `rows` as they were, and the
        part's regular update redoes just those rows with their whole gradient: exact, and
        only a few rows of the largest part are left for after the backward. Call it after
        the head's gradients are submitted (a tied head's share is in the table's gradient),
        and `await_table_early` before anything reads the table again.
        """
        self._table_done.clear()
        lr = self._lr
        self._put(index, lambda: self._table_early(index, table, rows, lr))

    def await_table_early(self) -> None:
        """Block until the early table update has written its rows (the held ones are back as
        they were, so the embeddings' recompute sees the forward's weights)."""
        while not self._table_done.wait(0.05):  # after a failure the worker skips it: raise, not hang
            self._worker.raise_if_failed()
        self._worker.raise_if_failed()

    def wait(self) -> bool:
        """Finish the step's updates (carrying them, leave them to the next step's
        `await_part`); True when an fp16 overflow skipped the step."""
        self.stats.steps += 1
        if self.carry:
            self._worker.raise_if_failed()
            return False
        if self.defer:  # each part's rate came with its shipment (`_apply`)
            self._worker.put(self._deferred_update)
        self.drain()
        overflow, self._overflow = self._overflow, False
        return overflow

    def settle(self) -> None:
        """Finish every queued update, without counting a step (a pipeline stage before its
        checkpoint or evaluation); re-raises the worker's error."""
        self._worker.join()

    def raise_if_failed(self) -> None:
        """Re-raise the worker's error, if it had one, without waiting for its queue."""
        self._worker.raise_if_failed()

    def refresh_wires(self) -> None:
        """The masters changed outside an update (a checkpoint was loaded): make the copies follow."""
        for part in self.parts:
            refresh_wires(part)

    def close(self) -> None:
        self._worker.close()

    # -- worker side --------------------------------------------------------------------
    def _put(self, index: int, task: Callable[[], None]) -> None:
        """Queue a task of part `index`; carrying updates, the lowest part runs first."""
        with self._pending_changed:
            self._pending[index] += 1

        def run() -> None:
            try:
                task()
            finally:
                with self._pending_changed:
                    self._pending[index] -= 1
                    self._pending_changed.notify_all()

        self._worker.put(run, priority=index if self.carry else 0)

    def _apply(self, index: int, shipment: Shipment) -> None:
        part = self.parts[index]
        if self.peers is not None:
            self.peers.wait(shipment.reduction)
        if not self.owns(index):  # sharded: the owner steps this part; its update comes by broadcast
            if not self.defer:
                self._receive(index)
            return
        if shipment.ready is not None:
            shipment.ready.synchronize()  # the gradients' download has landed in host memory
        start = time.perf_counter()
        accumulate(part.summed, shipment.grads, self._grads)
        if shipment.lr is not None and part.optimizer is not None:
            set_lr(part.optimizer, shipment.lr)
        if not self.defer:
            self._step(index)
        if shipment.then is not None:
            shipment.then()
        self.stats.busy_s += time.perf_counter() - start

    def _deferred_update(self) -> None:
        start = time.perf_counter()
        self._deferred_step()
        self.stats.busy_s += time.perf_counter() - start

    def _deferred_step(self) -> None:
        grads = [p.grad for p in self.my_masters if p.grad is not None]
        self._overflow = self._any_replica(self.scaler.unscale_and_check(grads))
        if self._overflow:
            self._grads.give_back([p.grad for p in self.my_masters])
            for p in self.my_masters:
                p.grad = None
        else:
            if self.grad_clip > 0:
                self._clip(grads)
            for index in range(len(self.parts)):
                self._step(index) if self.owns(index) else self._receive(index)
        self.scaler.update(self._overflow)

    def _clip(self, grads: list[torch.Tensor]) -> None:
        """The baseline's global-norm clipping over every master gradient (of every owner)."""
        if self.peers is None or not self.peers.sharded:
            torch.nn.utils.clip_grad_norm_(self.my_masters, self.grad_clip, foreach=True)
            return
        squares = torch.stack(torch._foreach_norm(grads)).pow(2).sum() if grads else torch.zeros(())
        total = float(self.peers.total(squares.reshape(1).double()).sqrt())
        coefficient = min(self.grad_clip / (total + 1e-6), 1.0)
        if grads and coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)

    def _any_replica(self, found: bool) -> bool:
        """An fp16 overflow on any owner skips the step everywhere (sharded: each sees its own parts)."""
        if self.peers is None or not self.peers.sharded or not self.scaler.enabled:
            return found
        return bool(self.peers.total(torch.tensor([float(found)]), dist.ReduceOp.MAX))

    def _table_early(self, index: int, table: nn.Parameter, rows: torch.Tensor, lr: float | None) -> None:
        try:
            if lr is not None:
                set_lr(self.parts[index].optimizer, lr)
            self._step_table_early(index, table, rows)
        finally:
            self._table_done.set()

    def _step_table_early(self, index: int, table: nn.Parameter, rows: torch.Tensor) -> None:
        part = self.parts[index]
        start = time.perf_counter()
        held = HeldRows.take(part.optimizer, table, rows)
        if table.grad is None:  # an untied table: zero gradient outside `rows`
            table.grad = self._grads.take(table).zero_()
        table.grad.index_fill_(0, rows, 0.0)  # what the early step sees of `rows` is discarded anyway
        others = [(p, p.grad) for p in part.owned if p is not table]
        for p, _ in others:  # only the table steps now
            p.grad = None
        part.optimizer.update()
        self.stats.optimizer_s += time.perf_counter() - start
        self.stats.updated_parameters += held.table_rest
        self._grads.give_back([table.grad])
        table.grad = None
        for p, grad in others:
            p.grad = grad
        with torch.no_grad():  # the held rows as the forward read them, for the embeddings' recompute
            table.index_copy_(0, rows, held.values)
        refresh_wires(part)
        self._held[index] = held
        self.stats.busy_s += time.perf_counter() - start

    def _step(self, index: int) -> None:
        part = self.parts[index]
        if part.optimizer is not None:
            start = time.perf_counter()
            grads = [p.grad for p in part.stepped]  # before the held rows' update drops the table's
            held = self._held.pop(index, None)
            if held is not None:
                held.update(part.optimizer)
            if self.bf16 is None:
                part.optimizer.update()
            else:
                with self.bf16.updating(part.optimizer, part.stepped):
                    part.optimizer.update()
            self.stats.optimizer_s += time.perf_counter() - start
            self.stats.updated_parameters += part.num_owned - (held.table_rest if held else 0)
            part.optimizer.drop_grads()
            self._grads.give_back(grads)
            refresh_wires(part)
        if self.peers is not None and self.peers.sharded:
            self.peers.broadcast(flat_masters(part), self.rank)

    def _receive(self, index: int) -> None:
        """Sharded, not the owner: the owner's updated weights of part `index`, into the same layout."""
        part = self.parts[index]
        self.peers.broadcast(flat_masters(part), self.owners[index])
        refresh_wires(part)


def _shared_masters(parts: list[Part]) -> bool:
    """Whether a master is used by more than one part (a tied head)."""
    used = [id(p) for part in parts for p in part.masters]
    return len(used) != len(set(used))
