"""One launcher for every strategy: one process in place, or one process per worker.

`launch(entry, cfg, ...)` runs `entry(cfg, world, payload)` in every process of the run and
returns what the reporting process returned:
- one process (baseline, l2l): here, in this process;
- several (pipelines, l2l with replicas) on one machine: workers forked from a server that
  imported the training code once (`worker_start`; RELAYTRAIN_WORKER_START=spawn starts each in
  a fresh interpreter instead), watched from here;
- under `torchrun` (RANK and WORLD_SIZE set): this process *is* one worker.

A failure anywhere ends the whole run quickly: the launcher watches its workers and kills
every one as soon as one exits badly; inside the workers every transfer and reduction waits
at most `strategy.timeout_s`. The error shown is the failing worker's own, one line: a worker
killed by a signal is the cause before any that merely lost a peer, otherwise the earliest
error wins (peers fail after the worker that broke). A worker never outlives its launcher
(`PR_SET_PDEATHSIG`).

Stopping. SIGINT/SIGTERM to the launcher is a request to stop: spawned workers ignore both
signals (a terminal's Ctrl-C reaches the whole process group) and read the request from
shared memory; they agree on a step, save a checkpoint and exit, and the launcher raises
`Interrupted` naming it. A second signal kills the workers at once (`Aborted`). Under torchrun
each worker takes the signals itself.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

from relaytrain.dryrun import memory
from relaytrain.placement.world import (
    LocalGroup,
    StopRequest,
    World,
    local_device,
    threads_per_process,
    torchrun_attempt,
    under_torchrun,
)
from relaytrain.records.checkpoint import continue_from
from relaytrain.utils.errors import Aborted, ConfigError, Interrupted, first_line
from relaytrain.utils.files import write_json
from relaytrain.utils.stdio import Outliving
from relaytrain.utils.units import duration

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
START_METHOD = "RELAYTRAIN_WORKER_START"  # forkserver (the default where there is one) or spawn


class WorkerFailed(ConfigError):
    """A worker failed; the message is that worker's error in one line (shown like a ConfigError)."""


def launch(entry, cfg, processes: int, describe, run_dir: Path, payload, latest_checkpoint, device: torch.device):
    """Run `entry(cfg, world, payload)` in each of `processes` on the run's `device` (each worker
    on its local rank's); return the reporter's result (None on the other processes under
    torchrun). `describe(rank)` names a worker in errors; `latest_checkpoint()` names the newest
    complete checkpoint when a second signal aborts."""
    if under_torchrun():
        return _as_torchrun_worker(entry, cfg, processes, payload, device)
    if device.type == "meta":
        return _dry_run(entry, cfg, processes, payload)
    if processes == 1:
        return _in_this_process(entry, cfg, payload, device)
    return _spawn_and_watch(entry, cfg, processes, describe, Path(run_dir), payload, latest_checkpoint, device)


def announce_stop(signum: int, how_long: str = "") -> None:
    """What the first stop signal does, and what a second one would."""
    wait = f" ({how_long})" if how_long else ""
    print(f"relaytrain: {signal.Signals(signum).name}: stopping after the step in flight{wait}, then saving a "
          f"checkpoint; send it again to stop at once without saving", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------- one process


def keep_freed_host_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    A training step frees and reallocates the same activation and gradient buffers every
    micro-batch. With glibc's defaults, frees at the top of the heap past a small threshold are
    returned to the kernel, so the next step takes page faults again and the kernel zeroes each
    page anew (measured on pipe_flush, docs/benchmarks.md). Tensors of 32 MiB and more are still
    mapped on their own (the largest threshold glibc accepts). Elsewhere than glibc: nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**30)


def _in_this_process(entry, cfg, payload, device: torch.device):
    keep_freed_host_memory()
    world = World(device=device, stop=StopRequest(announce=announce_stop))
    # Whatever count an earlier run in this process left: the one the profile times with. The
    # caller's is given back after (a script's or a notebook's own setting).
    callers = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(cfg.train.threads, 1))
    try:
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            return entry(cfg, world, payload)
        with _signal_handlers(world.stop.request):
            return entry(cfg, world, payload)
    finally:
        torch.set_num_threads(callers)


