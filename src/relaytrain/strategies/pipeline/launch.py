"""Start a pipeline run: refuse what cannot run, start one process per worker, watch them.

`relaytrain train strategy=pipe_flush` on one machine spawns stages x replicas workers
itself. Under `torchrun` (RANK and WORLD_SIZE set) the same command *is* one worker.

A failure anywhere ends the whole run quickly: the parent watches its children and kills
every worker as soon as one exits badly; inside the workers every transfer and reduction
waits at most `strategy.timeout_s`. The error shown is the failing rank's own, one line:
a rank killed by a signal is the cause before any rank that merely lost a peer, otherwise
the earliest error wins (peers fail after the rank that broke).

SIGINT/SIGTERM to the parent is a request to stop: the workers ignore both signals (a
terminal's Ctrl-C reaches the whole process group) and read the request from shared
memory; they agree on a step, save a checkpoint and exit, and the parent raises
`Interrupted` naming it. Under torchrun each worker takes the signal itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from relaytrain.checkpoint import checkpoint_dir
from relaytrain.data import build_dataset, build_loader
from relaytrain.errors import ConfigError
from relaytrain.models import count_parameters
from relaytrain.report import StepProgress, print_summary, write_results
from relaytrain.strategies.pipeline import checkpoints
from relaytrain.strategies.pipeline.comms import Topology
from relaytrain.strategies.pipeline.schedule import build_schedule, check_shape
from relaytrain.strategies.pipeline.validate import check_schedule
from relaytrain.train import Interrupted

WORKERS_PER_CPU = 4  # more processes than this per core makes transfers time out, not progress
WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each worker
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class PipelineFailed(ConfigError):
    """A worker failed; the message is that worker's error in one line (shown like a ConfigError)."""


def run_pipeline(cfg, run_dir: str | Path, overrides: list[str]) -> dict:
    """Train with a pipeline strategy; write run_dir/results.json and return the results."""
    run_dir = Path(run_dir)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_as_torchrun_worker(cfg, run_dir, overrides)
    device_type = _device_type(cfg)
    check_runnable(cfg, device_type)
    resume = find_resume(cfg, run_dir)
    dataset = build_dataset(cfg, tokenizer_dir=str(run_dir))  # once, before any worker: data errors end here
    build_loader(cfg, dataset)  # refuses a dataset smaller than one minibatch
    relay = _spawn_and_watch(cfg, run_dir, overrides, dataset, resume)
    if relay.stopped_at.value:
        raise _interrupted(relay.signum.value, relay.stopped_at.value, run_dir)
    path = run_dir / "results.json"
    results = json.loads(path.read_text())
    print_summary(results, path)
    return results


# ----------------------------------------------------------------------- refusals


def check_runnable(cfg, device_type: str) -> None:
    """Everything that would fail inside the workers, refused before any process starts."""
    s = cfg.strategy
    check_shape(s.name, s.stages, s.num_microbatches, cfg.train.steps)
    check_schedule(build_schedule(s.name, s.stages, s.num_microbatches, min(cfg.train.steps, 3)))
    if cfg.precision.name == "amp_fp16":
        raise ConfigError(
            "precision=amp_fp16 needs one loss-scale decision across all stages, which the pipelines "
            "do not make; use precision=amp_bf16 or fp32"
        )
    if cfg.optim.grad_clip > 0:
        raise ConfigError(
            f"optim.grad_clip={cfg.optim.grad_clip}: global-norm clipping across stages would stall "
            f"the pipeline at every update; set optim.grad_clip=0 with pipe_flush/pipe_2bw"
        )
    if s.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"strategy.backend={s.backend} is not one of auto, gloo, nccl")
    if s.backend == "nccl" and device_type != "cuda":
        raise ConfigError("strategy.backend=nccl needs CUDA devices; use strategy.backend=gloo or auto")
    _check_machine(cfg, device_type)


def _check_machine(cfg, device_type: str) -> None:
    s = cfg.strategy
    world = s.stages * s.replicas
    if device_type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(
            f"strategy.stages x strategy.replicas = {world} workers need one GPU each, "
            f"{torch.cuda.device_count()} visible; lower them or run under torchrun on more machines"
        )
    cpus = os.cpu_count() or 1
    if device_type == "cpu" and world > WORKERS_PER_CPU * cpus:
        raise ConfigError(
            f"strategy.stages x strategy.replicas = {world} workers on {cpus} CPU cores is more than "
            f"{WORKERS_PER_CPU} per core; lower strategy.stages or strategy.replicas"
        )
    params_bytes = 4 * count_parameters(cfg.model)
    versions = 2 if s.name == "pipe_2bw" else 1
    optimizer_words = 1 if cfg.optim.name == "sgd" else 2
    # Each worker builds the whole model once before keeping its stage.
    need = world * (WORKER_OVERHEAD_BYTES + params_bytes) + s.replicas * params_bytes * (versions + 2 + optimizer_words)
    available = psutil.virtual_memory().available
    if cfg.train.check_memory and need > available:
        raise ConfigError(
            f"{world} pipeline workers need about {need / 2**30:.1f} GiB of host memory (estimate), "
            f"{available / 2**30:.1f} GiB is available; lower strategy.replicas or strategy.stages, "
            f"or train.check_memory=false to try anyway"
        )


