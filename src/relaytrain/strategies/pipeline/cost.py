"""The closed-form cost of a pipeline (PipeDream-2BW's planner model, §4.2.1), and its
measured bubble beside the predicted one.

`PipelineStrategy` answers the planner by delegating here (`step_cost`, `device_bytes`, ...)
with itself as `strategy`: the schedule class it names composes a minibatch from the stage
times and says how many micro-batches each stage keeps in flight and how many weight versions
it holds, so one set of formulas serves every schedule. `combine_reports` sets the stages'
measured figures (each process's `report`: `stage_report`) beside the bubble formula and the
schedule's replay. Every other figure is a prediction; the shared formulas are
`relaytrain.cost.formulas`'s.
"""

from __future__ import annotations

import torch

from relaytrain import memory
from relaytrain.config import Recompute
from relaytrain.cost.formulas import (
    FP32,
    ModelFacts,
    Shape,
    StepCost,
    allreduce_s,
    both,
    optimizer_s,
    p2p_s,
    powers_of_two_dividing,
    stage_bytes,
)
from relaytrain.cost.profile import Profile, Timings
from relaytrain.optim import state_words
from relaytrain.strategies.base import Strategy, cpu_activation_bytes
from relaytrain.strategies.pipeline.config import Offload
from relaytrain.strategies.pipeline.validate import replay
from relaytrain.strategies.whole_model_cost import WORKER_OVERHEAD_BYTES
from relaytrain.units import gib

# `strategy` below is a `PipelineStrategy` subclass: it names the schedule, the chunks per stage
# and the blocks of each stage (runtime.py imports this module, so the type is not imported here).