def _as_torchrun_worker(entry, cfg, processes: int, payload, device: torch.device):
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != processes:
        raise ConfigError(f"torchrun started {size} workers but strategy={cfg.strategy.name} needs {processes} "
                          f"(strategy.stages x strategy.replicas); make them equal")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    keep_freed_host_memory()
    torch.set_num_threads(threads_per_process(cfg.train.threads, int(os.environ.get("LOCAL_WORLD_SIZE", size))))
    world = _world(cfg, rank, size, local_rank, StopRequest(announce=announce_stop), device)
    with _signal_handlers(world.stop.request):
        return _joined(entry, cfg, world, payload, "env://", store=_attempt_store(world))


def _attempt_store(world: World):
    """The torchrun launch's store, with every key this attempt writes under a prefix of its own.

    env:// connects to the store at MASTER_ADDR:MASTER_PORT. Under torchelastic that is the
    agent's store (TORCHELASTIC_USE_AGENT_STORE), and the agent keeps it, port and keys, across
    restarts: unprefixed, a restarted attempt reads the process-group keys the previous attempt
    left (a dead process's gloo address, for one) and its ranks connect to processes that are
    gone. Under the attempt's own prefix each attempt starts from an empty key space.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", world.rank, world.size, timeout=world.timeout))
    store.set_timeout(world.timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return PrefixStore(f"relaytrain/{run_id}/attempt-{torchrun_attempt()}/", store)


def _world(cfg, rank: int, size: int, local_rank: int, stop: StopRequest, device: torch.device) -> World:
    timeout = float(getattr(cfg.strategy, "timeout_s", 120.0))
    return World(rank, size, local_rank, local_device(device, local_rank), stop, timeout)


def _joined(entry, cfg, world: World, payload, init_method: str, store=None):
    backend = str(getattr(cfg.strategy, "backend", "auto"))
    if backend == "auto":
        backend = "nccl" if world.device.type == "cuda" else "gloo"
    world.join(backend, init_method, store)
    try:
        result = entry(cfg, world, payload)
    except Interrupted:  # every process stopped at the same step, after its checkpoint: all in step
        gc.collect()
        world.leave()
        raise
    # Left only when all agree: tearing the group down under peers still inside a collective
    # aborts the process before it could say why it failed. A failing worker just exits. The
    # run's objects go first: a gloo work that a strategy's wrapper (DDP, FSDP) still holds,
    # destroyed after the group or during the interpreter's teardown, aborts the process.
    gc.collect()
    world.leave()
    return result


# Set by a caller that reads only a dry run's device figures, by rank (`relaytrain.planner.dryrun`):
# `stand_in(cfg, rank)` names the rank whose dry run is exactly `rank`'s (the strategy says so).
dry_run_stand_ins: ContextVar[Callable[[object, int], int] | None] = ContextVar("dry_run_stand_ins", default=None)


def _dry_run(entry, cfg, processes: int, payload):
    """A dry run on the meta device: every process of the run as a thread of this one, joined
    by a LocalGroup (nothing moves between them: all tensors are shapes), the threads taking
    turns (`LocalGroup.turn`). Each thread's own tracker sees only its own work.

    Under `dry_run_stand_ins` a rank with a stand-in is not run: its stand-in's thread speaks
    for it at every gather, so its report is a copy of the stand-in's (its rank included)."""
    stand_in = dry_run_stand_ins.get()
    stand_ins = [stand_in(cfg, rank) if stand_in else rank for rank in range(processes)]
    if any(stand_ins[s] != s for s in stand_ins):
        raise ValueError(f"a dry run's stand-ins must stand for themselves: {stand_ins}")
    group = LocalGroup(processes, stand_ins)
    worlds = [World(rank, processes, rank, torch.device("meta"), StopRequest(), control=group if processes > 1 else None)
              for rank in sorted(set(stand_ins))]
    results: list = [None] * processes
    errors: list[BaseException] = []

    def work(world: World) -> None:
        try:
            with group.turn():
                results[world.rank] = entry(cfg, world, payload)
        except BaseException as err:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(err)
            group._barrier.abort()  # the others would wait for it forever

    threads = [threading.Thread(target=work, args=(world,), name=f"relaytrain-dry-rank{world.rank}") for world in worlds]
    with memory.torch_mode_flags_kept():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return next((r for r in results if r), None)


# ----------------------------------------------------------------------- local workers


PHASES = ("while starting", "during step {}", "during the evaluation after step {}",
          "while saving the checkpoint of step {}", "while finishing")
PHASE_CODES = {"step": 1, "evaluation": 2, "checkpoint": 3, "the end": 4}  # World.mark's phases


