"""results.json, assembled in one place for every strategy from every process's report.

Each process reports its strategy's figures (`Strategy.report`) and its own memory; the
reporting process gathers them, the strategy's class folds the strategy figures into
`strategy_report` (`Strategy.summarize`), and this module adds what every run has: the model,
the batch shape, the loss history, throughput over the measured steps, and memory.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from relaytrain.models import Trains
from relaytrain.models import adapter as adapters
from relaytrain.step import metrics
from relaytrain.utils.files import write_json


def process_report(strategy, world, host: metrics.HostMemory, device_memory: dict, built: Trains | None = None) -> dict:
    """What one process contributes: its strategy's figures and its memory peaks (a dry run's
    device figures are simulated; its host memory is not what a real run would use), and what
    trains in the model it built under an adapter (`Trains.of`)."""
    return {
        "rank": world.rank,
        "strategy": strategy.report(),
        "host_peak_rss_bytes": None if world.simulated else host.peak_bytes(),
        "device_memory": device_memory,
        "adapter_built": built,
    }


def assemble_results(cfg, spec, history: dict, measured: list[float], reports: list[dict], world, overrides,
                     host_estimate_bytes: int | None = None) -> dict:
    """results.json of a run that `spec` (`resolve.RunSpec`) describes; `host_estimate_bytes`:
    the pre-launch check's estimate (`preflight.check_can_start`), which a dry run reports."""
    s, d, m = cfg.strategy, cfg.data, cfg.model
    samples = spec.minibatch_samples  # items: a preference pair is one, its two rows count as tokens
    tokens = metrics.tokens_per_step(samples, spec.objective.rows_per_item, d.seq_len)
    measured = measured or history["step_times"]
    # What the config says, and what the cost model and the model builder made of it (`spec`);
    # then what the strategy makes of every process's report.
    peaks = memory(spec, reports, host_estimate_bytes)
    adapter = adapter_facts(cfg, spec, reports[0].get("adapter_built"))
    strategy_report = spec.strategy.combine_reports(cfg, [r["strategy"] for r in reports])
    return {
        "strategy": s.name,
        "model": {
            "name": m.name,
            "family": str(m.family),
            "task": str(m.task),
            "parameters": spec.parameters,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "pretrained": m.pretrained,  # the checkpoint the run started from, None: fresh weights
        },
        "adapter": adapter,
        "device": str(world.device),
        "precision": str(cfg.precision.name),
        "processes": spec.processes,
        "replicas": spec.replicas,
        "steps": len(history["losses"]),
        "measured_steps": len(measured),
        "microbatch_size": s.microbatch_size,
        "num_microbatches": s.num_microbatches,
        "samples_per_step": samples,
        "tokens_per_step": tokens,
        "loss": history["losses"],
        # The loss's terms beside the objective's, each step (a mixture's `router_aux`; strategies.Strategy.loss_terms).
        **({"loss_terms": history["loss_terms"]} if history.get("loss_terms") else {}),
        "eval": history.get("eval", []),
        "skipped_steps": history["skipped"],
        "step_times_s": history["step_times"],
        "throughput": metrics.throughput([] if world.simulated else measured, samples, tokens, spec.flops_per_token),
        "memory": peaks,
        "strategy_report": strategy_report,
        "threads": metrics.cpu_threads(),
        "overrides": list(overrides),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def adapter_facts(cfg, spec, built: Trains | None = None) -> dict | None:
    """What trained under adapters (adapter=lora): its keys, the parameters that train, the base's
    quantization (adapter=qlora), whether the saved adapter was merged into its base, and on a
    mixture which experts it adapts: as the run built them (`built`, `Trains.of`: peft may adapt
    experts the keys do not name), else as the model builder counted them before the run (`spec`,
    the run's `resolve.RunSpec`); None for a full fine-tune."""
    a, m = cfg.adapter, cfg.model
    if not adapters.enabled(a):
        return None
    quantized = str(m.quantize) != "none"
    trains = Trains(*built) if built else spec.trains
    return {"name": str(a.name), "r": a.r, "alpha": a.alpha, "pretrained": a.pretrained,
            "trained_parameters": trains.parameters,
            "quantize": (str(m.quantize) + ("-double" if m.quantize_double else "")) if quantized else None,
            "merged": bool(cfg.train.save_model and a.merge_on_save), **experts_facts(trains.experts, trains.frozen)}


def experts_facts(experts: tuple[str, ...], frozen: tuple[str, ...]) -> dict:
    """On a mixture: its fused `experts`, those the adapter leaves `frozen`, and the key that adapts them all."""
    if not experts:
        return {}
    return {"experts": {"names": list(experts), "frozen": list(frozen),
                        "adapted_by": f"adapter.target_parameters=[{','.join(experts)}]"}}


def memory(spec, reports: list[dict], host_estimate_bytes: int | None) -> dict:
    """The run's peaks: device memory of the fullest device, host RSS of the largest process
    (and their sum), and every process's own figures when there are several. A dry run's host
    memory is the strategy's estimate (`host_estimate_bytes`), not a measurement."""
    device = max((r["device_memory"] for r in reports),
                 key=lambda dm: dm["peak_allocated_bytes"] or 0)
    out = {"device": device}
    if device.get("simulated"):
        out.update(host_peak_rss_bytes=None,
                   host_estimate_bytes=host_estimate_bytes,
                   host_note="a dry run: host memory estimated from the config, not measured")
    else:
        out.update(host_peak_rss_bytes=max(r["host_peak_rss_bytes"] for r in reports),
                   host_peak_rss_total_bytes=sum(r["host_peak_rss_bytes"] for r in reports))
    if len(reports) > 1:
        out["per_process"] = [
            {"rank": r["rank"], "process": spec.process_names[r["rank"]],
             "host_peak_rss_bytes": r["host_peak_rss_bytes"], "device": r["device_memory"],
             "device_peak_allocated_bytes": r["device_memory"]["peak_allocated_bytes"]}
            for r in reports
        ]
    return out


def write_results(run_dir: Path, results: dict) -> Path:
    return write_json(Path(run_dir) / "results.json", results, indent=2)
