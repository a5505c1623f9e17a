"""Per-stage peak host memory and step time of a pipeline run on the CPU (not a test).

On the CPU a stage's tensors live in its worker's host memory, so each worker's peak RSS
(the kernel's VmHWM) measures what the stage holds at its fullest: weights (two versions
under 2BW), gradients, optimizer state and stashed activations, on top of the worker's fixed
cost (Python, torch). Used for the choices documented in docs/pipelines.md: when 2BW applies
an update, and block- against stage-level recompute.

    .venv/bin/python scripts/pipeline_memory.py --strategy pipe_2bw [--recompute none|block|stage]
        [--hidden 1024] [--layers 8] [--seq-len 32] [--microbatch-size 2] [--microbatches 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from relaytrain.run.compose import compose_config
from relaytrain.run.train import run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="pipe_2bw")
    p.add_argument("--recompute", default="none")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--optim", default="sgd")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    cfg = compose_config([
        "model=gpt2_tiny", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.num_heads={args.hidden // 64}", f"model.intermediate_size={4 * args.hidden}",
        "model.vocab_size=8192", "model.dropout=0.0", f"data.seq_len={args.seq_len}", "data.num_samples=512",
        f"strategy={args.strategy}", "strategy.stages=2", f"strategy.recompute={args.recompute}",
        f"strategy.microbatch_size={args.microbatch_size}", f"strategy.num_microbatches={args.microbatches}",
        f"optim={args.optim}", f"train.steps={args.steps}", "train.untimed_steps=2", "train.log_every=1000",
    ])
    with tempfile.TemporaryDirectory() as run_dir:
        results = run(cfg, Path(run_dir))
    stages = results["strategy_report"]["per_stage"]
    out = {
        "config": vars(args),
        "step_time_s": results["throughput"]["step_time_s"],
        "stages": [
            {"stage": s["stage"], "parameters": s["parameters"],
             "peak_rss_mib": p["host_peak_rss_bytes"] / 2**20,
             "one_weight_copy_mib": s["parameters"] * 4 / 2**20}
            for s, p in zip(stages, results["memory"]["per_process"], strict=True)
        ],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