@dataclass
class _Shared:
    """Shared memory between the launcher and its workers (no lock: one writer each)."""

    signum: object  # the stop signal the launcher received, 0 if none
    stopped_at: object  # written by the reporter: the step the workers stopped and saved at, 0 if they finished
    stopped_by: object
    where: object  # per worker: its phase code and step (World.mark), so a failure can say when it struck

    @classmethod
    def create(cls, context, processes: int) -> _Shared:
        return cls(context.RawValue("i", 0), context.RawValue("q", 0), context.RawValue("i", 0),
                   context.RawArray("q", 2 * processes))

    def mark(self, rank: int, phase: str, step: int) -> None:
        self.where[2 * rank + 1] = step
        self.where[2 * rank] = PHASE_CODES[phase]

    def when(self, rank: int) -> str:
        """When worker `rank` was last heard of, e.g. "during step 5"."""
        return PHASES[self.where[2 * rank]].format(self.where[2 * rank + 1])


def _spawn_and_watch(entry, cfg, processes: int, describe, run_dir: Path, payload, latest_checkpoint,
                     device: torch.device):
    from omegaconf import OmegaConf

    errors = run_dir / "worker_errors"  # written only when a worker fails
    for old in errors.glob("rank*"):
        old.unlink()
    config = OmegaConf.to_container(cfg, resolve=True)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = _worker_context()
    shared = _Shared.create(context, processes)
    environment = dict(os.environ)  # a forked worker's own is the fork server's, from when it started
    procs = [
        context.Process(target=_spawned_worker,
                        args=(entry, rank, processes, config, payload, str(run_dir), init_method, shared, device,
                              environment),
                        name=f"relaytrain-rank{rank}")
        for rank in range(processes)
    ]
    stop = StopRequest(announce=announce_stop)
    stop.how_long = lambda: _step_time_hint(run_dir)
    timeout_s = float(getattr(cfg.strategy, "timeout_s", 120.0))

    def explain(failed: list[int]) -> ConfigError:
        return failure(procs, failed, describe, errors, shared.when, latest_checkpoint(), timeout_s)

    try:
        _start_and_watch(procs, stop, shared, explain)
    except Aborted as abort:
        _stop(procs)
        raise Aborted(abort.signum, latest_checkpoint()) from None
    finally:
        _stop(procs)
    if shared.stopped_at.value:
        raise Interrupted(shared.stopped_by.value, shared.stopped_at.value, latest_checkpoint())
    path = run_dir / "results.json"
    return json.loads(path.read_text())


def _worker_context():
    """How workers start: forked from a server that imported the training code once (milliseconds
    a worker instead of the seconds a fresh interpreter spends importing torch and transformers),
    or spawned where the platform has no fork server or RELAYTRAIN_WORKER_START=spawn asks."""
    method = os.environ.get(START_METHOD) or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"{START_METHOD}={method!r}: use forkserver or spawn")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["relaytrain.run.worker_start"])  # read when the server starts
    return context


def _step_time_hint(run_dir: Path) -> str:
    """The workers' step time, from what the reporter logged so far."""
    from relaytrain.records.runlog import read_metrics

    rows = [row for row in read_metrics(run_dir) if row.get("step_time_s")]
    return f"steps take about {duration(rows[-1]['step_time_s'])}" if rows else ""


def _start_and_watch(procs, stop: StopRequest, shared: _Shared, explain) -> None:
    """Start the workers deaf to SIGINT/SIGTERM, then pass both on to them while watching.

    The workers start while the launcher ignores both signals, so they inherit SIG_IGN through
    exec: a Ctrl-C (sent to the whole process group) cannot kill one even during its start-up.
    Meanwhile the signals are blocked, so one sent then waits for the launcher's handler.
    """
    def request(signum, frame):
        stop.request(signum)  # raises Aborted on the second one
        shared.signum.value = signum

    if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
        for p in procs:
            p.start()
        _watch(procs, explain)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        with _signal_handlers(signal.SIG_IGN):
            for p in procs:
                p.start()
        with _signal_handlers(request):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            _watch(procs, explain)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextmanager
def _signal_handlers(handler):
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _watch(procs, explain) -> None:
    """Return when every worker succeeded; on the first failure stop them all and raise what
    `explain(failed ranks)` makes of it (asked first: a stopped worker is still there to see)."""
    while True:
        failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            error = explain(failed)
            _stop(procs)
            raise error
        running = [p.sentinel for p in procs if p.exitcode is None]
        if not running:
            return
        wait(running, timeout=1.0)


