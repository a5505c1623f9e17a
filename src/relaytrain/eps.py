"""Eager param server (EPS): the host owns the model; each part is updated as soon as its
gradients for the whole minibatch exist.

The model is split into *parts* in relay order: the embeddings, every block, the head. The
EPS keeps, per part, the fp32 master weights (the model's own parameters, so the Hugging
Face model always holds the trained weights), one optimizer built by `build_optimizer`
(the same update rule as the baseline's; AdamW, LAMB and SGD are all per-tensor, so
stepping part by part gives exactly the whole-model step) and a *wire* copy: what travels
to the device (the master itself for fp32, a half copy for cross mixed precision).

`submit(part, grads)` hands one part's gradients to a single background worker thread that
adds them into the master `.grad` and steps that part's optimizer, while the caller goes on
with the backward of the parts below (torch ops release the GIL). `wait()` joins the worker
before the next step.

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
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from relaytrain.optim import build_optimizer, set_lr
from relaytrain.precision import LossScaler


@dataclass
class Part:
    """One relayed unit: its compute module and the master tensors it uses and owns."""

    name: str
    module: nn.Module
    names: list[str]  # parameter names inside `module`, for functional calls on the device
    masters: list[nn.Parameter]  # fp32 host parameters the module uses (tied ones included)
    owned: list[nn.Parameter]  # the subset this part's optimizer updates
    wires: list[torch.Tensor]  # host copies in the device's dtype (the masters themselves in fp32)
    optimizer: torch.optim.Optimizer | None

    @property
    def num_owned(self) -> int:
        return sum(p.numel() for p in self.owned)


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
    """One background thread running queued tasks in order; the first error is re-raised by `join`."""

    def __init__(self):
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="eps-worker", daemon=True)
        self._thread.start()

    def put(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def join(self) -> None:
        self._tasks.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                if self._error is None:  # after a failure the rest of the step is meaningless
                    task()
            except BaseException as err:  # noqa: BLE001 - handed to the caller by join()
                self._error = err
            finally:
                self._tasks.task_done()
        self._tasks.task_done()


class EagerParamServer:
    """fp32 masters + optimizer state per part on the host, updated on a background worker.

    `modules`: the parts in relay order (embeddings, blocks..., head); their parameters
    are the masters. `wire_dtype`: the dtype parts compute in on the device. `pin`: keep
    host tensors that cross to a CUDA device in pinned memory (asynchronous DMA).
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], optim_cfg, scaler: LossScaler,
                 wire_dtype: torch.dtype = torch.float32, pin: bool = False):
        self.scaler = scaler
        self.grad_clip = optim_cfg.grad_clip
        self.defer = self.grad_clip > 0 or scaler.enabled
        self.parts = _build_parts(modules, optim_cfg, wire_dtype, pin)
        # The baseline's parameter order (model.parameters()), so clipping sums the same way.
        self.all_masters = [p for part in self.parts for p in part.owned]
        self.stats = EpsStats()
        self._overflow = False
        self._worker = _Worker()

    # -- caller side --------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for part in self.parts:
            if part.optimizer is not None:
                set_lr(part.optimizer, lr)

    def submit(self, index: int, grads: list[torch.Tensor | None], ready: torch.cuda.Event | None = None) -> None:
        """Queue part `index`'s minibatch gradients (aligned with its masters, host tensors).

        `ready`: an event the copies into `grads` complete at; the worker waits on it. The
        EPS takes ownership of `grads` (fp32 ones become the master `.grad` without a copy).
        """
        self._worker.put(lambda: self._apply(self.parts[index], grads, ready))

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

    def refresh_wires(self) -> None:
        """The masters changed outside an update (a checkpoint was loaded): make the copies follow."""
        for part in self.parts:
            _refresh_wires(part)

    def close(self) -> None:
        self._worker.close()

    # -- worker side --------------------------------------------------------------------
    def _apply(self, part: Part, grads: list[torch.Tensor | None], ready) -> None:
        if ready is not None:
            ready.synchronize()  # the gradients' download has landed in host memory
        start = time.perf_counter()
        _accumulate(part.masters, grads)
        if not self.defer:
            self._step(part)
        self.stats.busy_s += time.perf_counter() - start

    def _deferred_update(self) -> None:
        start = time.perf_counter()
        self._deferred_step()
        self.stats.busy_s += time.perf_counter() - start

    def _deferred_step(self) -> None:
        grads = [p.grad for p in self.all_masters if p.grad is not None]
        self._overflow = self.scaler.unscale_and_check(grads)
        if self._overflow:
            for p in self.all_masters:
                p.grad = None
        else:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.all_masters, self.grad_clip, foreach=True)
            for part in self.parts:
                self._step(part)
        self.scaler.update(self._overflow)

    def _step(self, part: Part) -> None:
        if part.optimizer is None:
            return
        start = time.perf_counter()
        part.optimizer.step()
        self.stats.optimizer_s += time.perf_counter() - start
        self.stats.updated_parameters += part.num_owned
        part.optimizer.zero_grad(set_to_none=True)
        _refresh_wires(part)


def _build_parts(modules, optim_cfg, wire_dtype: torch.dtype, pin: bool) -> list[Part]:
    parts, wire_of = [], {}  # wire_of: id(master) -> its one wire, shared by every part using it
    for name, module in modules:
        names, masters, owned = [], [], []
        for pname, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) not in wire_of:
                if pin and not p.is_pinned():
                    p.data = p.data.pin_memory()
                wire_of[id(p)] = _wire(p, wire_dtype, pin)
                owned.append((pname, p))
            names.append(pname)
            masters.append(p)
        optimizer = build_optimizer(owned, optim_cfg) if owned else None
        wires = [wire_of[id(p)] for p in masters]
        parts.append(Part(name, module, names, masters, [p for _, p in owned], wires, optimizer))
    return parts


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