def shapes(strategy: type[Strategy], workers: int, batch: int, num_layers: int) -> list[Shape]:
    """Every worker in the pipeline: w x d = workers with 2 <= d <= the model's blocks and w
    dividing the batch; each micro-batch size b of a replica's share with m = batch / (w b) as
    the schedule allows; no recompute, block or stage recompute."""
    return [Shape(strategy.name, b, batch // (workers // d * b), workers // d, d, str(recompute),
                  strategy.shape_options(chunks=v) if v > 1 else ())
            for d in range(2, min(workers, num_layers) + 1) if workers % d == 0 and batch % (workers // d) == 0
            for b in powers_of_two_dividing(batch // (workers // d))
            for v in strategy.chunk_choices(d, num_layers)
            if strategy.schedule.refusal(d, batch // (workers // d * b), v) is None
            for recompute in Recompute]


def step_cost(strategy: type[Strategy], cfg, facts: ModelFacts, profile: Profile) -> StepCost:
    """PipeDream-2BW's THROUGHPUT(.) (§4.2.1) for one minibatch of m micro-batches on d stages
    x w replicas: stage i costs t_i = max(T_i^comp, T_i^comm) per micro-batch, compute (with
    recompute) and the activations and gradients exchanged with its neighbours overlapping;
    the schedule composes the minibatch from the t_i (filled and drained once, or kept full).
    Then the all-reduce of each stage's gradients across the replicas (hidden under the next
    minibatch where the schedule lets it) and the stage's optimizer step."""
    s, v, schedule = cfg.strategy, strategy.chunks(cfg), strategy.schedule
    m, d, b = s.num_microbatches, s.stages, s.microbatch_size
    t = profile.for_workers(strategy.processes(cfg), cfg.train.threads)
    compute = stage_times(strategy, cfg, facts, t)
    exchange = v * p2p_s(facts.boundary_bytes(b), strategy.processes(cfg), profile)  # one message per chunk
    slots = [max(work, exchange) for work in compute]
    pipeline = schedule.minibatch_time(slots, m, v)
    each = stages(strategy, cfg)
    sums = max(allreduce_s(facts.stage_params(*stage) * facts.trained_share * FP32, s.replicas, profile) for stage in each)
    hidden = schedule.hides_gradient_sums and profile.device_type != "cpu"  # a CPU sums on the cores that compute
    exposed_sums = max(0.0, sums - pipeline) if hidden else sums
    optimizer = max(optimizer_s(t, facts, *stage) for stage in each)
    parts = {"compute": m * max(compute), "bubble": pipeline - m * max(slots),
             "activations exchange": 2 * m * exchange, "gradient sums (exposed)": exposed_sums,
             "optimizer": optimizer}
    return StepCost(pipeline + exposed_sums + optimizer, parts, [f"bubble {schedule.bubble_words(d, m, v)}"])


def device_bytes(strategy: type[Strategy], cfg, facts: ModelFacts) -> int:
    """The fullest stage's MEMORY(.): its weight versions, gradients and optimizer state, and
    the activations of the micro-batches its schedule keeps in flight there."""
    s, v, schedule = cfg.strategy, strategy.chunks(cfg), strategy.schedule
    # A unit in flight holds one chunk's activations: 1/v of the stage's blocks.
    return max(stage_bytes(facts, s.microbatch_size, blocks, facts.stage_params(blocks, first, last), last,
                           schedule.in_flight(s.stages, s.num_microbatches, i, v) / v,
                           schedule.weight_versions, str(s.recompute))
               for i, (blocks, first, last) in enumerate(stages(strategy, cfg)))


def host_state_bytes(strategy: type[Strategy], cfg, facts: ModelFacts) -> int:
    """With `strategy.offload=host`, the fullest stage's fp32 masters, optimizer state and the
    gradients downloaded for the eager param server (AxoNN); otherwise none: every weight,
    gradient and optimizer state lives where the stage computes."""
    if cfg.strategy.offload != Offload.host:
        return 0
    largest = max(facts.stage_params(*stage) for stage in stages(strategy, cfg)) * facts.trained_share
    return int(largest * FP32 * (2 + facts.state_words))


def host_bytes(strategy: type[Strategy], cfg, num_params: int, device_type: str) -> int:
    """Host memory of the whole run, an estimate: each replica's weight versions, gradients,
    optimizer state (and host masters with offload) and the activations of the first stage, which
    keeps the most in flight; every worker builds the whole model once before keeping its stage."""
    s = cfg.strategy
    versions, v = strategy.schedule.weight_versions, strategy.chunks(cfg)
    # The first stage holds the most; a unit in flight holds a chunk's blocks.
    in_flight = -(-strategy.schedule.in_flight(s.stages, s.num_microbatches, 0, v) // v)
    masters = 1 if s.offload == Offload.host else 0  # host copies of the weights, apart from the working ones
    per_replica = num_params * FP32 * (versions + 1 + state_words(cfg.optim) + masters)
    if s.recompute == Recompute.none:
        per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=cfg.model.num_layers * in_flight)
    else:
        per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=s.stages,
                                            stash_entries=cfg.model.num_layers * in_flight)
    # Each worker builds the whole model once before keeping its stage.
    workers = strategy.processes(cfg) * (WORKER_OVERHEAD_BYTES + num_params * FP32)
    return int(workers + s.replicas * per_replica)


def stages(strategy: type[Strategy], cfg) -> list[tuple[int, bool, bool]]:
    """(blocks, holds the embeddings, holds the head) of each stage."""
    d = cfg.strategy.stages
    return [(sum(len(r) for r in strategy.stage_blocks(cfg, i)), i == 0, i == d - 1) for i in range(d)]


def stage_times(strategy: type[Strategy], cfg, facts: ModelFacts, t: Timings) -> list[float]:
    """T_i^comp: each stage's forward + backward (+ recompute) seconds for one micro-batch."""
    b, recompute = cfg.strategy.microbatch_size, cfg.strategy.recompute
    block, embed, head = (facts.part_times(t, part, b) for part in ("block", "embed", "head"))
    times = []
    for blocks, first, last in stages(strategy, cfg):
        work = blocks * both(block) + (both(embed) if first else 0.0) + (both(head) if last else 0.0)
        if recompute == Recompute.block:
            work += blocks * block.forward_s
        elif recompute == Recompute.stage:
            work += blocks * block.forward_s + (embed.forward_s if first else 0.0) + (head.forward_s if last else 0.0)
        times.append(work)
    return times


# --------------------------------------------------------------------------- measured beside predicted


def stage_report(stage: Strategy) -> dict:
    """One stage's measured figures, for `combine_reports` (`stage` is the running
    `PipelineStrategy`): throughput and bubble over its steps, waits, memory, the executor's own."""
    phases = dict(stage.timer.totals)
    busy = phases.get("forward", 0.0) + phases.get("backward", 0.0)
    wall = phases.get("step", 0.0)
    steps = stage.timer.counts.get("step", 0)
    s = stage.cfg.strategy
    samples = s.microbatch_size * s.num_microbatches
    figures = {
        "rank": stage.world.rank,
        "stage": stage.stage,
        "replica": stage.replica,
        "blocks": len(stage.versions.buffers[0].model.blocks),
        "parameters": sum(p.numel() for p in stage.versions.params[0]),
        "samples_per_s": samples * steps / wall if wall > 0 else 0.0,
        "bubble_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
        "phases_s": phases,
        "drain_s": stage.drain_s,
        "steps": steps,
        "message_wait_s": phases.get("message_wait", 0.0),  # blocked on an activation or gradient
        "exposed_update_s": phases.get("optimizer", 0.0) + phases.get("update_wait", 0.0),
        "device_peak_bytes": _device_peak(stage.device),
        "host_offload_bytes": stage.versions.host_bytes(),
        **stage.executor.report(),  # message-driven: units run, and how many out of the static order
    }
    if s.offload == Offload.host:
        figures["eps"] = stage.versions.report()
    if stage.jitter is not None:
        figures["injected_delay"] = stage.jitter.report()
    return figures


def _device_peak(device: torch.device) -> int | None:
    """This stage's peak device memory: a dry run's simulated one, the CUDA allocator's, or None
    on the CPU (there the stage's memory is its process's host RSS, in memory.per_process)."""
    tracker = memory.active()
    if tracker is not None:
        return tracker.peak
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def combine_reports(strategy: type[Strategy], cfg, reports: list[dict]) -> dict:
    """Per-stage figures and the bubble (idle share of step time, measured over the steps
    after warm-up), next to what the bubble formula and the schedule's replay predict."""
    s, v, schedule = cfg.strategy, strategy.chunks(cfg), strategy.schedule
    stage_figures = [r["stage_figures"] for r in reports]
    measured = sum(st["bubble_fraction"] for st in stage_figures) / len(stage_figures)
    formula = schedule.bubble(s.stages, s.num_microbatches, v)
    replayed = replay(schedule.build(s.stages, s.num_microbatches, cfg.train.steps, chunks=v)).bubble_fraction()
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
