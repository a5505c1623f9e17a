"""AxoNN benchmarks (not a test): message-driven against static execution, offload against none,
and the simulated device memory of BERT-Large per stage with and without offload.

1. `message`: message-driven against static execution, one stage slowed by a seeded random
   jitter of U[0, 30 %) of each forward and backward (RELAYTRAIN_STAGE_JITTER, a benchmarking
   aid), then the same without jitter; GPT-2, 6 blocks, one worker thread per stage. Two
   pipelines: `gpipe` (2 stages, 8 micro-batches, stage 0 slowed: GPipe's stash bound is m, so
   a stage whose next activation is late can run backwards meanwhile) and `flush` (1F1B,
   3 stages, 6 micro-batches, the middle stage slowed: the stash bound leaves a stage almost
   no other unit to run). Targets: message-driven / static >= 1.05 under jitter, >= 0.99
   without. Beside each, a timing model of the same schedules (forward 1, backward 2 time
   units, the same jitter, free communication) run with the executor's own plan, rules and
   preference: what reordering can gain on an idle machine; and where each stage's step goes
   (`where_s_per_step`: compute, message waits, the update, the rest), which locates any tax.
2. `offload`: 2 stages of GPT-2 with AdamW, `strategy.offload=host` against `none`, pipe_2bw
   and pipe_flush: the exposed update time per step (time a stage's main thread spends on
   the update: the step itself, or starting it and waiting for it to land), as a share of the
   step. Target <= 10 %.
3. `memory`: dry runs on the meta device (no memory, no GPU): BERT-Large, 4 and 8 stages,
   pipe_flush and pipe_2bw, AdamW, micro-batch 8 x 128 tokens, per-stage simulated device
   memory by kind with offload none and host.

    .venv/bin/python scripts/bench_axonn.py [--only message,offload,memory] [--rounds 5] [--json bench_axonn.json]

Throughput is the mean step time after warm-up steps (results.json); contestants alternate
over `--rounds` rounds, and each comparison's headline is the median of the rounds' own
ratios (`benchlib.headline`, as in the other benchmarks), with the best round and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import headline
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies.pipeline.executor import preferred
from relaytrain.strategies.pipeline.jitter import ENV
from relaytrain.strategies.pipeline.schedule import COMPUTE, Op, SlicePlan, build_schedule, stop_points
from relaytrain.strategies.pipeline.validate import StageInvariants

GPT2 = ["model=gpt2_tiny", "model.num_layers=6", "model.hidden_size=256", "model.num_heads=4",
        "model.intermediate_size=1024", "model.vocab_size=512", "model.dropout=0.0", "data.seq_len=64",
        "data.num_samples=2048", "train.threads=1", "train.log_every=1000", "optim=sgd", "optim.lr=0.01",
        "strategy.microbatch_size=4"]
# name: (strategy, stages, micro-batches, the jittered stage); a schedule is named by its strategy
PIPELINES = {"gpipe": ("pipe_gpipe", 2, 8, 0), "flush": ("pipe_flush", 3, 6, 1)}
JITTER_MAX = 0.3
OFFLOADED = ("pipe_2bw", "pipe_flush")  # the strategies the offload benchmark runs


def step_time(overrides: list[str], steps: int, warmup: int, jitter: str | None = None) -> tuple[float, dict]:
    """Mean measured step time of one run, and its strategy report."""
    cfg = compose_config([*overrides, f"train.steps={steps}", f"train.untimed_steps={warmup}"])
    os.environ.pop(ENV, None)
    if jitter:
        os.environ[ENV] = jitter  # the spawned workers inherit it
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            results = run(cfg, run_dir, quiet=True)
    finally:
        os.environ.pop(ENV, None)
    return results["throughput"]["step_time_s"], results["strategy_report"]


def rounds_of(contestants: dict, rounds: int) -> list[dict]:
    """Each contestant once per round, alternating: on a shared machine other load only ever slows one down."""
    return [{name: bench() for name, bench in contestants.items()} for _ in range(rounds)]


# ----------------------------------------------------------------- 1. message-driven execution


def bench_message(args) -> dict:
    return {name: _message_pipeline(args, *pipeline) for name, pipeline in PIPELINES.items()}


def _message_pipeline(args, strategy: str, stages: int, m: int, stage: int) -> dict:
    pipe = [*GPT2, f"strategy={strategy}", f"strategy.stages={stages}", f"strategy.num_microbatches={m}"]
    jitter = f"stage={stage},max={JITTER_MAX},seed=0"
    out = {"config": pipe, "jitter": f"{ENV}={jitter}"}
    for label, setting in (("with_jitter", jitter), ("without_jitter", None)):
        contestants = {
            execution: (lambda e=execution, j=setting: step_time([*pipe, f"strategy.execution={e}"], args.steps,
                                                                 args.warmup, j))
            for execution in ("static", "message_driven")
        }
        results = rounds_of(contestants, args.rounds)
        out[label] = {
            "step_s": {name: [r[name][0] for r in results] for name in contestants},
            "headline": headline([r["static"][0] / r["message_driven"][0] for r in results], 1.05 if setting else 0.99),
            "out_of_order_units": [[st["out_of_order"] for st in r["message_driven"][1]["per_stage"]] for r in results],
            "units_per_stage": results[0]["message_driven"][1]["per_stage"][0]["units"],
            "message_wait_s_per_step": {
                name: [st["message_wait_s"] / max(st["steps"], 1) for st in results[-1][name][1]["per_stage"]]
                for name in contestants},
            # Where each stage's step goes, over every round (see _where): locates any tax.
            "where_s_per_step": {name: _where([r[name][1] for r in results]) for name in contestants},
            "timing_model": timing_model(strategy, stages, m, {stage: JITTER_MAX if setting else 0.0}),
        }
    return out


def _where(reports: list[dict]) -> list[dict]:
    """Per stage, seconds a step: computing (forward + backward), waiting for messages, the
    update (its own waits included) and the rest (the executor's own work, posting and sends)."""
    kinds = {"compute": ("forward", "backward"), "message_wait": ("message_wait",),
             "update": ("optimizer", "reduction_wait", "update_wait")}
    out = []
    for stage in range(len(reports[0]["per_stage"])):
        phases = [r["per_stage"][stage]["phases_s"] for r in reports]
        steps = sum(r["per_stage"][stage]["steps"] for r in reports)
        figures = {"step": sum(p.get("step", 0.0) for p in phases) / steps}
        for kind, names in kinds.items():
            figures[kind] = sum(p.get(name, 0.0) for p in phases for name in names) / steps
        figures["rest"] = figures["step"] - sum(figures[kind] for kind in kinds)
        out.append(figures)
    return out


def timing_model(kind: str, d: int, m: int, jitter: dict[int, float], batches: int = 8, seeds: int = 20) -> dict:
    """Static against message-driven makespan in a discrete-event model: forward 1, backward 2
    time units, stage s's times scaled by 1 + U[0, jitter[s]) per micro-batch (the aid's kind of
    draws), communication free. Message-driven: the executor's own plan, rules and preference
    (the program's order when both units could run)."""
    ratios = []
    for seed in range(seeds):
        times = {e: _makespan(kind, d, m, batches, jitter, seed, e) for e in ("static", "message_driven")}
        ratios.append(times["static"] / times["message_driven"])
    return {"kind": kind, "stages": d, "microbatches": m, "jitter": {str(s): j for s, j in jitter.items()},
            "ratio_mean": statistics.mean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def _makespan(kind, d, m, batches, jitter, seed, execution) -> float:
    schedule = build_schedule(kind, d, m, batches)
    slices = []
    for s in range(d):
        program = schedule.actions(s)
        bounds = [0, *sorted(stop_points(program, m)), len(program)]
        slices.append([program[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    rules = [StageInvariants(schedule, s) for s in range(d)]
    plans = [SlicePlan.of(slices[s][0]) for s in range(d)]
    position, clock, arrival = [0] * d, [0.0] * d, {}

    def duration(s: int, a) -> float:
        base = 1.0 if a.op is Op.FORWARD else 2.0
        if not jitter.get(s):
            return base
        return base * (1 + random.Random(f"{seed}:{s}:{a.microbatch}:{a.op.value}").uniform(0, jitter[s]))

    while True:
        options = []  # (start time, stage, unit): the earliest next event of any stage
        for s in range(d):
            while plans[s].finished() and position[s] < len(slices[s]):
                for a in plans[s].leftover():
                    rules[s].record(a)
                position[s] += 1
                if position[s] < len(slices[s]):
                    plans[s] = SlicePlan.of(slices[s][position[s]])
            if position[s] == len(slices[s]):
                continue
            plan = plans[s]
            units = [u for u in plan.candidates() if rules[s].allows(plan.entails(u))]
            if execution == "static":
                units = [u for u in units if u == plan.static_next()]
            starts = {}
            for u in units:
                r = plan.receive(u)
                here = 0.0 if r is None else arrival.get((r.op, r.microbatch, s))
                if here is not None:
                    starts[u] = max(clock[s], here)
            if starts:
                first = min(starts.values())
                unit = preferred(plan, [u for u in units if starts.get(u) == first], rules[s])
                options.append((first, s, unit))
        if not options:
            return max(clock)
        start, s, unit = min(options, key=lambda o: o[0])
        for a in plans[s].take(unit):
            rules[s].record(a)
            if a.op in COMPUTE:
                start += duration(s, a)
            elif a.op is Op.SEND_ACT:
                arrival[(Op.RECV_ACT, a.microbatch, s + 1)] = start
            elif a.op is Op.SEND_GRAD:
                arrival[(Op.RECV_GRAD, a.microbatch, s - 1)] = start
        clock[s] = start


# ----------------------------------------------------------------- 2. offload


def bench_offload(args) -> dict:
    model = ["model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=512", "model.num_heads=8",
             "model.intermediate_size=2048", "model.vocab_size=8192", "model.dropout=0.0", "data.seq_len=32",
             "data.num_samples=2048", "train.threads=1", "train.log_every=1000", "optim=adamw", "optim.lr=1e-4",
             "strategy.stages=2", "strategy.num_microbatches=4", "strategy.microbatch_size=4"]
    out = {"config": model}
    for strategy in OFFLOADED:
        contestants = {
            offload: (lambda o=offload, st=strategy: step_time([*model, f"strategy={st}", f"strategy.offload={o}"],
                                                                args.steps, args.warmup))
            for offload in ("none", "host")
        }
        results = rounds_of(contestants, args.rounds)
        figures = {name: [_exposed(*r[name]) for r in results] for name in contestants}
        figures["throughput_ratio_host_over_none"] = [r["none"][0] / r["host"][0] for r in results]
        # The worst stage's share in each round.
        figures["headline"] = headline([max(f["exposed_share_of_step"]) for f in figures["host"]], 0.10,
                                       lower_is_better=True)
        out[strategy] = figures
    return out


def _exposed(step_s: float, report: dict) -> dict:
    exposed = [st["exposed_update_s"] / max(st["steps"], 1) for st in report["per_stage"]]
    return {"step_s": step_s, "exposed_update_s_per_step": exposed, "exposed_share_of_step": [e / step_s for e in exposed],
            "host_offload_bytes": [st["host_offload_bytes"] for st in report["per_stage"]]}


# ----------------------------------------------------------------- 3. simulated device memory


def bench_memory(args) -> dict:
    out = {"command": "dry runs on the meta device: relaytrain.dryrun.memory.simulate(cfg), 2 steps"}
    for strategy in ("pipe_flush", "pipe_2bw"):
        for stages in (4, 8):
            for offload in ("none", "host"):
                cfg = compose_config(["model=bert_large", "optim=adamw", "data.seq_len=128", f"strategy={strategy}",
                                      f"strategy.stages={stages}", "strategy.microbatch_size=8",
                                      "strategy.num_microbatches=8", f"strategy.offload={offload}"])
                per_stage = simulate(cfg).per_process
                out[f"{strategy}/{stages}/{offload}"] = [
                    {"stage": p.rank, "peak_bytes": p.peak_bytes, "by_kind": p.by_kind} for p in per_stage]
    return out


# ----------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="message,offload,memory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; each headline is their median ratio")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    benches = {"message": bench_message, "offload": bench_offload, "memory": bench_memory}
    figures = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    for name in args.only.split(","):
        start = time.perf_counter()
        figures[name] = benches[name](args)
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
    figures["headlines"] = headlines(figures)
    print_headlines(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def headlines(figures: dict) -> dict:
    """The comparisons `scripts/bench.py` tabulates, each the median of its rounds."""
    out = {}
    for name, f in figures.get("message", {}).items():
        out[f"md_vs_static_{name}_jitter"] = f["with_jitter"]["headline"]
        out[f"md_vs_static_{name}_even"] = f["without_jitter"]["headline"]
    if "offload" in figures:
        for strategy in OFFLOADED:
            out[f"offload_exposed_{strategy}"] = figures["offload"][strategy]["headline"]
    return out


def print_headlines(figures: dict) -> None:
    if "message" in figures:
        for name, f in figures["message"].items():
            for label in ("with_jitter", "without_jitter"):
                r, h, model = f[label], f[label]["headline"], f[label]["timing_model"]
                steps = {e: statistics.median(t) for e, t in r["step_s"].items()}
                print(f"{name}: message-driven / static, {label.replace('_', ' ')}: median {h['median']:.3f} "
                      f"(rounds {', '.join(f'{x:.3f}' for x in h['rounds'])}; median step {steps['static']:.3f} s vs "
                      f"{steps['message_driven']:.3f} s; target >= {h['target']}; timing model {model['ratio_mean']:.3f})")
    if "offload" in figures:
        for strategy in OFFLOADED:
            r, h = figures["offload"][strategy], figures["offload"][strategy]["headline"]
            print(f"{strategy} offload=host: exposed update / step, worst stage: median {h['median']:.1%} "
                  f"(rounds {', '.join(f'{x:.1%}' for x in h['rounds'])}; target <= 10 %); throughput host / none "
                  f"median {statistics.median(r['throughput_ratio_host_over_none']):.3f}")
    if "memory" in figures:
        for key, stages in figures["memory"].items():
            if key != "command":
                peaks = ", ".join(f"{s['peak_bytes'] / 2**30:.2f}" for s in stages)
                print(f"BERT-Large {key}: simulated device peak per stage (GiB) {peaks}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
