"""Sequence parallelism (not a test): one 4,096-token sequence a micro-batch, cut over 2 workers
(`strategy.sequence_parallel=2`) against one worker holding it whole, the same model and data.

Each worker gets one torch thread (`train.threads=1`), so on a 2-core machine two workers can at
best double one worker's throughput; both train on the same minibatch (one sequence, two
micro-batches), so the cut run's tokens/s is compared with twice the one worker's. What the cut
pays is the two all-to-alls around every attention (forward and backward) and each worker's copy
of the embeddings, head and optimizer step; attention's s x s work is split by heads, the rest by
tokens. Each run is a process of its own (a clean allocator). Headline:

- `sequence_parallel_scaling`: tokens/s of 2 workers cutting the sequence / (2 x one worker's),
  median over rounds (target >= 0.8).

    .venv/bin/python scripts/bench_sequence_parallel.py --json out.json [--rounds 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchlib import OtherLoad, alternating_rounds, child_run, contest_args, headline, headline_line

TOKENS = 4096
# A Llama-layout decoder small enough for a step of one 4,096-token sequence on one CPU thread in
# seconds; 4 query heads and 2 key/value heads, so 2 workers take 2 and 1 of them each.
RUN = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=256", "model.intermediate_size=688",
       "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=8192", f"model.max_seq_len={TOKENS}",
       f"data.seq_len={TOKENS}", "data.num_samples=16", "strategy=baseline", "strategy.microbatch_size=1",
       "strategy.num_microbatches=2", "model.dropout=0.0", "train.threads=1", "train.check_memory=false"]
WORKERS = {"one worker": "1", "sequence_parallel=2": "2"}


def parse_args() -> argparse.Namespace:
    return contest_args(__doc__, ("WORKERS",), steps=4, untimed="the first two are")


def child(workers: str, run_dir: str, steps: int) -> None:
    """One run started from this process; its throughput into RUN_DIR/bench.json."""
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    cfg = compose_config([*RUN, f"strategy.sequence_parallel={workers}", f"train.steps={steps}",
                          "train.untimed_steps=2"])
    results = run(cfg, Path(run_dir), table=False)
    out = {"tokens_per_s": results["throughput"]["tokens_per_s"], "step_time_s": results["throughput"]["step_time_s"]}
    Path(run_dir, "bench.json").write_text(json.dumps(out))


def one_run(name: str, workdir: Path, steps: int) -> dict:
    return child_run(__file__, steps, [WORKERS[name]], workdir, WORKERS[name])


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp, OtherLoad() as load:
        workdir = Path(tmp)
        rounds = alternating_rounds(WORKERS, args.rounds, lambda name: one_run(name, workdir, args.steps))
    scaling = [r["sequence_parallel=2"]["tokens_per_s"] / (2 * r["one worker"]["tokens_per_s"]) for r in rounds]
    results = {
        "command": f"python scripts/bench_sequence_parallel.py --rounds {args.rounds} --steps {args.steps}",
        "run": RUN, "workers": WORKERS, "rounds": rounds, "other_load_cores": load.cores,
        "headlines": {"sequence_parallel_scaling": headline(scaling, 0.8)},
    }
    h = results["headlines"]["sequence_parallel_scaling"]
    print(f"{headline_line('sequence_parallel_scaling', h)}; other processes kept {load.cores:.2f} cores busy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
