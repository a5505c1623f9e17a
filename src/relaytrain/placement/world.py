"""The processes of one run, seen from one of them: its rank, its device, and how they agree.

A run is one process (baseline, l2l) or several (pipelines, l2l with replicas), started by
`relaytrain.run.launch`. Each process gets a `World`: where it stands and what device it computes
on, the stop request its launcher passes on to it, and a gloo group of its own for the trainer's
small agreements (stop votes, barriers, gathering reports), so those never queue behind a
strategy's gradient traffic, whatever backend the strategy uses.

Where a process sits along the run's degrees (replica, shard, stage, sequence part, tensor part)
is not the World's but its strategy's layout (`placement.layout`, `Strategy.layout`): the
launcher makes the World knowing only how many processes there are, and the device meshes the
layout makes live and die with the strategy's process groups.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relaytrain.utils.errors import Aborted


class DoneWork:
    """A collective or transfer that has nothing to move: a dry run on the meta device, where
    every tensor is a shape. Behaves like a completed `dist.Work`."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


class LocalGroup:
    """The processes of a dry run, run as threads of one process (`launch` does this on the meta
    device): barriers and gathers between the threads, no process group.

    The threads take turns: a thread inside `turn()` runs only while it holds the group's turn,
    and lets it go only while it waits at a barrier, so one computes at a time. A process's
    figures do not depend on the other processes' threads (each counts its own tensors, and
    nothing moves between them), but running them at once is slow: every operator releases the
    GIL and takes it back, and threads contending for it at every operator spend their time
    handing it over (8 stages of GPT-2 1.5 B, 2 steps, on 2 cores beside another job: 32 to 47 s
    at once, 19 s in turns). The exception is L2L with a sharded EPS: there a process's own EPS
    worker thread drops the gradients it was handed whenever it gets to them, so its figures
    depend on thread timing, in turns or not.
    """

    def __init__(self, size: int, stand_in: list[int] | None = None):
        self.size = size
        # rank -> the rank whose thread speaks for it (launch's `dry_run_stand_ins`): the
        # threads of the ranks that stand for themselves are all that meet at a barrier.
        self.stand_in = list(range(size)) if stand_in is None else list(stand_in)
        self._barrier = threading.Barrier(len(set(self.stand_in)))
        self._slots: list = [None] * size
        self._turn = threading.Lock()
        self._holding = threading.local()  # whether this thread took the turn in `turn()`

    @contextmanager
    def turn(self):
        """Run the body as this thread's turn (handed on at every barrier inside)."""
        with self._turn:
            self._holding.turn = True
            try:
                yield
            finally:
                self._holding.turn = False

    def barrier(self) -> None:
        holding = getattr(self._holding, "turn", False)
        if holding:
            self._turn.release()
        try:
            self._barrier.wait()
        finally:
            if holding:
                self._turn.acquire()

    def exchange(self, rank: int, obj) -> list:
        """Every rank's `obj` (a rank stood in for: its stand-in's), on every thread."""
        self._slots[rank] = obj
        self.barrier()
        out = [self._slots[r] for r in self.stand_in]
        self.barrier()  # nobody writes the next round's slots before all have read these
        return out


