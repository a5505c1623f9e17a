"""The EPS's worker thread, and what it counts.

`submit(part, grads)` hands one part's gradients to a background worker thread that adds
them into the master `.grad` and steps that part's optimizer, while the caller goes on with
the backward of the parts below (torch ops release the GIL). `wait()` finishes the step's
updates: what is still queued then runs on the caller's own thread (`Worker` says why); or,
carrying updates into the next step, the caller takes over only until the part it is about
to upload has landed (`await_part`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from relaytrain.dryrun import memory


@dataclass
class EpsStats:
    updated_parameters: int = 0  # parameters stepped, summed over steps
    optimizer_s: float = 0.0  # worker time inside optimizer steps
    busy_s: float = 0.0  # all worker time: folding gradients in, clipping, optimizer steps, wire refresh
    exposed_s: float = 0.0  # caller time blocked in `wait()`: EPS work not hidden behind backward
    steps: int = 0
    host_kernel: str | None = None  # what steps the optimizers ("torch fused", "deepspeed cpu_adam"); None: no part here

    def as_dict(self) -> dict:
        return {
            "host_kernel": self.host_kernel,
            "updated_parameters": self.updated_parameters,
            "optimizer_s": self.optimizer_s,
            "parameters_per_s": self.updated_parameters / self.optimizer_s if self.optimizer_s else None,
            "busy_s": self.busy_s,
            "exposed_s": self.exposed_s,
            "exposed_fraction": min(self.exposed_s / self.busy_s, 1.0) if self.busy_s else None,
            "steps": self.steps,
        }


class Worker:
    """Queued tasks run one at a time, in order of priority (then of arrival): on a background
    thread while the caller computes, and on the caller's own thread once it waits for them
    (`join`).

    Why the caller takes over. On a CPU, torch runs each kernel of a fused optimizer as one
    OpenMP parallel region per tensor. The caller's OpenMP team is warm (its threads spin
    between regions); a second thread's team is not, and waking it costs tens of
    microseconds per region, about a fifth of a whole BERT update (docs/benchmarks.md). So
    the background thread computes single-threaded beside the caller's backward, which keeps
    the machine from being oversubscribed, and the updates still queued when the caller
    waits run on the caller's warm team at full speed. Beside a CUDA device the caller's
    compute is the GPU's and the host's cores are the worker's: it takes the caller's count
    (`threads`). The tasks never run concurrently and keep their order, so collectives
    (sharded replicas) and tied-weight sums see the same sequence as with one thread. The
    first error is re-raised by `join`. A priority lets a later task overtake earlier ones
    (the EPS carrying updates into the next step: the part the next forward needs first);
    tasks of one priority keep their order.
    """

    def __init__(self, threads: int = 1):
        self._tasks: list[tuple[int, int, Callable[[], None]]] = []  # a heap of (priority, arrival, task)
        self._arrivals = itertools.count()
        self._changed = threading.Condition()
        self._running = False  # the background thread is inside a task
        self._caller_waiting = False  # the caller runs the queue: the background thread keeps off it
        self._closed = False
        self._error: BaseException | None = None
        callers = torch.get_num_threads()
        started = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(started, threads), name="eps-worker", daemon=True)
        self._thread.start()
        started.wait()
        _set_intra_op_threads(callers)  # torch keeps the last count as the default of new threads

    def put(self, task: Callable[[], None], priority: int = 0) -> None:
        with self._changed:
            heapq.heappush(self._tasks, (priority, next(self._arrivals), task))
            self._changed.notify_all()

    def join(self, until: Callable[[], bool] | None = None) -> None:
        """Run every queued task (the rest of them on this thread), then re-raise the first error;
        with `until`, only until it holds (checked before each task, after the one running)."""
        with self._changed:
            self._caller_waiting = True
            self._changed.wait_for(lambda: not self._running)
        try:
            with memory.on_host():  # a dry run's tracker counts this thread's device tensors; these are the host's
                while until is None or not until():
                    with self._changed:
                        if not self._tasks:
                            break
                        task = heapq.heappop(self._tasks)[2]
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

    def _loop(self, started: threading.Event, threads: int) -> None:
        _set_intra_op_threads(threads)
        started.set()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or (self._tasks and not self._caller_waiting))
                if self._closed:
                    return
                task = heapq.heappop(self._tasks)[2]
                self._running = True
            try:
                self._run(task)
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()


def _set_intra_op_threads(threads: int) -> None:
    """The calling thread's kernels use `threads` threads (with OpenMP the count is per thread).

    torch sets a thread's count from its process-wide default at the thread's first kernel (or
    first count read), overriding whatever the thread set before: read it first, so that the
    count set here is the one that stays. Without that the EPS thread ran two-thread kernels
    after all, and a second live OpenMP team makes libgomp count more threads than cores and
    stop its threads spinning between regions: every region of the caller's compute then
    waited for its threads to wake (L2L's block forwards took 1.4x their profiled time)."""
    if torch.backends.openmp.is_available():
        torch.get_num_threads()  # the thread's lazy initialisation, done now rather than at its first kernel
        torch.set_num_threads(threads)
