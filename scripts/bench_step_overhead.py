"""What a baseline step does beyond the model's own work, on the decoder of the Trainer comparison.

relaytrain's baseline trains benchlib.DECODER (the Llama layout of `decoder_baseline_vs_hf_trainer`,
the same batch: 4 micro-batches of 2 x 128 tokens, fp32, fused AdamW) in a process of its own, a
round at a time. Inside the step the run times (`Trainer._step`: from the minibatch in hand to
the device synchronised after the update) three things are the model's work, as they are in
Hugging Face's Trainer's step too: each micro-batch's forward with its loss (`MicrobatchLoss`,
the model and the loss head), its backward (`Tensor.backward`), and the optimizer's `step` and
`zero_grad`. Their wall time is taken by wrapping those calls in the benchmark's process only;
the run itself is unchanged. Everything else in the step is its overhead: splitting the rows,
the loss's divisor, dropout's keys, the micro-batch context, loss sums, gradient checks, the
learning rate, progress. Headline (median over rounds):

- `step_overhead_share`: 1 - (forward + backward + optimizer) / step time, over the measured
  steps, target <= 0.03.

Each round also reports the whole run's time (`run_s`: building, every step, what runs between
steps, the summary) beside its steps' (`all_steps_s`).

`--profile` instead profiles one step of each side (after the same warm-up), relaytrain's
baseline and Hugging Face's Trainer as bench_hf_trainer.py sets it up, each in a process of its
own, with torch.profiler: every operator call, the matrix products' calls and their own time,
and the rest of the step (docs/benchmarks.md keeps one).

    .venv/bin/python scripts/bench_step_overhead.py --json out.json [--rounds 3] [--steps 8] [--profile [--model moe]]
"""

from __future__ import annotations

import csv
import functools
import json
import tempfile
import time
from pathlib import Path

from benchlib import DECODER, child_run, contest_args, contest_dirs, headline, report

BATCH = ["data.seq_len=128", "strategy.microbatch_size=2", "strategy.num_microbatches=4"]  # bench_hf_trainer's
UNTIMED = 2
TARGET = 0.03


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # the model's own matrix products


def parse_args():
    return contest_args(__doc__, ("WORKDIR",), steps=8, untimed=f"the first {UNTIMED} are", rounds=3,
                        extra=[("--profile", dict(action="store_true",
                                                  help="profile one step of relaytrain and one of Trainer instead")),
                               ("--model", dict(choices=("decoder", "moe"), default="decoder",
                                                help="with --profile: the Trainer comparisons' decoder, or bench_moe's "
                                                     "mixture (the same batch)"))])


class ModelWork:
    """Wall seconds inside the model's own calls, by kind, since the last `reset`."""

    def __init__(self):
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def timed(self, kind: str, call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
        return wrapper


def instrument(work: ModelWork, patch=setattr) -> None:
    """Wrap the model's calls (forward with its loss, backward, the optimizer's step and
    zero_grad) and start counting where the run starts measuring (`reset_measurements`);
    `patch`: how an attribute is replaced (a test's monkeypatch undoes it)."""
    import torch

    from relaytrain.strategies import whole_model
    from relaytrain.strategies.base import Strategy

    patch(whole_model.MicrobatchLoss, "forward", work.timed("forward", whole_model.MicrobatchLoss.forward))
    patch(torch.Tensor, "backward", work.timed("backward", torch.Tensor.backward))
    build = whole_model.build_optimizer

    def timed_optimizer(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        optimizer.step = work.timed("optimizer", optimizer.step)
        optimizer.zero_grad = work.timed("optimizer", optimizer.zero_grad)
        return optimizer

    patch(whole_model, "build_optimizer", timed_optimizer)
    reset = Strategy.reset_measurements

    def reset_both(self):
        reset(self)
        work.reset()

    patch(Strategy, "reset_measurements", reset_both)


def child(workdir: str, run_dir: str, steps: int) -> None:
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    work = ModelWork()
    instrument(work)
    given = [*DECODER, *BATCH, "strategy=baseline", f"train.steps={steps}", f"train.untimed_steps={UNTIMED}",
             "train.check_memory=false"]
    start = time.perf_counter()
    run(compose_config(given), Path(run_dir), table=False, quiet=True)
    loop_s = time.perf_counter() - start
    with open(Path(run_dir) / "metrics.csv") as f:
        step_times = [float(row["step_time_s"]) for row in csv.DictReader(f)]
    measured = sum(step_times[UNTIMED:])
    model = sum(work.seconds.values())
    (Path(run_dir) / "bench.json").write_text(json.dumps({
        "measured_step_s": measured, "measured_steps": len(step_times) - UNTIMED, **{f"{k}_s": v for k, v in work.seconds.items()},
        "overhead_s": measured - model, "step_overhead_share": 1 - model / measured,
        "run_s": loop_s, "all_steps_s": sum(step_times)}))


def profile_summary(profiler, wall_s: float) -> dict:
    """One profiled step: operator calls (every aten call, nested ones included), the matrix
    products' calls and own time, and the step's wall time outside them."""
    events = [e for e in profiler.key_averages() if e.key.startswith("aten::")]
    matmul_s = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
    return {"wall_s": wall_s, "aten_calls": sum(e.count for e in events), "distinct_aten_ops": len(events),
            "matmul_calls": sum(e.count for e in events if e.key in MATMULS), "matmul_s": matmul_s,
            "outside_matmuls_s": wall_s - matmul_s,
            "top_other_ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in sorted(
                (e for e in events if e.key not in MATMULS), key=lambda e: -e.self_cpu_time_total)[:8]]}