def find_resume(cfg, run_dir: Path) -> Path | None:
    """The checkpoint `train.resume` names, checked against the config before any worker starts."""
    path = checkpoints.find(cfg.train.resume, run_dir) if cfg.train.resume else None
    if path is not None:
        step = checkpoints.check_fits(path, cfg)
        print(f"resuming from {path} at step {step}", flush=True)
    return path


def _interrupted(signum: int, step: int, run_dir: Path) -> Interrupted:
    return Interrupted(signum, step, checkpoints.step_dir(checkpoint_dir(run_dir), step))


def _device_type(cfg) -> str:
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


# ----------------------------------------------------------------------- local launch


@dataclass
class _Relay:
    """Shared memory between the parent and its workers (no lock: one writer each)."""

    signum: object  # the stop signal the parent received, 0 if none
    stopped_at: object  # written by rank 0: the step the workers stopped and saved at, 0 if they finished

    @classmethod
    def create(cls, context) -> _Relay:
        return cls(context.RawValue("i", 0), context.RawValue("q", 0))

    def request(self, signum, frame) -> None:
        self.signum.value = signum


def _spawn_and_watch(cfg, run_dir: Path, overrides: list[str], dataset, resume: Path | None) -> _Relay:
    topology = Topology(cfg.strategy.stages, cfg.strategy.replicas)
    errors = run_dir / "pipeline_errors"  # written only when a worker fails
    for old in errors.glob("rank*"):
        old.unlink()
    config = OmegaConf.to_container(cfg, resolve=True)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    relay = _Relay.create(context)
    procs = [
        context.Process(
            target=_spawned_worker,
            args=(rank, topology.world_size, config, dataset, str(run_dir), init_method, overrides, resume, relay),
            name=f"relaytrain-{topology.describe(rank)}",
        )
        for rank in range(topology.world_size)
    ]
    try:
        _start_and_watch(procs, relay, topology, errors)
    finally:
        _stop(procs)
    return relay


