"""train.compile=true against eager: the bert_base baseline step, after warm-up (`compiled_vs_eager`).

Two baselines of one model (same seed, data, threads and dropout), one with its blocks compiled
(`relaytrain.models.compile`: one graph for every block), one eager. Each takes `--warmup` untimed steps
first (the compiled one compiles there; its compile time is reported), then rounds alternate
(eager, compiled, eager, ...) so drift on the machine hits both alike. Each round's figure is
eager's median step time over compiled's: above 1, the compiled step is faster.

    python scripts/bench_compile.py [--rounds 5] [--steps 3] [--warmup 2] [--json out.json] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_baseline import time_steps, write_result
from benchlib import OtherLoad, headline
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.models.compile import compile_blocks
from relaytrain.run.compose import compose_config
from relaytrain.run.launch import keep_freed_host_memory
from relaytrain.strategies import build_strategy

DEFAULT = ["model=bert_base", "model.dropout=0.1", "data.seq_len=128", "strategy.microbatch_size=4",
           "strategy.num_microbatches=2", "data.num_samples=64"]


def step_fn(cfg, compiled: bool):
    """The baseline's step on a fresh model, its blocks compiled or not; and its compile counter."""
    model = build_model(cfg.model, seed=0)
    stats = compile_blocks(model, compiled, torch.device("cpu"))
    strategy = build_strategy(model, cfg)
    return (lambda minibatch: strategy.step(minibatch, cfg.optim.lr).loss), stats


def main() -> None:
    keep_freed_host_memory()  # as every relaytrain process does (the launcher's setting)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contestant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps each before the rounds (compiling)")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the compiled baseline compiles in its first step")
    cfg = compose_config([*DEFAULT, *args.overrides])
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    minibatches = [next(loader) for _ in range(max(args.steps, args.warmup))]
    eager, _ = step_fn(cfg, False)
    compiled, stats = step_fn(cfg, True)
    runners = {"eager": eager, "compiled": compiled}
    for name, step in runners.items():
        for minibatch in minibatches[:args.warmup]:
            step(minibatch)
            if name == "compiled":
                stats.step_done()  # the first step's compile time is fixed after it
    warmup_compile = stats.report()
    medians = {name: [] for name in runners}
    per_round = []
    with OtherLoad() as others:
        for _ in range(args.rounds):
            for name, step in runners.items():
                medians[name].append(statistics.median(time_steps(step, minibatches[:args.steps])))
            per_round.append(medians["eager"][-1] / medians["compiled"][-1])
    after = stats.report()
    stats.close()
    result = {
        "benchmark": "compiled_vs_eager",
        "model": f"{cfg.model.name} L{cfg.model.num_layers} H{cfg.model.hidden_size} seq{cfg.data.seq_len}",
        "minibatch": f"{cfg.strategy.microbatch_size}x{cfg.strategy.num_microbatches}",
        "threads": torch.get_num_threads(),
        "step_s": {name: statistics.median(m) for name, m in medians.items()},
        "compile": warmup_compile,
        "recompiles_after_warmup": after["compiles"] - warmup_compile["compiles"],
        "other_cores_busy": others.cores,
        "headlines": {"compiled_vs_eager": headline(per_round, 1.0)},
    }
    print(f"train.compile ({result['model']}, minibatch {result['minibatch']}, {result['threads']} threads): "
          f"step {result['step_s']['eager']:.3f} s eager, {result['step_s']['compiled']:.3f} s compiled; "
          f"eager/compiled median round {statistics.median(per_round):.3f}, rounds "
          f"{', '.join(f'{r:.3f}' for r in per_round)} (target >= 1.0); compiled in "
          f"{warmup_compile['first_step_s']:.1f} s ({warmup_compile['graphs']} graph(s) for "
          f"{cfg.model.num_layers} blocks); other processes kept {others.cores:.2f} cores busy")
    write_result(args.json, result)


if __name__ == "__main__":
    main()
