"""One training run: config -> model, data, strategy -> steps -> results.json and a table."""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch

from relaytrain import metrics
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
    model = build_model(cfg.model, cfg.train.seed)
    loader = build_loader(cfg, build_dataset(cfg, tokenizer_dir=str(run_dir)))
    precision = Precision.from_name(cfg.precision.name)
    strategy = build_strategy(model, cfg, device, precision)
    try:
        history = train_steps(cfg, strategy, loader, device)
        strategy.sync_model()
        if cfg.train.save_model:
            save_model(model, run_dir)
        results = assemble_results(cfg, model, strategy, device, history, host, overrides or [])
    finally:
        strategy.close()
    path = write_results(run_dir, results)
    print_summary(results, path)
    return results


def train_steps(cfg, strategy, loader, device) -> dict:
    """The loop: one `strategy.step` per minibatch; times whole steps with the device synchronised."""
    torch.manual_seed(cfg.train.seed)  # dropout masks: the same stream whichever strategy runs
    steps = cfg.train.steps
    losses, step_times, skipped = [], [], 0
    title = f"{cfg.strategy.name} · {cfg.model.name}"
    with StepProgress(steps, cfg.train.log_every, title) as progress:
        for step, minibatch in zip(range(steps), loader, strict=False):
            start = time.perf_counter()
            result = strategy.step(minibatch, lr_at(step, cfg.optim, steps))
            metrics.synchronize(device)
            step_times.append(time.perf_counter() - start)
            if result.skipped:
                skipped += 1
            elif not math.isfinite(result.loss):
                raise TrainingDiverged(
                    f"the loss became {result.loss} at step {step + 1} under precision={cfg.precision.name}; "
                    f"lower optim.lr or use precision=fp32"
                )
            losses.append(result.loss)
            progress.update(step + 1, result.loss, step_times[-1], result.skipped)
    return {"losses": losses, "step_times": step_times, "skipped": skipped}


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
