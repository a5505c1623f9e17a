"""The causal-LM loss over chunks of tokens against the whole sequence's logits: throughput.

A decoder of the Llama layout with a 128 k vocabulary (Llama 3's) trains under the baseline twice
per round, each in its own process (a clean allocator): `model.loss_chunk_tokens=auto` (at 2 x 1,024
tokens a micro-batch the loss runs in chunks of 523 tokens, each chunk's gradients taken in the
forward) and `model.loss_chunk_tokens=0` (the whole sequence's logits at once), same model, data
and minibatch. The head is most of this model's work, so any price of chunking shows in full;
what chunking buys is the logits' memory (docs/design.md, "Adding an objective"). Headline:

- `chunked_loss_vs_full`: samples/s chunked / whole-sequence, median over rounds (target >= 0.97).

    .venv/bin/python scripts/bench_long_context.py --json bench_long_context.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchlib import OtherLoad, alternating_rounds, child_run, contest_args, headline, headline_line

RUN = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=256", "model.intermediate_size=688",
       "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=128256", "model.max_seq_len=1024",
       "data.seq_len=1024", "data.num_samples=64", "strategy=baseline", "strategy.microbatch_size=2",
       "strategy.num_microbatches=2", "model.dropout=0.0", "train.check_memory=false"]
SETTINGS = {"chunked": "auto", "whole": "0"}


def parse_args() -> argparse.Namespace:
    return contest_args(__doc__, ("SETTING",), steps=5, untimed="the first two are")


def child(setting: str, run_dir: str, steps: int) -> None:
    """One run in this process; its throughput and device (or host) peak into RUN_DIR/bench.json."""
    from relaytrain.compose import compose_config
    from relaytrain.train import run

    cfg = compose_config([*RUN, f"model.loss_chunk_tokens={setting}", f"train.steps={steps}",
                          "train.untimed_steps=2"])
    results = run(cfg, Path(run_dir), table=False)
    out = {"samples_per_s": results["throughput"]["samples_per_s"],
           "host_peak_rss_bytes": results["memory"].get("host_peak_rss_bytes")}
    Path(run_dir, "bench.json").write_text(json.dumps(out))


def one_run(name: str, workdir: Path, steps: int) -> dict:
    return child_run(__file__, steps, [SETTINGS[name]], workdir, name)


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp, OtherLoad() as load:
        workdir = Path(tmp)
        rounds = alternating_rounds(("chunked", "whole"), args.rounds, lambda name: one_run(name, workdir, args.steps))
    speed = [r["chunked"]["samples_per_s"] / r["whole"]["samples_per_s"] for r in rounds]
    results = {
        "command": f"python scripts/bench_long_context.py --rounds {args.rounds} --steps {args.steps}",
        "run": RUN, "settings": SETTINGS, "rounds": rounds, "other_load_cores": load.cores,
        "headlines": {"chunked_loss_vs_full": headline(speed, 0.97)},
    }
    h = results["headlines"]["chunked_loss_vs_full"]
    print(f"{headline_line('chunked_loss_vs_full', h)}; "
          f"other processes kept {load.cores:.2f} cores busy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
