"""Long sequences under a 128 k vocabulary: the causal-LM loss in chunks of tokens, two comparisons.

A decoder of the Llama layout with Llama 3's vocabulary (2 blocks of hidden 256, so the head is
most of its work and its logits most of its memory) trains under relaytrain's baseline, each
contestant in a process of its own (a clean allocator and peak), rounds alternating. Headlines:

- `chunked_loss_vs_full`: samples/s chunked / whole-sequence, median over rounds (target >= 0.97).
  `model.loss_chunk_tokens=auto` (at 2 x 1,024 tokens a micro-batch the loss runs in chunks of
  523 tokens, each chunk's gradients taken in the forward) against `model.loss_chunk_tokens=0`
  (the whole sequence's logits at once), same model, data and minibatch. Any price of chunking
  shows in full; what chunking buys is the logits' memory (docs/design.md, "Adding an objective").
- `long_context_peak_vs_hf_trainer`: peak memory relaytrain / Hugging Face Trainer, median over
  rounds (target < 0.5, lower is better). One 4,096-token sequence a step (micro-batch 1),
  activations recomputed on both sides: relaytrain `strategy.recompute=block` (its loss chunked:
  auto) against `transformers.Trainer` with gradient checkpointing (`activation_checkpointing=True`,
  the name transformers 5 gives `gradient_checkpointing`), whose loss takes the whole sequence's
  logits. Same model (built from relaytrain's config and seed), samples, order and AdamW, as
  bench_hf_trainer.py sets Trainer up; each side reports every step's loss, and the first steps'
  agree to float noise. The peak is the contestant's process's: resident memory's high-water
  mark (VmHWM) on the CPU, torch.cuda.max_memory_allocated on a GPU.

    .venv/bin/python scripts/bench_long_context.py --json bench_long_context.json [--rounds 3] [--only NAME,...]
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench_hf_trainer import compose, train_with_trainer
from benchlib import OtherLoad, alternating_rounds, child_run, contest_args, headline, headline_line
from relaytrain.run.train import run
from relaytrain.step import metrics

MODEL = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=256", "model.intermediate_size=688",
         "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=128256", "model.dropout=0.0",
         "strategy=baseline", "train.check_memory=false"]
RUN = [*MODEL, "model.max_seq_len=1024", "data.seq_len=1024", "data.num_samples=64",
       "strategy.microbatch_size=2", "strategy.num_microbatches=2"]
# The peak comparison: one 4,096-token sequence a step, each block recomputed in the backward (Trainer's
# gradient checkpointing does the same); the loss chunked as auto decides.
LONG_RUN = [*MODEL, "model.max_seq_len=4096", "data.seq_len=4096", "data.num_samples=16",
            "strategy.microbatch_size=1", "strategy.num_microbatches=1", "strategy.recompute=block"]
# relaytrain's contestants: their runs' overrides. Trainer's runs LONG_RUN's config its own way.
RELAYTRAIN_RUNS = {"chunked": [*RUN, "model.loss_chunk_tokens=auto"], "whole": [*RUN, "model.loss_chunk_tokens=0"],
                   "relaytrain": LONG_RUN}
TRAINER = "hf_trainer"
# Trainer's checkpointing of every decoder layer, as relaytrain's recompute=block; its loss logged
# every step, so the first step's can be held against relaytrain's.
TRAINER_ARGUMENTS = {"activation_checkpointing": True, "logging_strategy": "steps", "logging_steps": 1}
SPEED, PEAK = "chunked_loss_vs_full", "long_context_peak_vs_hf_trainer"  # the headlines
COMPARISONS = {SPEED: ("chunked", "whole"), PEAK: ("relaytrain", TRAINER)}
UNTIMED = 2
SPEED_TARGET = 0.97
PEAK_TARGET = 0.5
SAME_LOSS = 1e-4  # relative: float noise (the order of the loss's sums), not a different training


def relaytrain_side(overrides: list[str], steps: int, run_dir: Path) -> dict:
    """relaytrain's run of `overrides` in this process: its samples/s after the untimed steps,
    every step's loss and the host peak its results.json reports."""
    results = run(compose(overrides, steps - UNTIMED, UNTIMED), run_dir, table=False)
    return {"samples_per_s": results["throughput"]["samples_per_s"], "losses": results["loss"],
            "host_peak_rss_bytes": results["memory"]["host_peak_rss_bytes"]}


