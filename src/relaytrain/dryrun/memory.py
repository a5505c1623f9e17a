"""Device memory without a device: tensor accounting on PyTorch's meta device.

`train.device=meta` runs the real strategy code with every device tensor on the meta
device: no arithmetic and no memory, but the same allocations and frees, in the same order,
as a real step. `DeviceMemory` (a TorchDispatchMode, one per process, thread-local like the
process's work) follows every storage an operator creates on the device and when it dies,
and keeps the peak of the live bytes. At each new peak it asks the strategy what it holds
(`Strategy.memory_holders`: weights, gradients, optimizer state, stash) and files every live
storage under that kind; whatever else is live is activations and temporaries. The figures
are labelled *simulated*; `make test-gpu` checks them against the CUDA allocator.

Host-side work runs on the meta device too where it needs device results (the L2L eager
param server: its masters, host gradients, optimizer state, a host stash), so the dry run
needs to know what is *host*: tensors created on another thread (the EPS worker) are never
seen, and the rest is declared with `on_host()` (around an offload) or `mark_host(...)`.

`relaytrain.planner.dryrun.simulate(cfg)` runs a short dry run of a whole config for the planner; this
module is only the accounting, which the strategies and the trainer use.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("weights", "gradients", "optimizer state", "stash", "activations and temporaries")
SNAPSHOT_STEP = 1.01  # a new breakdown when the peak has grown by 1 % since the last one

_local = threading.local()  # the tracker of this thread (a process's work runs on one thread)
READ_A_NUMBER = torch.ops.aten._local_scalar_dense.default  # `int(t)`, `float(t)`, `t.item()`


def stand_in_number(t: torch.Tensor) -> bool | int | float:
    """What reading a number off a meta tensor gives in a dry run, which has no values: 1 (True),
    as a count of a micro-batch's real items would be at least (a preference objective's pairs
    to average its figures over, which a dry run does not report). Nothing a dry run allocates
    may depend on it."""
    return True if t.dtype == torch.bool else 1 if not t.is_floating_point() else 1.0


def active() -> DeviceMemory | None:
    return getattr(_local, "tracker", None)


# torch's process-wide "a dispatch mode is active" flags, which each mode saves on entry and
# restores on exit (torch.utils._python_dispatch)
_TORCH_MODE_FLAGS = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                     "_is_in_any_mode_without_ignore_compile_internals")


@contextmanager
def torch_mode_flags_kept():
    """Around a dry run's ranks, threads that enter and leave their trackers in turns: torch keeps
    whether a dispatch mode is active in flags of the whole process, not of a thread, so the
    interleaved exits leave them set after every tracker has gone, and whatever reads them later
    in this process (torch.compile) believes a mode is still active. Restored here."""
    from torch.utils import _python_dispatch as dispatch

    kept = {name: getattr(dispatch, name) for name in _TORCH_MODE_FLAGS if hasattr(dispatch, name)}
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(dispatch, name, value)
        if hasattr(dispatch, "set_is_in_mode_without_ignore_compile_internals"):
            dispatch.set_is_in_mode_without_ignore_compile_internals(
                kept.get("_is_in_any_mode_without_ignore_compile_internals", False))


@contextmanager
def on_host():
    """Tensors created inside live in host memory (an offload's copy), not on the device."""
    tracker = active()
    if tracker is None:
        yield
        return
    tracker.host_depth += 1
    try:
        yield
    finally:
        tracker.host_depth -= 1


def mark_host(tensors: Iterable[torch.Tensor]) -> None:
    """These tensors live in host memory (the EPS's masters): not device memory."""
    tracker = active()
    if tracker is not None:
        for t in tensors:
            tracker.forget(t)


def _tensors(tree, found: list) -> list:
    """The tensors in an operator's arguments or results (nested lists, tuples, named tuples
    and dicts of them): what `tree_flatten` finds there, for a fifth of its cost, which a dry
    run pays at every operator."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, list | tuple):
        for item in tree:
            _tensors(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, found)
    return found


class DeviceMemory(TorchDispatchMode):
    """Live and peak bytes of the storages on `device` created while this mode is active."""

    def __init__(self, device: torch.device, holders: Callable[[], dict[str, list]] = dict):
        super().__init__()
        self.device = device
        self.holders = holders  # what the strategy holds by kind, asked at each new peak
        self.live: dict[int, int] = {}  # storage key -> bytes
        self.keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> key
        self.host: weakref.WeakSet = weakref.WeakSet()  # storages declared host memory
        self.host_depth = 0
        self.total = 0
        self.peak = 0
        self.breakdown: dict[str, int] = {}
        self._snapshot_at = 0
        self._next_key = 0

    # -- the mode ------------------------------------------------------------------------
    def __enter__(self):
        _local.tracker = self
        return super().__enter__()

    def __exit__(self, *exc):
        _local.tracker = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is READ_A_NUMBER and args[0].device.type == "meta":
            return stand_in_number(args[0])
        out = func(*args, **(kwargs or {}))
        # Only storages the operator created are new: a view (detach, slice, in-place result)
        # shares its input's, which is counted already, or was made before counting began.
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs), [])}
        for t in _tensors(out, []):
            if id(t.untyped_storage()) not in inputs:
                self.track(t)
        return out

    # -- accounting ------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (once) if it is on the device and not host memory."""
        if tensor.device.type != self.device.type:
            return
        storage = tensor.untyped_storage()
        if storage in self.keys or storage in self.host:
            return
        if self.host_depth:
            self.host.add(storage)
            return
        key, size = self._next_key, storage.nbytes()
        self._next_key += 1
        self.keys[storage] = key
        self.live[key] = size
        self.total += size
        weakref.finalize(storage, self._free, key)
        if self.total > self.peak:
            self.peak = self.total
            if self.total > self._snapshot_at * SNAPSHOT_STEP:
                self._snapshot()

    def register(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Device tensors created before the mode was entered (the strategy's resident weights)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.track(t)

    def forget(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = self.keys.pop(storage, None)
        if key is not None:
            self._free(key)
        self.host.add(storage)

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def _snapshot(self) -> None:
        """File the live bytes under the kinds the strategy holds them as, now, at a new peak."""
        self._snapshot_at = self.total
        kind_of: dict[int, str] = {}
        for kind, tensors in self.holders().items():
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    key = self.keys.get(t.untyped_storage())
                    if key is not None:
                        kind_of.setdefault(key, kind)
        breakdown = dict.fromkeys(KINDS, 0)
        for key, size in self.live.items():
            breakdown[kind_of.get(key, KINDS[-1])] += size
        self.breakdown = breakdown

    def figures(self) -> dict:
        """memory.device of results.json for a dry run. The breakdown is the last one taken on the
        way to the peak (at most 1 % below it); the rest is filed as activations and temporaries."""
        by_kind = dict(self.breakdown) or dict.fromkeys(KINDS, 0)
        by_kind[KINDS[-1]] += self.peak - sum(by_kind.values())
        return {"peak_allocated_bytes": self.peak, "peak_reserved_bytes": None, "simulated": True,
                "by_kind": by_kind,
                "note": "simulated: tensor accounting of a dry run on the meta device (no allocator overhead)"}
