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

from relaytrain import metrics
from relaytrain.files import write_json
from relaytrain.models import adapter as adapters
from relaytrain.models import count_parameters, frozen_experts, trained_parameters
from relaytrain.preflight import estimate_host_bytes


def process_report(strategy, world, host: metrics.HostMemory, device_memory: dict) -> dict:
    """What one process contributes: its strategy's figures and its memory peaks (a dry run's
    device figures are simulated; its host memory is not what a real run would use)."""
    return {
        "rank": world.rank,
        "strategy": strategy.report(),
        "host_peak_rss_bytes": None if world.simulated else host.peak_bytes(),
        "device_memory": device_memory,
    }


def assemble_results(cfg, spec, history: dict, measured: list[float], reports: list[dict], world, overrides) -> dict:
    """results.json of a run that `spec` (run_spec.RunSpec) describes."""
    s, d, m, cls = cfg.strategy, cfg.data, cfg.model, spec.strategy
    samples = spec.minibatch_samples
    params = count_parameters(m)
    measured = measured or history["step_times"]
    flops_per_token = metrics.model_flops_per_token(m, d.seq_len)
    return {
        "strategy": s.name,
        "model": {
            "name": m.name,
            "family": str(m.family),
            "task": str(m.task),
            "parameters": params,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "pretrained": m.pretrained,  # the checkpoint the run started from, None: fresh weights
        },
        "adapter": adapter_facts(cfg),
        "device": str(world.device),
        "precision": str(cfg.precision.name),
        "processes": spec.processes,
        "replicas": spec.replicas,
        "steps": len(history["losses"]),
        "measured_steps": len(measured),
        "microbatch_size": s.microbatch_size,
        "num_microbatches": s.num_microbatches,
        "samples_per_step": samples,
        "tokens_per_step": samples * d.seq_len,
        "loss": history["losses"],
        # The loss's terms beside the objective's, each step (a mixture's `router_aux`; strategies.Strategy.loss_terms).
        **({"loss_terms": history["loss_terms"]} if history.get("loss_terms") else {}),
        "eval": history.get("eval", []),
        "skipped_steps": history["skipped"],
        "step_times_s": history["step_times"],
        "throughput": metrics.throughput([] if world.simulated else measured, samples, samples * d.seq_len,
                                         flops_per_token),
        "memory": memory(cls, cfg, reports),
        "strategy_report": cls.combine_reports(cfg, [r["strategy"] for r in reports]),
        "threads": metrics.cpu_threads(),
        "overrides": list(overrides),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def adapter_facts(cfg) -> dict | None:
    """What trained under adapters (adapter=lora): its keys, the parameters that train, the base's
    quantization (adapter=qlora), whether the saved adapter was merged into its base, and on a
    mixture which experts it adapts; None for a full fine-tune."""
    a, m = cfg.adapter, cfg.model
    if not adapters.enabled(a):
        return None
    quantized = str(m.quantize) != "none"
    return {"name": str(a.name), "r": a.r, "alpha": a.alpha, "pretrained": a.pretrained,
            "trained_parameters": trained_parameters(m, a),
            "quantize": (str(m.quantize) + ("-double" if m.quantize_double else "")) if quantized else None,
            "merged": bool(cfg.train.save_model and a.merge_on_save), **experts_facts(m, a)}


def experts_facts(m, a) -> dict:
    """On a mixture: its fused experts, those the adapter leaves frozen, and the key that adapts them all."""
    experts, frozen = frozen_experts(m, a)
    if not experts:
        return {}
    return {"experts": {"names": experts, "frozen": frozen,
                        "adapted_by": f"adapter.target_parameters=[{','.join(experts)}]"}}


def memory(cls, cfg, reports: list[dict]) -> dict:
    """The run's peaks: device memory of the fullest device, host RSS of the largest process
    (and their sum), and every process's own figures when there are several. A dry run's host
    memory is the strategy's estimate, not a measurement."""
    device = max((r["device_memory"] for r in reports),
                 key=lambda dm: dm["peak_allocated_bytes"] or 0)
    out = {"device": device}
    if device.get("simulated"):
        out.update(host_peak_rss_bytes=None, host_estimate_bytes=estimate_host_bytes(cfg, cls, torch.device("meta")),
                   host_note="a dry run: host memory estimated from the config, not measured")
    else:
        out.update(host_peak_rss_bytes=max(r["host_peak_rss_bytes"] for r in reports),
                   host_peak_rss_total_bytes=sum(r["host_peak_rss_bytes"] for r in reports))
    if len(reports) > 1:
        out["per_process"] = [
            {"rank": r["rank"], "process": cls.describe_process(cfg, r["rank"]),
             "host_peak_rss_bytes": r["host_peak_rss_bytes"], "device": r["device_memory"],
             "device_peak_allocated_bytes": r["device_memory"]["peak_allocated_bytes"]}
            for r in reports
        ]
    return out


def write_results(run_dir: Path, results: dict) -> Path:
    return write_json(Path(run_dir) / "results.json", results, indent=2)