def trainer_side(overrides: list[str], steps: int) -> dict:
    """The same training under transformers.Trainer with gradient checkpointing, in this process."""
    figures = train_with_trainer(compose(overrides, steps - UNTIMED, UNTIMED), UNTIMED, **TRAINER_ARGUMENTS)
    return {key: figures[key] for key in ("samples_per_s", "losses", "optimizer_as_relaytrain")}


def own_peak() -> dict:
    """This process's peak memory: the CUDA allocator's where a GPU trained (both contestants train
    on the same device), else the resident set's high-water mark."""
    if torch.cuda.is_available():
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "peak_of": "torch.cuda.max_memory_allocated"}
    return {"peak_bytes": metrics.HostMemory().peak_bytes(), "peak_of": "VmHWM"}


def child(name: str, run_dir: str, steps: int) -> None:
    """One contestant's run in this process; its figures into RUN_DIR/bench.json."""
    run_dir = Path(run_dir)
    if name == TRAINER:
        figures = trainer_side(LONG_RUN, steps)
    else:
        figures = relaytrain_side(RELAYTRAIN_RUNS[name], steps, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench.json").write_text(json.dumps({**figures, **own_peak()}))


def speed_comparison(rounds: list[dict]) -> dict:
    per_round = [r["chunked"]["samples_per_s"] / r["whole"]["samples_per_s"] for r in rounds]
    return {"run": RUN, "rounds": rounds, "headline": headline(per_round, SPEED_TARGET)}


def peak_comparison(rounds: list[dict]) -> dict:
    """The peaks' ratio per round, and whether both sides started from the same loss in every round."""
    per_round = [r["relaytrain"]["peak_bytes"] / r[TRAINER]["peak_bytes"] for r in rounds]
    first = [(r["relaytrain"]["losses"][0], r[TRAINER]["losses"][0]) for r in rounds]
    return {"run": LONG_RUN, "trainer_arguments": TRAINER_ARGUMENTS, "rounds": rounds,
            "peak_gib": {side: statistics.median(r[side]["peak_bytes"] for r in rounds) / 2**30
                         for side in ("relaytrain", TRAINER)},
            "first_step_losses": first,
            "same_first_step_loss": all(math.isclose(ours, theirs, rel_tol=SAME_LOSS) for ours, theirs in first),
            "headline": headline(per_round, PEAK_TARGET, lower_is_better=True)}


SUMMARIES = {SPEED: speed_comparison, PEAK: peak_comparison}


def summary_line(name: str, result: dict) -> str:
    """The headline's line; for the peaks, the peaks themselves and whether both sides trained the same."""
    line = headline_line(name, result["headline"])
    if name != PEAK:
        return line
    gib, (ours, theirs) = result["peak_gib"], result["first_step_losses"][0]
    agree = "agree" if result["same_first_step_loss"] else "DIFFER: not the same training"
    return (f"{line}; peak relaytrain {gib['relaytrain']:.2f} GiB, Trainer {gib[TRAINER]:.2f} GiB "
            f"({result['rounds'][0]['relaytrain']['peak_of']}); "
            f"first-step losses {ours:.6f} vs {theirs:.6f} ({agree})")


def main() -> None:
    args = contest_args(__doc__, ("CONTESTANT",), steps=5, untimed="the first two are",
                        comparisons=tuple(COMPARISONS))
    if args.steps <= UNTIMED:
        sys.exit(f"bench_long_context: --steps {args.steps} leaves no step timed; the first {UNTIMED} are untimed")
    if args.child:
        child(*args.child, args.steps)
        return
    if PEAK in args.only.split(",") and importlib.util.find_spec("accelerate") is None:
        sys.exit(f"bench_long_context: transformers.Trainer needs accelerate: pip install -e '.[bench]' "
                 f"(make bench does); or --only {SPEED}")
    comparisons = {}
    with tempfile.TemporaryDirectory() as tmp, OtherLoad() as load:
        for name in args.only.split(","):
            rounds = alternating_rounds(COMPARISONS[name], args.rounds,
                                        lambda side: child_run(__file__, args.steps, [side], Path(tmp), side))
            comparisons[name] = SUMMARIES[name](rounds)
            print(summary_line(name, comparisons[name]), flush=True)
    print(f"other processes kept {load.cores:.2f} cores busy")
    results = {
        "command": f"python scripts/bench_long_context.py --rounds {args.rounds} --steps {args.steps} "
                   f"--only {args.only}",
        "comparisons": comparisons, "other_load_cores": load.cores,
        "headlines": {name: result["headline"] for name, result in comparisons.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
