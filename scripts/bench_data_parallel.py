"""Data parallelism (not a test): the baseline on 2 replicas against 2 x one worker, and FSDP
against the baseline on 2 replicas, the same model and batch.

Each worker gets one torch thread (`train.threads=1`), so on a 2-core machine two workers can
at best double one worker's throughput. The 2-replica runs train on minibatches twice as large
(each replica takes its share of every micro-batch: the same per-worker batch as one worker),
so their samples/s is compared with twice the one-worker figure.

    .venv/bin/python scripts/bench_data_parallel.py [--rounds 5] [--steps 8] [--json out.json]

Headlines (medians of the rounds' ratios, contestants alternating within each round):
- `baseline_replicas_scaling`: baseline, 2 replicas / (2 x one worker), target >= 0.85;
- `fsdp_vs_baseline_replicas`: fsdp (ZeRO-3, the default) / baseline, 2 replicas each, target >= 0.90;
- `fsdp_no_reshard_vs_baseline_replicas`: the same with `strategy.reshard_after_forward=false`
  (one all-gather and one reduce-scatter a step: DDP's bytes), target >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchlib import headline
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run

MODEL = [
    "model=bert_tiny", "model.num_layers=6", "model.hidden_size=512", "model.num_heads=8",
    "model.intermediate_size=2048", "model.dropout=0.0", "data.seq_len=128", "data.num_samples=1024",
    "strategy.microbatch_size=4", "strategy.num_microbatches=2", "optim=adamw", "train.threads=1",
    "train.log_every=1000",
]
CONTESTANTS = {
    "one worker": ["strategy=baseline"],
    "baseline, 2 replicas": ["strategy=baseline", "strategy.replicas=2"],
    "fsdp, 2 replicas": ["strategy=fsdp", "strategy.replicas=2"],
    "fsdp no reshard, 2 replicas": ["strategy=fsdp", "strategy.replicas=2", "strategy.reshard_after_forward=false"],
}


def measure(overrides: list[str], steps: int, warmup: int) -> dict:
    cfg = compose_config([*MODEL, *overrides, f"train.steps={steps}", f"train.untimed_steps={warmup}"])
    with tempfile.TemporaryDirectory() as run_dir:
        results = run(cfg, Path(run_dir), table=False)
    return {"samples_per_s": results["throughput"]["samples_per_s"],
            "step_time_s": results["throughput"]["step_time_s"],
            "host_peak_rss_gib": results["memory"]["host_peak_rss_bytes"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    rounds = []
    for r in range(args.rounds):
        rounds.append({name: measure(overrides, args.steps, args.warmup) for name, overrides in CONTESTANTS.items()})
        print(f"round {r + 1}: " + ", ".join(f"{name} {m['samples_per_s']:.2f} samples/s"
                                             for name, m in rounds[-1].items()), flush=True)

    def rate(r: dict, name: str) -> float:
        return r[name]["samples_per_s"]

    headlines = {
        "baseline_replicas_scaling": headline(
            [rate(r, "baseline, 2 replicas") / (2 * rate(r, "one worker")) for r in rounds], 0.85),
        "fsdp_vs_baseline_replicas": headline(
            [rate(r, "fsdp, 2 replicas") / rate(r, "baseline, 2 replicas") for r in rounds], 0.90),
        "fsdp_no_reshard_vs_baseline_replicas": headline(
            [rate(r, "fsdp no reshard, 2 replicas") / rate(r, "baseline, 2 replicas") for r in rounds], 0.90),
    }
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
           "model": MODEL, "contestants": CONTESTANTS, "rounds": rounds, "headlines": headlines}
    for key, h in headlines.items():
        print(f"{key}: median {h['median']:.3f} (spread {h['spread'][0]:.3f}-{h['spread'][1]:.3f}, "
              f"target >= {h['target']})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