def _start_and_watch(procs, relay: _Relay, topology: Topology, errors: Path) -> None:
    """Start the workers deaf to SIGINT/SIGTERM, then turn both into `relay.signum` while watching.

    The workers start while the parent ignores both signals, so they inherit SIG_IGN through
    exec: a Ctrl-C (sent to the whole process group) cannot kill one even during its start-up.
    Meanwhile the signals are blocked, so one sent then waits for the parent's handler.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
        for p in procs:
            p.start()
        _watch(procs, topology, errors)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        with _signal_handlers(signal.SIG_IGN):
            for p in procs:
                p.start()
        with _signal_handlers(relay.request):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            _watch(procs, topology, errors)
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


def _watch(procs, topology: Topology, errors: Path) -> None:
    """Return when every worker succeeded; on the first failure stop them all and raise."""
    while True:
        failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            _stop(procs)
            raise PipelineFailed(_failure_line(procs, failed, topology, errors))
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


def _failure_line(procs, failed: list[int], topology: Topology, errors: Path) -> str:
    killed = [rank for rank in failed if procs[rank].exitcode < 0]
    if killed:
        rank = killed[0]
        name = signal.Signals(-procs[rank].exitcode).name
        return f"pipeline worker {topology.describe(rank)} was killed by {name}; the other workers were stopped"
    records = [json.loads(f.read_text()) for f in errors.glob("rank*.json")]
    if records:
        first = min(records, key=lambda r: r["time"])
        trace = errors / f"rank{first['rank']}.txt"
        return f"pipeline worker {topology.describe(first['rank'])} failed: {first['error']} (traceback: {trace})"
    rank = failed[0]
    return f"pipeline worker {topology.describe(rank)} exited with code {procs[rank].exitcode}"


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
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = mp.parent_process()
    if launcher is not None and os.getppid() != launcher.pid:  # it died before prctl took effect
        os._exit(1)


def _spawned_worker(rank, world, config, dataset, run_dir, init_method, overrides, resume, relay) -> None:
    # Stop requests come through `relay` (a Ctrl-C to the process group must not kill a worker
    # mid-step); SIG_IGN is inherited already, set here for a parent outside the main thread.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_launcher()
    try:
        cfg = OmegaConf.create(config)
        threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // world)
        place = _Place(rank, world, rank, threads, init_method)
        stopped = _serve(cfg, place, dataset, Path(run_dir), overrides, resume, lambda: relay.signum.value)
        if stopped is not None and rank == 0:
            relay.stopped_at.value = stopped.step
    except Exception as err:
        _record_failure(Path(run_dir) / "pipeline_errors", rank, err)
        raise SystemExit(1) from None


def _record_failure(errors: Path, rank: int, err: Exception) -> None:
    line = (str(err).strip().splitlines() or [""])[0]
    errors.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "time": time.time(), "error": f"{type(err).__name__}: {line}"}
    (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
    tmp = errors / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(errors / f"rank{rank}.json")


# ----------------------------------------------------------------------- torchrun


def _run_as_torchrun_worker(cfg, run_dir: Path, overrides: list[str]) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = cfg.strategy
    if world != s.stages * s.replicas:
        raise ConfigError(
            f"torchrun started {world} workers but strategy.stages x strategy.replicas = {s.stages * s.replicas}; "
            f"make them equal"
        )
    check_runnable(cfg, _device_type(cfg))
    resume = find_resume(cfg, run_dir)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world)
    dataset = build_dataset(cfg, tokenizer_dir=str(run_dir))
    relay = _Relay.create(mp.get_context("spawn"))  # torchrun passes SIGINT/SIGTERM to each worker
    with _signal_handlers(relay.request):
        place = _Place(rank, world, local_rank, threads, "env://")
        stopped = _serve(cfg, place, dataset, run_dir, overrides, resume, lambda: relay.signum.value)
    if stopped is not None:
        raise _interrupted(stopped.signum, stopped.step, run_dir)
    if rank != 0:
        return {}
    path = run_dir / "results.json"
    results = json.loads(path.read_text())
    print_summary(results, path)
    return results


# ----------------------------------------------------------------------- one worker


@dataclass(frozen=True)
class _Place:
    """Where a worker runs: its rank of `world`, its GPU on this machine, its threads, the rendezvous."""

    rank: int
    world: int
    local_rank: int
    threads: int
    init_method: str


def _serve(cfg, place: _Place, dataset, run_dir: Path, overrides, resume: Path | None, stop_requested):
    """Join the process group, train this rank's stage and on rank 0 write the results.

    Returns `Stopped` if the ranks agreed to stop early (their checkpoint is saved), else None.
    """
    from relaytrain.strategies.pipeline.results import pipeline_results
    from relaytrain.strategies.pipeline.worker import StageWorker

    s = cfg.strategy
    torch.set_num_threads(place.threads)
    device_type = _device_type(cfg)
    device = torch.device(f"cuda:{place.local_rank % torch.cuda.device_count()}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = s.backend if s.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=place.init_method, rank=place.rank, world_size=place.world,
                            timeout=timedelta(seconds=s.timeout_s))
    try:
        topology = Topology(s.stages, s.replicas)
        worker = StageWorker(cfg, topology, place.rank, dataset, device, run_dir, stop_requested)
        first = worker.restore(checkpoints.load_part(resume, worker.stage)) if resume else 0
        shows_progress = worker.last and worker.replica == 0
        progress = StepProgress(cfg.train.steps, cfg.train.log_every, f"{s.name} · {cfg.model.name}")
        with progress if shows_progress else nullcontext():
            report = worker.run(first, progress if shows_progress else None)
        if worker.stopped is not None:
            return worker.stopped
        reports = _gather(report, place.rank, place.world)
        states = None
        if cfg.train.save_model:  # replica 0's stages hold one whole model between them
            state = worker.versions.latest().global_state_dict() if worker.replica == 0 else None
            states = _gather(state, place.rank, place.world)
        if place.rank == 0:
            write_results(run_dir, pipeline_results(cfg, reports, device, overrides))
            if states is not None:
                _save_gathered_model(cfg, states, run_dir)
        return None
    finally:
        dist.destroy_process_group()


def _gather(obj, rank: int, world: int) -> list | None:
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _save_gathered_model(cfg, states: list[dict | None], run_dir: Path) -> None:
    """One Hugging Face model directory from every stage's weights."""
    from relaytrain.models import build_model
    from relaytrain.train import save_model

    merged = {name: t for state in states if state is not None for name, t in state.items()}
    model = build_model(cfg.model, cfg.train.seed)
    model.load_state_dict(merged, strict=True)
    save_model(model, run_dir)
