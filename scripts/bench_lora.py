"""LoRA under L2L against full fine-tuning under L2L: host memory and throughput.

A bf16 checkpoint of the Llama layout (made here by save_pretrained, as users' checkpoints are)
is fine-tuned under `strategy=l2l` twice per round, in separate processes: `adapter=lora`
(peft's LoRA, rank 8 on every linear layer of the blocks) and `adapter=none`, same model, same
minibatch, same optimizer. Each process reports its host memory: the peak resident set of the
run (results.json, `memory.host_peak_rss_bytes`) less what the process held before building
the model (the interpreter, torch, transformers, the data), i.e. what training added; beside
it the planner's closed form (`L2LCost.host_state_bytes`). Headlines:

- `lora_l2l_host_bytes_ratio`: host memory LoRA / full, median over rounds (target <= 0.25);
- `lora_l2l_vs_full_l2l`: samples/s LoRA / full, median over rounds (target >= 1.2).

    .venv/bin/python scripts/bench_lora.py --json bench_lora.json [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchlib import alternating_rounds, child_run, contest_args, contest_dirs, headline, headline_line

HERE = Path(__file__).resolve().parent
# The model: the Llama layout, grouped-query attention 16/4, SwiGLU, an untied 8k vocabulary (107 M
# parameters): blocks, not the embeddings, are most of it, as in the checkpoints users adapt.
SIZES = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=2816, vocab_size=8192, max_position_embeddings=256)
RUN = ["strategy=l2l", "data.seq_len=64", "data.num_samples=256", "strategy.microbatch_size=4",
       "strategy.num_microbatches=2", "optim=adamw", "optim.lr=1e-4", "model.dropout=0.0",
       "train.check_memory=false"]


def parse_args() -> argparse.Namespace:
    # Five rounds: a round takes 25 s here, and its speed ratio swings by +-8 % from round to round
    # on this VM (1.10 to 1.38 over 2026-11-27's runs), more than three rounds' median settles.
    return contest_args(__doc__, ("CHECKPOINT", "ADAPTER"), steps=4, untimed="the first is", rounds=5)


def make_checkpoint(directory: Path, sizes: dict = SIZES, model_type: str = "llama") -> Path:
    """The bf16 checkpoint, written once by a process of its own (its fp32 build is not measured)."""
    code = ("import sys, torch; from transformers import AutoConfig, AutoModelForCausalLM; "
            f"torch.manual_seed(0); c = AutoConfig.for_model({model_type!r}, **{sizes!r}); "
            "AutoModelForCausalLM.from_config(c).to(torch.bfloat16).save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True)
    return directory


def child(checkpoint: str, adapter: str, run_dir: str, steps: int) -> None:
    """One run in this process: what it held before the model, then the run's own figures."""
    import psutil

    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run
    from relaytrain.strategies import strategy_class

    given = [f"model.pretrained={checkpoint}", f"adapter={adapter}", *RUN, f"train.steps={steps}",
             "train.untimed_steps=1"]
    cfg = resolve(compose_config(given), given)
    closed_form = strategy_class("l2l").cost_model.host_state_bytes(cfg, ModelFacts.of(cfg))
    before = psutil.Process().memory_info().rss
    results = run(cfg, Path(run_dir), table=False)
    out = {"rss_before_bytes": before, "peak_rss_bytes": results["memory"]["host_peak_rss_bytes"],
           "samples_per_s": results["throughput"]["samples_per_s"], "closed_form_bytes": closed_form,
           "parameters": results.get("strategy_report", {}).get("eps", {}).get("updated_parameters")}
    Path(run_dir, "bench.json").write_text(json.dumps(out))


def one_run(checkpoint: Path, adapter: str, workdir: Path, steps: int) -> dict:
    figures = child_run(__file__, steps, [str(checkpoint), adapter], workdir, adapter)
    figures["host_bytes"] = figures["peak_rss_bytes"] - figures["rss_before_bytes"]
    return figures


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    with contest_dirs() as (workdir, runs, load):
        checkpoint = make_checkpoint(workdir / "checkpoint")
        rounds = alternating_rounds(("lora", "none"), args.rounds,
                                    lambda adapter: one_run(checkpoint, adapter, runs, args.steps))
    memory = [r["lora"]["host_bytes"] / r["none"]["host_bytes"] for r in rounds]
    speed = [r["lora"]["samples_per_s"] / r["none"]["samples_per_s"] for r in rounds]
    closed = rounds[0]["lora"]["closed_form_bytes"] / rounds[0]["none"]["closed_form_bytes"]
    results = {
        "command": "python scripts/bench_lora.py " + f"--rounds {args.rounds} --steps {args.steps}",
        "model": {**SIZES, "checkpoint_dtype": "bfloat16"}, "run": RUN, "rounds": rounds,
        "closed_form_ratio": closed, "other_load_cores": load.cores,
        "headlines": {"lora_l2l_host_bytes_ratio": headline(memory, 0.25, lower_is_better=True),
                      "lora_l2l_vs_full_l2l": headline(speed, 1.2)},
    }
    for name, h in results["headlines"].items():
        print(headline_line(name, h))
    first = rounds[0]
    for adapter in ("lora", "none"):
        f = first[adapter]
        print(f"  {adapter}: host {f['host_bytes'] / 2**20:.0f} MiB measured, {f['closed_form_bytes'] / 2**20:.0f} MiB "
              f"closed form; {f['samples_per_s']:.2f} samples/s")
    print(f"  closed-form ratio {closed:.3f}; other processes kept {load.cores:.2f} cores busy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