def profile_relaytrain(at_step: int, model: list[str]) -> dict:
    import torch

    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run
    from relaytrain.strategies import whole_model

    taken, step = {}, whole_model.WholeModel.step

    def profiled(self, minibatch, lr):
        taken["calls"] = taken.get("calls", 0) + 1
        if taken["calls"] != at_step + 1:
            return step(self, minibatch, lr)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            start = time.perf_counter()
            result = step(self, minibatch, lr)
            taken["wall_s"] = time.perf_counter() - start
        taken["profiler"] = profiler
        return result

    whole_model.WholeModel.step = profiled
    given = [*model, *BATCH, "strategy=baseline", f"train.steps={at_step + 1}", "train.untimed_steps=0",
             "train.check_memory=false"]
    with tempfile.TemporaryDirectory() as run_dir:
        run(compose_config(given), Path(run_dir), table=False, quiet=True)
    return profile_summary(taken["profiler"], taken["wall_s"])


def profile_trainer(at_step: int, model: list[str]) -> dict:
    import torch
    from transformers import TrainerCallback

    from bench_hf_trainer import compose, train_with_trainer

    class Profiled(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == at_step:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == at_step + 1:
                self.wall_s = time.perf_counter() - self.start
                self.profiler.__exit__(None, None, None)

    profiled = Profiled()
    train_with_trainer(compose([*model, *BATCH], 1, at_step), at_step, callbacks=[profiled])
    return profile_summary(profiled.profiler, profiled.wall_s)


def mixture() -> list[str]:
    """bench_moe's mixture (the Qwen3-MoE layout of moe_baseline_vs_hf_trainer), whose batch is this one."""
    from bench_moe import BATCH as MOE_BATCH
    from bench_moe import MOE

    assert [f"data.seq_len={MOE_BATCH['seq_len']}", f"strategy.microbatch_size={MOE_BATCH['microbatch_size']}",
            f"strategy.num_microbatches={MOE_BATCH['microbatches']}"] == BATCH
    return MOE


def profile_both(model: list[str]) -> dict:
    """One step of each side on `model`, after `UNTIMED` warm-up steps, each in a process of its own."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    sides = {}
    for name, side in (("relaytrain", profile_relaytrain), ("hf_trainer", profile_trainer)):
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            sides[name] = pool.submit(side, UNTIMED, model).result()
    return sides


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    if args.profile:
        model = DECODER if args.model == "decoder" else mixture()
        sides = profile_both(model)
        for name, side in sides.items():
            print(f"{name}: {side['aten_calls']} aten calls ({side['distinct_aten_ops']} operators), "
                  f"{side['matmul_calls']} matrix products taking {side['matmul_s']:.3f} s of a {side['wall_s']:.3f} s "
                  f"step; outside them {side['outside_matmuls_s']:.3f} s; most other time: {side['top_other_ops'][:4]}")
        if args.json:
            Path(args.json).write_text(json.dumps({"command": f"python scripts/bench_step_overhead.py --profile "
                                                              f"--model {args.model}",
                                                   "model": model, "batch": BATCH, **sides}, indent=2) + "\n")
        return
    with contest_dirs() as (workdir, runs, load):
        rounds = [child_run(__file__, args.steps, [str(workdir)], runs, "baseline") for _ in range(args.rounds)]
    headlines = {"step_overhead_share": headline([r["step_overhead_share"] for r in rounds], TARGET,
                                                 lower_is_better=True)}
    results = {"command": f"python scripts/bench_step_overhead.py --rounds {args.rounds} --steps {args.steps}",
               "model": DECODER, "batch": BATCH, "rounds": rounds, "other_load_cores": load.cores,
               "headlines": headlines}
    report(results, args.json)


if __name__ == "__main__":
    main()
