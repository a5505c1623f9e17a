"""Which should I use? Every strategy on two workers, the same model and global batch: samples/s
measured on this machine, and device memory per worker simulated at BERT-Large size.

Each contestant is a `relaytrain train` run (a subprocess, as a user runs it) into
OUT/runs/NAME, compared by one `relaytrain report OUT/runs/*`; then the same strategy keys with
`model=bert_large data.seq_len=128` are dry-run on the meta device (`dryrun.simulate`) for the
fullest worker's peak device memory. The Markdown table and the plot go to OUT.

    .venv/bin/python scripts/which_strategy.py [--out which-strategy] [--steps 12]

Global batch 16 everywhere: data-parallel strategies take 2 replicas x b 4 x m 2, pipelines
2 stages x b 4 x m 4 (interleaved: 2 chunks a stage). Throughput here is a 2-core CPU's, where
two workers share the cores and nothing is transferred; the memory column is what a GPU
worker would hold for BERT-Large (fp32, AdamW), simulated, not measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config

MODEL = ["model=bert_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.intermediate_size=1024", "model.dropout=0.0", "data.seq_len=128", "data.num_samples=1024",
         "optim=adamw"]
BERT_LARGE = ["model=bert_large", "data.seq_len=128", "optim=adamw"]
REPLICATED = ["strategy.replicas=2", "strategy.microbatch_size=4", "strategy.num_microbatches=2"]
PIPELINED = ["strategy.stages=2", "strategy.replicas=1", "strategy.microbatch_size=4", "strategy.num_microbatches=4"]
CONTESTANTS = {
    "baseline x2": ["strategy=baseline", *REPLICATED],
    "fsdp x2 (reshard)": ["strategy=fsdp", *REPLICATED, "strategy.reshard_after_forward=true"],
    "fsdp x2 (no reshard)": ["strategy=fsdp", *REPLICATED, "strategy.reshard_after_forward=false"],
    "l2l x2": ["strategy=l2l", *REPLICATED],
    "l2l_stash_cpu x2": ["strategy=l2l_stash_cpu", *REPLICATED],
    "pipe_flush d=2": ["strategy=pipe_flush", *PIPELINED],
    "pipe_2bw d=2": ["strategy=pipe_2bw", *PIPELINED],
    "pipe_interleaved d=2 v=2": ["strategy=pipe_interleaved", *PIPELINED, "strategy.chunks=2"],
}


def train(name: str, overrides: list[str], runs: Path, steps: int) -> Path:
    run_dir = runs / name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
    command = [sys.executable, "-m", "relaytrain.commands.cli", "train", *MODEL, *overrides, f"train.steps={steps}",
               "train.untimed_steps=2", "train.log_every=1000", f"hydra.run.dir={run_dir}"]
    print(f"[{name}] {' '.join(command[3:])}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def report(run_dirs: list[Path], out: Path) -> None:
    """The user's view of the sweep: `relaytrain report` (its table, summary.csv and plots)."""
    subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", "report", *map(str, run_dirs), "--out", str(out)],
                   check=True)


def samples_per_s(run_dir: Path) -> float:
    return json.loads((run_dir / "results.json").read_text())["throughput"]["samples_per_s"]


def simulated_gib(overrides: list[str]) -> float:
    return simulate(compose_config([*BERT_LARGE, *overrides])).peak_bytes / 2**30


def markdown(rows: list[tuple]) -> str:
    lines = ["| strategy (2 workers, global batch 16) | samples/s here (measured) | BERT-Large device GiB per worker (simulated) |",
             "| --- | --- | --- |"]
    lines += [f"| `{name}` | {rate:.1f} | {gib:.2f} |" for name, rate, gib in rows]
    return "\n".join(lines)


def plot(rows: list[tuple], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rate, gib in rows:
        ax.scatter(gib, rate, s=40)
        ax.annotate(name, (gib, rate), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("BERT-Large device memory per worker, GiB (simulated)")
    ax.set_ylabel("samples/s on this machine, small model (measured)")
    ax.set_title("Which should I use? Two workers, global batch 16")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="which-strategy", help="where the runs, the table and the plot go")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (2 of them warm-up)")
    args = parser.parse_args()
    out = Path(args.out)
    run_dirs = {name: train(name, overrides, out / "runs", args.steps) for name, overrides in CONTESTANTS.items()}
    report(list(run_dirs.values()), out)
    rows = []
    for name, overrides in CONTESTANTS.items():
        rows.append((name, samples_per_s(run_dirs[name]), simulated_gib(overrides)))
        print(f"{name}: {rows[-1][1]:.1f} samples/s, {rows[-1][2]:.2f} GiB simulated", flush=True)
    table = markdown(rows)
    (out / "which_strategy.md").write_text(table + "\n")
    plot(rows, out / "which_strategy.png")
    print(table)


if __name__ == "__main__":
    main()
