"""results.json for a pipeline run: the keys every strategy writes, from all workers' reports.

The run's step clock is the last stage of replica 0: a step ends there when the batch's
last backward ends, which is where its loss is known. Per-stage figures and the bubble
(idle share of wall time, measured over the steps after warm-up) go under
`strategy_report`, next to what the bubble formula and the schedule's dry run predict.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain import metrics
from relaytrain.models import count_parameters
from relaytrain.strategies.pipeline.schedule import build_schedule
from relaytrain.strategies.pipeline.stage import partition
from relaytrain.strategies.pipeline.validate import bubble_formula, simulate
from relaytrain.train import assemble_results


@dataclass
class _ModelFacts:
    """What `assemble_results` reads from a model, without building the whole model here."""

    family: str
    num_blocks: int
    params: int

    def num_parameters(self) -> int:
        return self.params


@dataclass
class _Figures:
    figures: dict
    peak_rss: int

    def report(self) -> dict:
        return self.figures

    def peak_bytes(self) -> int:
        return self.peak_rss


def pipeline_results(cfg, reports: list[dict], device, overrides: list[str]) -> dict:
    s = cfg.strategy
    reports = sorted(reports, key=lambda r: r["rank"])
    clock = reports[s.stages - 1]  # last stage, replica 0
    history = {"losses": clock["losses"], "step_times": clock["step_times"], "skipped": 0}
    model = _ModelFacts(cfg.model.family, cfg.model.num_layers, count_parameters(cfg.model))
    figures = _Figures(strategy_report(cfg, reports), max(r["host_peak_rss_bytes"] for r in reports))
    results = assemble_results(cfg, model, figures, device, history, figures, overrides)
    samples = s.microbatch_size * s.num_microbatches * s.replicas  # every replica takes its own rows
    measured = history["step_times"][cfg.train.warmup_steps:] or history["step_times"]
    flops = metrics.model_flops_per_token(model.params, model.num_blocks, cfg.model.hidden_size, cfg.data.seq_len)
    results.update(
        samples_per_step=samples,
        tokens_per_step=samples * cfg.data.seq_len,
        throughput=metrics.throughput(measured, samples, samples * cfg.data.seq_len, flops),
    )
    if device.type == "cuda":
        results["memory"]["device"] = max(
            (r["device_memory"] for r in reports), key=lambda d: d["peak_allocated_bytes"]
        )
    return results


def strategy_report(cfg, reports: list[dict]) -> dict:
    s = cfg.strategy
    stages = [_stage_figures(cfg, r) for r in reports]
    measured = sum(st["bubble_fraction"] for st in stages) / len(stages)
    formula = bubble_formula(s.stages, s.num_microbatches) if s.name == "pipe_flush" else 0.0
    simulated = simulate(build_schedule(s.name, s.stages, s.num_microbatches, cfg.train.steps)).bubble_fraction()
    layout = [len(r) for r in partition(cfg.model.num_layers, s.stages, s.layout)]
    return {
        "stages": s.stages,
        "replicas": s.replicas,
        "layout": layout,
        "per_stage": stages,
        "bubble_fraction_measured": measured,
        "bubble_fraction_formula": formula,
        "bubble_fraction_schedule": simulated,
        "bubble_note": "formula: (d-1)/(m+d-1) per flush; pipe_2bw has no flush (0 in steady state). "
                       "schedule: dry run of the whole run with backward = 2 x forward",
        "summary": {
            "pipeline": f"{s.stages} stages x {s.replicas} replicas, blocks {layout}",
            "bubble measured / formula": f"{measured:.3f} / {formula:.3f}",
            "stage samples/s": ", ".join(f"{st['samples_per_s']:.1f}" for st in stages),
            "peak RSS per worker": ", ".join(f"{st['host_peak_rss_bytes'] / 2**30:.2f}" for st in stages) + " GiB",
        },
    }


def _stage_figures(cfg, report: dict) -> dict:
    """Throughput and idle share of one worker over the measured steps."""
    s, warm = cfg.strategy, cfg.train.warmup_steps
    done, busy = report["done_at"], report["busy_at"]
    start = warm - 1 if 0 < warm < len(done) else -1
    t0, b0 = (done[start], busy[start]) if start >= 0 else (0.0, 0.0)
    wall = done[-1] - t0
    steps = len(done) - 1 - start
    return {
        "rank": report["rank"],
        "stage": report["stage"],
        "replica": report["replica"],
        "blocks": report["blocks"],
        "parameters": report["parameters"],
        "samples_per_s": s.microbatch_size * s.num_microbatches * steps / wall if wall > 0 else 0.0,
        "bubble_fraction": 1.0 - (busy[-1] - b0) / wall if wall > 0 else 0.0,
        "phases_s": report["phases_s"],
        "host_peak_rss_bytes": report["host_peak_rss_bytes"],
        "device_memory": report["device_memory"],
    }
