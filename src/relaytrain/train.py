"""One training run: config -> model, data, strategy -> steps -> results.json and a table."""

from __future__ import annotations

import math
import platform
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from relaytrain import checkpoint, metrics
from relaytrain.budget import check_host_memory
from relaytrain.config import validate
from relaytrain.data import build_dataset, build_loader
from relaytrain.errors import ConfigError
from relaytrain.models import build_model, count_parameters
from relaytrain.optim import lr_at
from relaytrain.precision import Precision
from relaytrain.report import StepProgress, print_summary, write_results
from relaytrain.strategies import PIPELINE_STRATEGIES, build_strategy


class TrainingDiverged(ConfigError):
    """The loss became NaN or infinite under a precision that cannot skip steps."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint of the last finished step was saved."""

    def __init__(self, signum: int, step: int, path: Path):
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved to {path}; "
                         f"continue with train.resume={path}")
        self.signum = signum


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run(cfg, run_dir: str | Path, overrides: list[str] | None = None) -> dict:
    """Train as `cfg` says, write `run_dir/results.json`, print the summary, return the results."""
    run_dir = Path(run_dir)
    validate(cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg.train.device)
    if cfg.train.check_memory:
        check_host_memory(cfg, count_parameters(cfg.model), device.type)
    if cfg.strategy.name in PIPELINE_STRATEGIES:
        from relaytrain.strategies.pipeline import run_pipeline

        return run_pipeline(cfg, run_dir, overrides or [])

    host = metrics.HostMemory()
    host.reset_peak()
    metrics.reset_device_peak(device)
    resume_from = checkpoint.find(cfg.train.resume, run_dir) if cfg.train.resume else None
    resumed = checkpoint.load(resume_from, cfg) if resume_from else None
    model = build_model(cfg.model, cfg.train.seed)
    loader = build_loader(cfg, build_dataset(cfg, tokenizer_dir=str(run_dir)))
    precision = Precision.from_name(cfg.precision.name)
    strategy = build_strategy(model, cfg, device, precision)
    try:
        history = train_steps(cfg, strategy, loader, device, run_dir, resumed)
        strategy.sync_model()
        if cfg.train.save_model:
            save_model(model, run_dir)
        results = assemble_results(cfg, model, strategy, device, history, host, overrides or [])
    finally:
        strategy.close()
    path = write_results(run_dir, results)
    print_summary(results, path)
    return results


def train_steps(cfg, strategy, loader, device, run_dir: Path, resumed: dict | None = None) -> dict:
    """The loop: one `strategy.step` per minibatch; times whole steps with the device synchronised.

    Checkpoints every `train.checkpoint_every` steps, and on SIGINT/SIGTERM after the step in
    flight (then raises Interrupted). A resumed run continues the loss history, data stream,
    RNG streams and LR schedule exactly where the checkpoint left them.
    """
    steps = cfg.train.steps
    if resumed is None:
        torch.manual_seed(cfg.train.seed)  # dropout masks: the same stream whichever strategy runs
        history, first = {"losses": [], "step_times": [], "skipped": 0}, 0
    else:
        checkpoint.restore(resumed, strategy)
        history, first = resumed["history"], resumed["step"]
        loader.position = resumed["data_position"]
    every = cfg.train.checkpoint_every
    title = f"{cfg.strategy.name} · {cfg.model.name}"
    with StepProgress(steps, cfg.train.log_every, title) as progress, _stop_requests() as stop:
        for step in range(first, steps):
            minibatch = next(loader)
            start = time.perf_counter()
            result = strategy.step(minibatch, lr_at(step, cfg.optim, steps))
            metrics.synchronize(device)
            history["step_times"].append(time.perf_counter() - start)
            if result.skipped:
                history["skipped"] += 1
            elif not math.isfinite(result.loss):
                raise TrainingDiverged(
                    f"the loss became {result.loss} at step {step + 1} under precision={cfg.precision.name}; "
                    f"the last good checkpoint stays in {checkpoint.checkpoint_dir(run_dir)}; "
                    f"lower optim.lr or use precision=fp32"
                )
            history["losses"].append(result.loss)
            progress.update(step + 1, result.loss, history["step_times"][-1], result.skipped)
            if stop.signum or (every and (step + 1) % every == 0 and step + 1 < steps):
                state = checkpoint.capture(cfg, strategy, step + 1, loader.position, history)
                path = checkpoint.save(state, checkpoint.checkpoint_dir(run_dir), cfg.train.keep_checkpoints)
                if stop.signum:
                    raise Interrupted(stop.signum, step + 1, path)
    return history


class _StopRequest:
    signum: int = 0


@contextmanager
def _stop_requests():
    """Turn SIGINT/SIGTERM into a request the loop honours between steps (a step is never torn)."""
    request = _StopRequest()
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield request
        return

    def handler(signum, frame):
        request.signum = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def save_model(model, run_dir: Path) -> Path:
    """Hugging Face `save_pretrained` into run_dir/model: loadable by AutoModel*.from_pretrained."""
    out = run_dir / "model"
    model.hf_model.save_pretrained(out)
    tokenizer = run_dir / "tokenizer"
    if tokenizer.is_dir():  # a tokenizer trained for this run travels with the model
        for f in tokenizer.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def assemble_results(cfg, model, strategy, device, history, host, overrides) -> dict:
    s, d = cfg.strategy, cfg.data
    samples = s.microbatch_size * s.num_microbatches
    measured = history["step_times"][cfg.train.warmup_steps:] or history["step_times"]
    flops_per_token = metrics.model_flops_per_token(
        model.num_parameters(), model.num_blocks, cfg.model.hidden_size, d.seq_len
    )
    return {
        "strategy": s.name,
        "model": {
            "name": cfg.model.name,
            "family": model.family,
            "task": cfg.model.task,
            "parameters": model.num_parameters(),
            "num_layers": model.num_blocks,
            "hidden_size": cfg.model.hidden_size,
        },
        "device": str(device),
        "precision": cfg.precision.name,
        "steps": len(history["losses"]),
        "measured_steps": len(measured),
        "microbatch_size": s.microbatch_size,
        "num_microbatches": s.num_microbatches,
        "samples_per_step": samples,
        "tokens_per_step": samples * d.seq_len,
        "loss": history["losses"],
        "skipped_steps": history["skipped"],
        "step_times_s": history["step_times"],
        "throughput": metrics.throughput(measured, samples, samples * d.seq_len, flops_per_token),
        "memory": {"device": metrics.device_memory(device), "host_peak_rss_bytes": host.peak_bytes()},
        "strategy_report": strategy.report(),
        "threads": metrics.cpu_threads(),
        "overrides": list(overrides),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
