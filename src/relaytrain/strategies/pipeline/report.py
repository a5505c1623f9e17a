"""A pipeline run's measured figures: each stage reports its own (`PipelineStrategy.report`,
from the running stage) and `combine_reports` sets them beside what the bubble formula and the
schedule's replay predict, for results.json's `strategy_report`."""

from __future__ import annotations

import torch

from relaytrain.dryrun import memory
from relaytrain.strategies.pipeline.config import segment_batches
from relaytrain.strategies.pipeline.validate import replay
from relaytrain.utils.units import gib


def device_peak(device: torch.device) -> int | None:
    """This stage's peak device memory: a dry run's simulated one, the CUDA allocator's, or None
    on the CPU (there the stage's memory is its process's host RSS, in memory.per_process)."""
    tracker = memory.active()
    if tracker is not None:
        return tracker.peak
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def combine_reports(strategy, cfg, reports: list[dict]) -> dict:
    """Per-stage figures and the bubble (idle share of step time, measured over the steps
    after warm-up), next to what the bubble formula and the schedule's replay predict."""
    s, v, schedule = cfg.strategy, strategy.chunks(cfg), strategy.schedule
    stage_figures = [r["stage_figures"] for r in reports]
    measured = sum(st["bubble_fraction"] for st in stage_figures) / len(stage_figures)
    formula = schedule.bubble(s.stages, s.num_microbatches, v)
    segment = min(cfg.train.steps, segment_batches())  # what a stage's program runs between flushes
    replayed = replay(schedule.build(s.stages, s.num_microbatches, segment, chunks=v)).bubble_fraction()
    layout = strategy.state_layout(cfg)["stages"]
    return {
        "stages": s.stages,
        "replicas": s.replicas,
        "layout": layout,
        "execution": str(s.execution),
        "offload": str(s.offload),
        "per_stage": stage_figures,
        "bubble_fraction_measured": measured,
        "bubble_fraction_formula": formula,
        "bubble_fraction_schedule": replayed,
        "bubble_note": f"formula: {schedule.bubble_words(s.stages, s.num_microbatches, v)}; "
                       "schedule: replay of the whole run's programs with backward = 2 x forward",
        "summary": {
            "pipeline": (f"{s.stages} stages x {s.replicas} replicas" + (f", {v} chunks each" if v > 1 else "")
                         + f", blocks {layout}"),
            "execution, offload": f"{s.execution}, {s.offload}",
            "bubble measured / formula": f"{measured:.3f} / {formula:.3f}",
            "stage samples/s": ", ".join(f"{st['samples_per_s']:.1f}" for st in stage_figures),
            **_stage_rows(stage_figures),
        },
    }


def _stage_rows(stages: list[dict]) -> dict[str, str]:
    """Summary rows with one figure per stage: waiting, updates, memory, the executor's own."""
    def each(figure) -> str:
        return ", ".join(figure(st) for st in stages)

    def per_step(key: str):
        return lambda st: f"{st[key] / st['steps']:.3f}" if st["steps"] else "n/a"

    rows = {"stage message wait (s/step)": each(per_step("message_wait_s")),
            "stage exposed update (s/step)": each(per_step("exposed_update_s"))}
    if all(st["device_peak_bytes"] is not None for st in stages):
        rows["stage device peak"] = each(lambda st: gib(st["device_peak_bytes"]))
    if any(st["host_offload_bytes"] for st in stages):
        rows["stage host offload: masters + optimizer"] = each(lambda st: gib(sum(st["host_offload_bytes"].values())))
    if "units" in stages[0]:
        rows["stage units run out of static order"] = each(lambda st: f"{st['out_of_order']}/{st['units']}")
    for st in stages:
        if "injected_delay" in st:
            delay = st["injected_delay"]
            rows["injected delay (benchmarking aid)"] = (
                f"stage {delay['stage']}: U[0, {delay['max_fraction']:.0%}) of each compute, seed {delay['seed']}, "
                f"{delay['added_s']:.2f} s added")
    return rows
