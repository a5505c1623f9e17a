"""L2L across workers (not a test): throughput of 2 replicas against 2 x one worker.

Each worker gets one torch thread (`train.threads=1`), so on a 2-core machine two workers can
at best double one worker's throughput: the ideal. The 2-replica run trains on minibatches
twice as large (each replica takes its share), so its samples/s is compared with twice the
one-worker figure. Both EPS placements are measured, with each worker's peak host RSS:
`sharded` (each part's gradients and optimizer state on one owner, updated once, broadcast)
and `replicated` (all-reduce, every worker steps every part).

    .venv/bin/python scripts/bench_l2l_scaling.py [--rounds 3] [--steps 8] [--json out.json]

Target: 2-replica samples/s >= 0.85 x (2 x one worker), with the default (sharded) placement.
The contestants alternate round by round; each figure is its best round (the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchlib import headline
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run

MODEL = [
    "strategy=l2l", "model=bert_tiny", "model.num_layers=6", "model.hidden_size=512", "model.num_heads=8",
    "model.intermediate_size=2048", "model.dropout=0.0", "data.seq_len=128", "data.num_samples=1024",
    "strategy.microbatch_size=4", "strategy.num_microbatches=2", "optim=adamw", "train.threads=1",
    "train.log_every=1000",
]
TARGET = 0.85


def measure(overrides: list[str], steps: int, warmup: int) -> dict:
    cfg = compose_config([*MODEL, *overrides, f"train.steps={steps}", f"train.untimed_steps={warmup}"])
    with tempfile.TemporaryDirectory() as run_dir:
        results = run(cfg, Path(run_dir))
    per_process = results["memory"].get("per_process") or [{"host_peak_rss_bytes": results["memory"]["host_peak_rss_bytes"]}]
    report = results["strategy_report"]
    workers = report.get("per_worker", [])
    steps_measured = max(results["measured_steps"], 1)
    return {
        "samples_per_s": results["throughput"]["samples_per_s"],
        "step_time_s": results["throughput"]["step_time_s"],
        "host_peak_rss_gib": [p["host_peak_rss_bytes"] / 2**30 for p in per_process],
        "reduction_s_per_step": [w["reduction_s"] / results["steps"] for w in workers],
        "reduction_exposed_s_per_step": [w["reduction_exposed_s"] / results["steps"] for w in workers],
        "measured_steps": steps_measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    contestants = {
        "one worker": [],
        "2 replicas, sharded EPS": ["strategy.replicas=2", "strategy.eps_state=sharded"],
        "2 replicas, replicated EPS": ["strategy.replicas=2", "strategy.eps_state=replicated"],
    }
    rounds: dict[str, list[dict]] = {name: [] for name in contestants}
    for r in range(args.rounds):
        for name, overrides in contestants.items():
            rounds[name].append(measure(overrides, args.steps, args.warmup))
            print(f"round {r + 1} {name}: {rounds[name][-1]['samples_per_s']:.2f} samples/s", flush=True)
    best = {name: max(results, key=lambda x: x["samples_per_s"]) for name, results in rounds.items()}
    ideal = 2 * best["one worker"]["samples_per_s"]
    out = {
        "contestants": best,
        "rounds": rounds,
        "ideal_samples_per_s": ideal,
        "scaling_sharded": best["2 replicas, sharded EPS"]["samples_per_s"] / ideal,
        "scaling_replicated": best["2 replicas, replicated EPS"]["samples_per_s"] / ideal,
        "target": TARGET,
        # Tracked like every other comparison: each round's two replicas against twice that round's one worker.
        "headlines": {"l2l_replicas_scaling": headline(
            [two["samples_per_s"] / (2 * one["samples_per_s"])
             for one, two in zip(rounds["one worker"], rounds["2 replicas, sharded EPS"], strict=True)], TARGET)},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