class StopRequest:
    """The signal a stop was asked with (0: none): set by a signal handler, or read from the
    launcher (its workers ignore signals). A second signal ends the run at once (`Aborted`)."""

    def __init__(self, read: Callable[[], int] | None = None, announce: Callable[[int, str], None] | None = None):
        self._signum = 0
        self._read = read  # a shared value written by the launcher, for its workers
        self.announce = announce  # tells the user what the first signal will do
        self.how_long: Callable[[], str] = lambda: ""  # how long until the next safe point (the trainer knows)

    @property
    def signum(self) -> int:
        return self._read() if self._read is not None else self._signum

    def request(self, signum: int, frame=None) -> None:
        """A signal handler: the first signal asks for a stop at the next safe point, a second
        one raises `Aborted` in the main thread, wherever it is."""
        if self._signum:
            raise Aborted(signum)
        self._signum = signum
        if self.announce is not None:
            self.announce(signum, self.how_long())


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stop: StopRequest = field(default_factory=StopRequest)
    timeout_s: float = 120.0
    control: object = None  # the trainer's gloo group (None with one process; a LocalGroup in a dry run)
    # What this process is doing, e.g. ("step", 5): where its launcher says a worker failed.
    mark: Callable[[str, int], None] = lambda phase, step: None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def simulated(self) -> bool:
        """A dry run on the meta device: the processes are threads, nothing moves between them."""
        return self.device.type == "meta"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def join(self, backend: str, init_method: str | None = None, store=None) -> None:
        """Join the run's process group (every strategy group is made after this), through
        `init_method` or, when given, `store` (every group's keys then live under that store)."""
        if not self.distributed or self.simulated:
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=self.timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.size,
                                    timeout=self.timeout)
        self.control = dist.new_group(list(range(self.size)), timeout=self.timeout, backend="gloo")

    def leave(self) -> None:
        if self.distributed and not self.simulated and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self) -> None:
        if isinstance(self.control, LocalGroup):
            self.control.barrier()
        elif self.distributed:
            dist.barrier(group=self.control)

    def gather(self, obj, to: int) -> list | None:
        """Every process's `obj`, on process `to` (None elsewhere); [obj] with one process."""
        if not self.distributed:
            return [obj]
        if isinstance(self.control, LocalGroup):
            gathered = self.control.exchange(self.rank, obj)
            return gathered if self.rank == to else None
        out = [None] * self.size if self.rank == to else None
        dist.gather_object(obj, out, dst=to, group=self.control)
        return out

    def broadcast(self, obj, src: int):
        """Process `src`'s `obj`, on every process (pickled over the control group); itself with one."""
        if not self.distributed:
            return obj
        if isinstance(self.control, LocalGroup):
            return self.control.exchange(self.rank, obj)[src]
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return value
        if isinstance(self.control, LocalGroup):
            return max(self.control.exchange(self.rank, value))
        ballot = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(ballot, dist.ReduceOp.MAX, group=self.control)
        return int(ballot)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """The device `train.device=name` means here (auto: CUDA when one is visible). A run decides it
    once, where it starts (`train.run`, each `relaytrain train` job, `relaytrain plan`), and hands
    the decision down: to the checks, to the launcher and through it to every `World`."""
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return local_device(torch.device(name), local_rank)


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """A worker's share of the run's device: the CUDA device of its local rank, else the same."""
    if device.type == "cuda":
        return torch.device(f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}")
    return device


def under_torchrun() -> bool:
    """This process is one worker of a torchrun launch (it was given its rank and world size)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_attempt() -> int:
    """Which attempt of a torchrun launch this worker belongs to: 0 first, N after N restarts
    (torchelastic's TORCHELASTIC_RESTART_COUNT; 0 without it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def torchrun_max_restarts() -> int:
    """How often torchrun may restart the workers (`--max-restarts`; 0 outside torchelastic)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) if under_torchrun() else 0


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset, a
    batch scheduler's allocation), which can be fewer than the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def threads_per_process(configured: int, local_processes: int, cores: int | None = None) -> int:
    """torch threads for each of `local_processes` on a machine of `cores` (the cores this
    process may use unless given): `train.threads` when set, else the cores shared out, fewer
    where OMP_NUM_THREADS asks for fewer. The run and the planner's profile both ask here, so a
    run computes with the threads its prediction was timed with."""
    if configured:
        return configured
    shared = max(1, (cores or usable_cores()) // local_processes)
    asked = _omp_threads_asked()
    return min(shared, asked) if asked else shared


def _omp_threads_asked() -> int | None:
    """OMP_NUM_THREADS where the user set it. Under torchrun it is left out: torchrun sets 1 for
    every worker of a machine that runs several, which is not a choice of the user's."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if under_torchrun() or not value.isdigit() or int(value) < 1:
        return None
    return int(value)


class StopVotes:
    """Every process agrees on the step to stop at (SIGINT/SIGTERM asked for it) without pausing.

    Each process casts its stop request after every step; the votes are combined (max) in the
    background on the control group and read `lag` steps later, when every process has long
    cast them, so all read the same answer before starting the same step. `lag` is the
    strategy's (`Strategy.stop_lag`): how many steps a process may run ahead of the slowest.
    With one process the request is read directly.
    """

    def __init__(self, world: World, lag: int):
        self.world, self.lag = world, lag
        self.pending: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def before(self, step: int) -> int:
        """The signal to stop with instead of starting `step`, or 0 (a dry run never stops)."""
        if self.world.simulated:
            return 0
        if not self.world.distributed:
            return self.world.stop.signum
        decided = step - self.lag
        return self._result(decided) if decided in self.pending else 0

    def after(self, step: int) -> None:
        if self.world.distributed and not self.world.simulated:
            ballot = torch.tensor([self.world.stop.signum], dtype=torch.int64)
            work = dist.all_reduce(ballot, dist.ReduceOp.MAX, group=self.world.control, async_op=True)
            self.pending[step] = ballot, work

    def settle(self) -> int:
        """All processes at once (at a checkpoint or the end): read every vote still out, vote
        once more, and return the signal to stop with, or 0."""
        if self.world.simulated:
            return 0
        signum = self.world.stop.signum
        for step in list(self.pending):
            signum = max(signum, self._result(step))
        return self.world.max_int(signum)

    def _result(self, step: int) -> int:
        ballot, work = self.pending.pop(step)
        work.wait(self.world.timeout)
        return int(ballot)
