"""Muon against AdamW under L2L on a decoder, on this machine's CPU.

A float32 checkpoint of the Llama layout (made here by save_pretrained) trains on synthetic rows
under strategy=l2l, once with optim=muon (torch's Muon on the blocks' matrices, AdamW on the
rest; the Newton-Schulz steps run on the host in the eager param server) and once with
optim=adamw; each run in a process of its own, in alternating order. Headline (median over
rounds):

- `muon_l2l_vs_adamw_l2l`: samples/s, optim=muon / optim=adamw, target >= 0.8.

    .venv/bin/python scripts/bench_muon.py --json bench_muon.json [--rounds 3]
"""

from __future__ import annotations

import json
from pathlib import Path

from benchlib import (
    alternating_rounds,
    child_run,
    contest_args,
    contest_dirs,
    headline,
    llama_checkpoint,
    report,
)

SIZES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1376, vocab_size=4096, max_position_embeddings=256)
SEQ, MICROBATCH, ACCUMULATE = 128, 8, 2
COMPARISONS = ("muon_l2l_vs_adamw_l2l",)
CONTESTS = {"muon_l2l_vs_adamw_l2l": ("muon", "adamw")}


def parse_args():
    return contest_args(__doc__, ("CONTESTANT", "WORKDIR"), steps=5, untimed="the first is",
                        comparisons=COMPARISONS, rounds=3)


def child(optimizer: str, workdir: str, run_dir: str, steps: int) -> None:
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    given = [f"model.pretrained={Path(workdir) / 'checkpoint'}", f"data.seq_len={SEQ}", "data.num_samples=256",
             "model.dropout=0.0", "strategy=l2l", f"strategy.microbatch_size={MICROBATCH}",
             f"strategy.num_microbatches={ACCUMULATE}", f"optim={optimizer}", f"train.steps={steps}",
             "train.untimed_steps=1", "train.check_memory=false"]
    results = run(resolve(compose_config(given), given), Path(run_dir), table=False, quiet=True)
    (Path(run_dir) / "bench.json").write_text(json.dumps({"samples_per_s": results["throughput"]["samples_per_s"]}))


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    with contest_dirs() as (workdir, runs, load):
        llama_checkpoint(workdir / "checkpoint", SIZES)
        rounds = alternating_rounds(["muon", "adamw"], args.rounds,
                                    lambda c: child_run(__file__, args.steps, [c, str(workdir)], runs, c))
    top, bottom = CONTESTS["muon_l2l_vs_adamw_l2l"]
    headlines = {"muon_l2l_vs_adamw_l2l": headline([r[top]["samples_per_s"] / r[bottom]["samples_per_s"]
                                                    for r in rounds], 0.8)}
    results = {"command": f"python scripts/bench_muon.py --rounds {args.rounds} --steps {args.steps}",
               "model": SIZES, "seq_len": SEQ, "microbatch": MICROBATCH, "accumulate": ACCUMULATE,
               "rounds": rounds, "other_load_cores": load.cores, "headlines": headlines}
    report(results, args.json)


if __name__ == "__main__":
    main()
