"""Start a pipeline run: refuse what cannot run, start one process per worker, watch them.

`relaytrain train strategy=pipe_flush` on one machine spawns stages x replicas workers
itself. Under `torchrun` (RANK and WORLD_SIZE set) the same command *is* one worker.

A failure anywhere ends the whole run quickly: the parent watches its children and stops
every worker as soon as one exits badly; inside the workers every transfer and reduction
waits at most `strategy.timeout_s`. The error shown is the failing rank's own, one line:
a rank killed by a signal is the cause before any rank that merely lost a peer, otherwise
the earliest error wins (peers fail after the rank that broke).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from relaytrain.data import build_dataset, build_loader
from relaytrain.errors import ConfigError
from relaytrain.models import count_parameters
from relaytrain.report import StepProgress, print_summary, write_results
from relaytrain.strategies.pipeline.comms import Topology
from relaytrain.strategies.pipeline.schedule import build_schedule, check_shape
from relaytrain.strategies.pipeline.validate import check_schedule

WORKERS_PER_CPU = 4  # more processes than this per core makes transfers time out, not progress
WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each worker
STOP_GRACE_S = 5.0


class PipelineFailed(ConfigError):
    """A worker failed; the message is that worker's error in one line (shown like a ConfigError)."""


def run_pipeline(cfg, run_dir: str | Path, overrides: list[str]) -> dict:
    """Train with a pipeline strategy; write run_dir/results.json and return the results."""
    run_dir = Path(run_dir)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_as_torchrun_worker(cfg, run_dir, overrides)
    device_type = _device_type(cfg)
    check_runnable(cfg, device_type)
    dataset = build_dataset(cfg, tokenizer_dir=str(run_dir))  # once, before any worker: data errors end here
    build_loader(cfg, dataset)  # refuses a dataset smaller than one minibatch
    _spawn_and_watch(cfg, run_dir, overrides, dataset)
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


def _device_type(cfg) -> str:
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


# ----------------------------------------------------------------------- local launch


def _spawn_and_watch(cfg, run_dir: Path, overrides: list[str], dataset) -> None:
    topology = Topology(cfg.strategy.stages, cfg.strategy.replicas)
    errors = run_dir / "pipeline_errors"  # written only when a worker fails
    for old in errors.glob("rank*"):
        old.unlink()
    config = OmegaConf.to_container(cfg, resolve=True)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    procs = [
        context.Process(
            target=_spawned_worker,
            args=(rank, topology.world_size, config, dataset, str(run_dir), init_method, overrides),
            name=f"relaytrain-{topology.describe(rank)}",
        )
        for rank in range(topology.world_size)
    ]
    for p in procs:
        p.start()
    try:
        _watch(procs, topology, errors)
    finally:
        _stop(procs)


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
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
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


def _spawned_worker(rank, world, config, dataset, run_dir, init_method, overrides) -> None:
    try:
        cfg = OmegaConf.create(config)
        threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // world)
        _serve(cfg, rank, world, rank, threads, dataset, Path(run_dir), init_method, overrides)
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
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world)
    dataset = build_dataset(cfg, tokenizer_dir=str(run_dir))
    _serve(cfg, rank, world, local_rank, threads, dataset, run_dir, "env://", overrides)
    if rank != 0:
        return {}
    path = run_dir / "results.json"
    results = json.loads(path.read_text())
    print_summary(results, path)
    return results


# ----------------------------------------------------------------------- one worker


def _serve(cfg, rank, world, local_rank, threads, dataset, run_dir: Path, init_method, overrides) -> None:
    """Join the process group, run this rank's program, and on rank 0 write the results."""
    from relaytrain.strategies.pipeline.results import pipeline_results
    from relaytrain.strategies.pipeline.worker import StageWorker

    s = cfg.strategy
    torch.set_num_threads(threads)
    device_type = _device_type(cfg)
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = s.backend if s.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=s.timeout_s))
    try:
        topology = Topology(s.stages, s.replicas)
        worker = StageWorker(cfg, topology, rank, dataset, device)
        program = build_schedule(s.name, s.stages, s.num_microbatches, cfg.train.steps).actions(worker.stage)
        shows_progress = worker.last and worker.replica == 0
        progress = StepProgress(cfg.train.steps, cfg.train.log_every, f"{s.name} · {cfg.model.name}")
        with progress if shows_progress else nullcontext():
            report = worker.run(program, progress if shows_progress else None)
        reports = _gather(report, rank, world)
        states = None
        if cfg.train.save_model:  # replica 0's stages hold one whole model between them
            state = worker.versions.latest().global_state_dict() if worker.replica == 0 else None
            states = _gather(state, rank, world)
        if rank == 0:
            write_results(run_dir, pipeline_results(cfg, reports, device, overrides))
            if states is not None:
                _save_gathered_model(cfg, states, run_dir)
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