def _stop(procs) -> None:
    """SIGKILL: the workers ignore SIGTERM, and one that lost a peer has nothing left to save."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    for p in alive:
        p.join()


def failure(procs, failed: list[int], describe, errors: Path, when, latest: Path | None,
            timeout_s: float) -> ConfigError:
    """The one error that explains a failed run (see the module's docstring): which worker,
    when (`when(rank)`, e.g. "during step 5"), and the checkpoint to continue from."""
    then = f"; {continue_from(latest)}"
    killed = [rank for rank in failed if procs[rank].exitcode < 0]
    if killed:
        rank = killed[0]
        name = signal.Signals(-procs[rank].exitcode).name
        return WorkerFailed(f"worker {describe(rank)} was killed by {name} {when(rank)}; "
                            f"the other workers were stopped{then}")
    stopped = [rank for rank, p in enumerate(procs) if p.exitcode is None and _is_stopped(p.pid)]
    if stopped:
        rank = stopped[0]
        return WorkerFailed(f"worker {describe(rank)} was stopped (SIGSTOP or a debugger) {when(rank)}; the others "
                            f"gave up waiting for it after strategy.timeout_s={timeout_s:g} s{then}")
    records = [json.loads(f.read_text()) for f in errors.glob("rank*.json")]
    if records:
        first = min(records, key=lambda r: r["time"])
        if first["user_error"]:  # a ConfigError: its message is the whole story
            return ConfigError(first["message"])
        rank = first["rank"]
        return WorkerFailed(f"worker {describe(rank)} failed {when(rank)}: {first['error']}: {first['message']} "
                            f"(traceback: {errors / f'rank{rank}.txt'}){then}")
    rank = failed[0]
    return WorkerFailed(f"worker {describe(rank)} exited with code {procs[rank].exitcode} {when(rank)}{then}")


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, SIGTSTP or a tracer), from /proc (False elsewhere)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher() -> None:
    """A worker must not outlive its launcher: one SIGKILLed (by an out-of-memory killer, say)
    cannot stop its workers, so on Linux the kernel does it (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    parent = os.getppid()  # the launcher, or the fork server, which ends when the launcher does
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = mp.parent_process()
    if os.getppid() != parent or launcher is not None and not _pid_alive(launcher.pid):
        os._exit(1)  # it died before prctl took effect


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's: not ours, but not gone
        return True
    return True


def _spawned_worker(entry, rank, size, config, payload, run_dir, init_method, shared, device, environment) -> None:
    os.environ.clear()  # the launcher's environment as it is now (fault injection, jitter, ...)
    os.environ.update(environment)
    # Stop requests come through `shared` (a Ctrl-C to the process group must not kill a worker
    # mid-step); SIG_IGN is inherited already, set here for a launcher outside the main thread.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_launcher()
    sys.stdout, sys.stderr = Outliving(sys.stdout), Outliving(sys.stderr)  # a reader gone ends no worker
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.create(config)
        keep_freed_host_memory()
        torch.set_num_threads(threads_per_process(cfg.train.threads, size))
        world = _world(cfg, rank, size, rank, StopRequest(read=lambda: shared.signum.value), device)
        world.mark = lambda phase, step: shared.mark(rank, phase, step)
        _joined(entry, cfg, world, payload, init_method)
    except Interrupted as stop:
        shared.stopped_by.value, shared.stopped_at.value = stop.signum, stop.step
    except Exception as err:
        _record_failure(Path(run_dir) / "worker_errors", rank, err)
        os._exit(1)  # no teardown: the process group's destructor would abort under peers mid-collective
    _exit_without_teardown(0)


def _exit_without_teardown(code: int) -> None:
    """End a worker whose work is on disk and whose group is left, skipping the interpreter's
    teardown: a gloo work object still alive then (DDP's reducer holds some) is destroyed with the
    interpreter half gone and aborts the process ("terminate called without an active
    exception"), about once in 50 DDP worker exits on a 2-core machine, which turned a finished
    run into a failed one."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_failure(errors: Path, rank: int, err: Exception) -> None:
    errors.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "time": time.time(), "error": type(err).__name__,
              "message": first_line(err), "user_error": isinstance(err, ConfigError)}
    (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
    write_json(errors / f"rank{rank}.json", record)
