"""Eager param server (EPS): the host owns the model; each part is updated as soon as its
gradients for the whole minibatch exist.

The model is split into *parts* in relay order: the embeddings, every block, the head. The
EPS keeps, per part, the fp32 master weights (the model's own parameters, so the Hugging
Face model always holds the trained weights), one optimizer built by `build_optimizer`
(the same update rule as the baseline's; AdamW, LAMB and SGD are all per-tensor, so
stepping part by part gives exactly the whole-model step) and a *wire* copy: what travels
to the device (the master itself for fp32, a half copy for cross mixed precision).

Flat buffers (`relaytrain.flat`). A part's own masters live in one contiguous buffer,
`Part.buffer`, in param-group order; each parameter's `.data` is a view into it, so the
model, checkpoints and `save_pretrained` see the same parameters as before. The part's
optimizer is the flat variant of the configured one (`build_optimizer(flat=True)`): its
state (Adam's moments, SGD's momentum) is one buffer per kind with a view per parameter,
keyed by parameter as torch's is (the checkpoint format does not change), and fused AdamW
updates the part with one kernel call per param group (decayed or not), without the Python
torch.optim wraps around each call. The numbers are bit for bit those of torch's per-tensor
optimizers. Gradients stay the tensors that arrive: gathering them into a buffer would add
a pass over every gradient, which costs more than it saves (docs/l2l.md, "Flat buffers").

`submit(part, grads)` hands one part's gradients to a background worker thread that adds
them into the master `.grad` and steps that part's optimizer, while the caller goes on with
the backward of the parts below (torch ops release the GIL). `wait()` finishes the step's
updates: what is still queued then runs on the caller's own thread (`_Worker` says why).

Exactness. Two things need every gradient before any update: global-norm clipping
(`optim.grad_clip > 0`) and the fp16 overflow check (a step with an inf/NaN anywhere is
skipped everywhere). In those cases the EPS *defers*: the worker still folds each part's
gradients into the masters eagerly, but the optimizer steps run once, at the end of
backward, after clipping with the baseline's own `clip_grad_norm_` over all master grads
(or after finding an overflow, in which case no weight changes). Exact, at the cost of
the overlap of optimizer and backward.

Tied weights (GPT-2's `wte` and LM head) are one Parameter: the first part that uses it
(the embeddings) owns it, the head only uses it. Both parts' gradients are added into the
one master `.grad` (the head's arrives first), and only the owner's optimizer updates it.

Pipeline stages (`strategy.offload=host`, strategies/pipeline/offload.py) use the same server
for their host-resident masters: a shipment may carry its own learning rate (2BW queues one
batch's update while the next batch's is being computed) and a continuation the worker runs
right after the part's update (the stage uploads the new weights into its device buffer).

Replicas (`Peers`, L2L's `strategy.replicas`). Several workers relay the same parts over
their own rows of every minibatch; a part's gradients are summed over them as soon as its
backward has finished (the collective runs while the parts below compute), then the part is
updated once. Two placements of the EPS state:
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

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from relaytrain import memory
from relaytrain.flat import flatten
from relaytrain.optim import build_optimizer, param_groups, set_lr
from relaytrain.precision import LossScaler
from relaytrain.world import DoneWork


@dataclass
class Part:
    """One relayed unit: its compute module and the master tensors it uses and owns."""

    name: str
    module: nn.Module
    names: list[str]  # parameter names inside `module`, for functional calls on the device
    masters: list[nn.Parameter]  # fp32 host parameters the module uses (tied ones included)
    owned: list[nn.Parameter]  # the subset this part's optimizer updates
    owned_names: list[str]
    wires: list[torch.Tensor]  # host copies in the device's dtype (the masters themselves in fp32)
    buffer: torch.Tensor | None  # the owned masters, contiguous (their `.data` are views); None if none
    optimizer: torch.optim.Optimizer | None = None  # None on a replica that does not own the part

    @property
    def num_owned(self) -> int:
        return sum(p.numel() for p in self.owned)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.masters)


@dataclass
class EpsStats:
    updated_parameters: int = 0  # parameters stepped, summed over steps
    optimizer_s: float = 0.0  # worker time inside optimizer steps
    busy_s: float = 0.0  # all worker time: folding gradients in, clipping, optimizer steps, wire refresh
    exposed_s: float = 0.0  # caller time blocked in `wait()`: EPS work not hidden behind backward
    steps: int = 0

    def as_dict(self) -> dict:
        return {
            "updated_parameters": self.updated_parameters,
            "optimizer_s": self.optimizer_s,
            "parameters_per_s": self.updated_parameters / self.optimizer_s if self.optimizer_s else None,
            "busy_s": self.busy_s,
            "exposed_s": self.exposed_s,
            "exposed_fraction": min(self.exposed_s / self.busy_s, 1.0) if self.busy_s else None,
            "steps": self.steps,
        }


class _Worker:
    """Queued tasks run one at a time, in order: on a background thread while the caller
    computes, and on the caller's own thread once it waits for them (`join`).

    Why the caller takes over. On a CPU, torch runs each kernel of a fused optimizer as one
    OpenMP parallel region per tensor. The caller's OpenMP team is warm (its threads spin
    between regions); a second thread's team is not, and waking it costs tens of
    microseconds per region, about a fifth of a whole BERT update (docs/benchmarks.md). So
    the background thread computes single-threaded beside the caller's backward, which keeps
    the machine from being oversubscribed, and the updates still queued when the caller
    waits run on the caller's warm team at full speed. The tasks never run concurrently and
    keep their order, so collectives (sharded replicas) and tied-weight sums see the same
    sequence as with one thread. The first error is re-raised by `join`.
    """

    def __init__(self):
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._changed = threading.Condition()
        self._running = False  # the background thread is inside a task
        self._caller_waiting = False  # the caller runs the queue: the background thread keeps off it
        self._closed = False
        self._error: BaseException | None = None
        threads = torch.get_num_threads()
        started = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(started,), name="eps-worker", daemon=True)
        self._thread.start()
        started.wait()
        _set_intra_op_threads(threads)  # torch keeps the last count as the default of new threads

    def put(self, task: Callable[[], None]) -> None:
        with self._changed:
            self._tasks.append(task)
            self._changed.notify_all()

    def join(self) -> None:
        """Run every queued task (the rest of them on this thread), then re-raise the first error."""
        with self._changed:
            self._caller_waiting = True
            self._changed.wait_for(lambda: not self._running)
        try:
            with memory.on_host():  # a dry run's tracker counts this thread's device tensors; these are the host's
                while True:
                    with self._changed:
                        if not self._tasks:
                            break
                        task = self._tasks.popleft()
                    self._run(task)
        finally:
            with self._changed:
                self._caller_waiting = False
                self._changed.notify_all()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self, task: Callable[[], None]) -> None:
        try:
            if self._error is None:  # after a failure the rest of the step is meaningless
                task()
        except BaseException as err:  # noqa: BLE001 - handed to the caller by join()
            self._error = err

    def _loop(self, started: threading.Event) -> None:
        _set_intra_op_threads(1)
        started.set()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or (self._tasks and not self._caller_waiting))
                if self._closed:
                    return
                task = self._tasks.popleft()
                self._running = True
            try:
                self._run(task)
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()


def _set_intra_op_threads(threads: int) -> None:
    """The calling thread's kernels use `threads` threads (with OpenMP the count is per thread)."""
    if torch.backends.openmp.is_available():
        torch.set_num_threads(threads)


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

    `modules`: the parts in relay order (embeddings, blocks..., head); their parameters
    are the masters. `wire_dtype`: the dtype parts compute in on the device. `pin`: keep
    host tensors that cross to a CUDA device in pinned memory (asynchronous DMA).
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], optim_cfg, scaler: LossScaler,
                 wire_dtype: torch.dtype = torch.float32, pin: bool = False, peers: Peers | None = None):
        self.scaler = scaler
        self.grad_clip = optim_cfg.grad_clip
        self.defer = self.grad_clip > 0 or scaler.enabled
        self.peers = peers
        self.parts = _build_parts(modules, wire_dtype, pin)
        self.owners = peers.assign(self.parts) if peers else [0] * len(self.parts)
        self.rank = peers.rank if peers else 0
        for part, owner in zip(self.parts, self.owners, strict=True):
            if owner == self.rank and part.owned:
                part.optimizer = build_optimizer(zip(part.owned_names, part.owned, strict=True), optim_cfg, flat=True)
        # The baseline's parameter order (model.parameters()), so clipping sums the same way.
        self.all_masters = [p for part in self.parts for p in part.owned]
        self.my_masters = [p for part in self.local_parts() for p in part.owned]
        self.stats = EpsStats()
        self._overflow = False
        self._held: dict[int, _HeldRows] = {}  # part -> the rows its early table update left out
        self._table_done = threading.Event()
        self._table_done.set()
        self._worker = _Worker()

    # -- caller side --------------------------------------------------------------------
    def local_parts(self) -> list[Part]:
        """The parts whose update this worker runs (all of them without sharding)."""
        return [part for part, owner in zip(self.parts, self.owners, strict=True) if owner == self.rank]

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.rank

    def set_lr(self, lr: float) -> None:
        for part in self.parts:
            if part.optimizer is not None:
                set_lr(part.optimizer, lr)

    def submit(self, index: int, grads: list[torch.Tensor | None] | Shipment,
               ready: torch.cuda.Event | None = None) -> None:
        """Queue part `index`'s minibatch gradients (aligned with its masters, host tensors).

        `ready`: an event the copies into `grads` complete at; the worker waits on it. The
        EPS takes ownership of `grads` (fp32 ones become the master `.grad` without a copy).
        With replicas, a `Shipment` also carries the sum over them still under way.
        """
        shipment = grads if isinstance(grads, Shipment) else Shipment(grads, ready)
        self._worker.put(lambda: self._apply(index, shipment))

    def can_update_table_early(self, index: int, table: nn.Parameter) -> bool:
        """Whether `update_table_early` applies: an update per element (AdamW, SGD), not deferred,
        one worker, and part `index` owns `table`."""
        part = self.parts[index]
        return (not self.defer and self.peers is None and isinstance(part.optimizer, _ELEMENTWISE)
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
        self._worker.put(lambda: self._table_early(index, table, rows))

    def await_table_early(self) -> None:
        """Block until the early table update has written its rows (the held ones are back as
        they were, so the embeddings' recompute sees the forward's weights)."""
        while not self._table_done.wait(0.05):  # after a failure the worker skips it: raise, not hang
            self._worker.raise_if_failed()
        self._worker.raise_if_failed()

    def wait(self) -> bool:
        """Finish the step's updates; True when an fp16 overflow skipped the step."""
        if self.defer:
            self._worker.put(self._deferred_update)
        start = time.perf_counter()
        self._worker.join()
        self.stats.exposed_s += time.perf_counter() - start
        self.stats.steps += 1
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
            _refresh_wires(part)

    def close(self) -> None:
        self._worker.close()

    # -- worker side --------------------------------------------------------------------
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
        _accumulate(part.masters, shipment.grads)
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

    def _table_early(self, index: int, table: nn.Parameter, rows: torch.Tensor) -> None:
        try:
            self._step_table_early(index, table, rows)
        finally:
            self._table_done.set()

    def _step_table_early(self, index: int, table: nn.Parameter, rows: torch.Tensor) -> None:
        part = self.parts[index]
        start = time.perf_counter()
        held = _HeldRows.take(part.optimizer, table, rows)
        if table.grad is None:  # an untied table: zero gradient outside `rows`
            table.grad = torch.zeros_like(table)
        table.grad.index_fill_(0, rows, 0.0)  # what the early step sees of `rows` is discarded anyway
        others = [(p, p.grad) for p in part.owned if p is not table]
        for p, _ in others:  # only the table steps now
            p.grad = None
        part.optimizer.update()
        self.stats.optimizer_s += time.perf_counter() - start
        self.stats.updated_parameters += held.table_rest
        table.grad = None
        for p, grad in others:
            p.grad = grad
        with torch.no_grad():  # the held rows as the forward read them, for the embeddings' recompute
            table.index_copy_(0, rows, held.values)
        _refresh_wires(part)
        self._held[index] = held
        self.stats.busy_s += time.perf_counter() - start

    def _step(self, index: int) -> None:
        part = self.parts[index]
        if part.optimizer is not None:
            start = time.perf_counter()
            held = self._held.pop(index, None)
            if held is not None:
                held.update(part.optimizer)
            part.optimizer.update()
            self.stats.optimizer_s += time.perf_counter() - start
            self.stats.updated_parameters += part.num_owned - (held.table_rest if held else 0)
            part.optimizer.drop_grads()
            _refresh_wires(part)
        if self.peers is not None and self.peers.sharded:
            self.peers.broadcast(_flat(part), self.rank)

    def _receive(self, index: int) -> None:
        """Sharded, not the owner: the owner's updated weights of part `index`, into the same layout."""
        part = self.parts[index]
        self.peers.broadcast(_flat(part), self.owners[index])
        _refresh_wires(part)


# Optimizers whose update of an element reads only that element (and its state): a subset of
# rows stepped on its own ends bit-identical to the same rows of a whole-tensor step. LAMB's
# per-tensor trust ratio is not.
_ELEMENTWISE = (torch.optim.AdamW, torch.optim.SGD)


@dataclass
class _HeldRows:
    """Rows of an embedding table its early update left out: their values and optimizer state
    from before it, and the gradient they had then (a tied head's share)."""

    table: nn.Parameter
    rows: torch.Tensor
    values: torch.Tensor
    state: dict
    grad: torch.Tensor | None

    @property
    def table_rest(self) -> int:
        """Parameters of the table the early update already counted."""
        return self.table.numel() - len(self.rows) * self.table[0].numel()

    @classmethod
    @torch.no_grad()
    def take(cls, optimizer: torch.optim.Optimizer, table: nn.Parameter, rows: torch.Tensor) -> _HeldRows:
        state = {k: v.index_select(0, rows) if _per_row(v, table) else (v.clone() if torch.is_tensor(v) else v)
                 for k, v in optimizer.state.get(table, {}).items()}
        grad = table.grad.index_select(0, rows) if table.grad is not None else None
        return cls(table, rows, table.detach().index_select(0, rows), state, grad)

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the held rows with their whole gradient (the tied share first, as `_accumulate`
        sums them), by the table's own update rule, and write them back."""
        table = self.table
        grad = table.grad.index_select(0, self.rows) if table.grad is not None else None
        if self.grad is not None:
            grad = self.grad if grad is None else self.grad.add_(grad)
        table.grad = None  # the table's other rows are final: the part's step must skip it
        if grad is None:
            return
        rows = nn.Parameter(self.values)
        rows.grad = grad
        group = next(g for g in optimizer.param_groups if any(p is table for p in g["params"]))
        step = type(optimizer)([{**group, "params": [rows]}])
        if self.state:
            step.state[rows] = self.state
        step.step()
        table.index_copy_(0, self.rows, rows.detach())
        for key, value in optimizer.state[table].items():
            if _per_row(value, table):
                value.index_copy_(0, self.rows, step.state[rows][key])


def _per_row(value, table: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == table.shape


def _build_parts(modules, wire_dtype: torch.dtype, pin: bool) -> list[Part]:
    """The parts in relay order. A master belongs to the first part that uses it; each part's
    own masters move into one buffer (every replica builds the same layout), then the wires
    are made, so an fp32 wire is a view of the buffer too."""
    parts, wire_of = [], {}  # wire_of: id(master) -> its one wire, shared by every part using it
    for name, module in modules:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        owned = [(n, p) for n, p in named if id(p) not in wire_of]
        buffer = flatten(_layout(owned), pin) if owned else None
        for _, p in owned:
            wire_of[id(p)] = _wire(p, wire_dtype, pin)
        masters = [p for _, p in named]
        parts.append(Part(name, module, [n for n, _ in named], masters, [p for _, p in owned],
                          [n for n, _ in owned], [wire_of[id(p)] for p in masters], buffer))
    return parts


def _layout(named: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    """A part's masters in param-group order (decayed, then not), the order of its optimizer's
    state buffers: each group is one stretch of both."""
    return [p for group in param_groups(named, weight_decay=0.0) for p in group["params"]]


def _flat(part: Part) -> list[torch.Tensor]:
    """What crosses between replicas for a part: its masters as one tensor (or nothing)."""
    return [] if part.buffer is None else [part.buffer]


def _wire(master: nn.Parameter, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    if dtype == torch.float32:
        return master.detach()  # fp32 travels straight from the master
    wire = master.detach().to(dtype)
    return wire.pin_memory() if pin else wire


@torch.no_grad()
def _refresh_wires(part: Part) -> None:
    """After an update, the half copies that travel to the device follow the masters.

    Only the owner refreshes a tied weight's (shared) wire: the head's use of GPT-2's
    `wte` sees the embeddings' update through it.
    """
    owned = {id(p) for p in part.owned}
    stale = [(w, p) for w, p in zip(part.wires, part.masters, strict=True)
             if id(p) in owned and w.data_ptr() != p.data_ptr()]
    if stale:
        torch._foreach_copy_([w for w, _ in stale], [p for _, p in stale])


@torch.no_grad()
def _accumulate(masters: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    """Add gradients into the fp32 master `.grad`s (summing tied uses)."""
    for p, g in zip(masters, grads, strict=True):
        if g is None:
            continue
        g = g if g.dtype == torch.float32 else g.float()
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
