"""Experts streamed by need under L2L (`strategy.experts_by_need=true`): the bytes a step uploads.

A bf16 checkpoint of the Qwen3-MoE layout (`SIZES`: 8 blocks of hidden 512, GQA 8/2, 32 experts of
width 688 in every block, 2 routed a token; made here by save_pretrained, as a user's is) is
fine-tuned with LoRA on its attention under `strategy=l2l` twice per minibatch shape, the frozen
experts uploaded whole and by need. The figure is what the run's strategy report counts: every
weight byte the relay sent to the device over the measured steps, by need / whole. The count is
exact (bytes, not times), so one run of each suffices; the two runs' losses must agree exactly,
or the script fails.

- `moe_streamed_expert_bytes_ratio` (target <= 0.6): one sequence of 16 tokens a step (32 picks
  of 32 experts in each block).
- Beside it, the curve over the tokens a step (`TOKENS`): where a minibatch picks every expert,
  streaming saves nothing and costs a read of the picks per micro-batch and block.

How many experts a minibatch picks is the router's: this one is random, and its picks are far
from uniform (the tokens of a random model's sequence have alike hidden states), so 16 tokens
picked about 7 of 32 experts a block where 32 uniform draws would pick 20; a trained router
spreads its tokens otherwise, which only a run on its checkpoint measures.

    .venv/bin/python scripts/bench_experts_by_need.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_lora import make_checkpoint
from benchlib import headline, headline_line

SIZES = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             moe_intermediate_size=688, num_experts=32, num_experts_per_tok=2, vocab_size=8192,
             max_position_embeddings=2048, tie_word_embeddings=False)
RUN = ["strategy=l2l", "adapter=lora", "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]", "data.num_samples=64",
       "optim=adamw", "optim.lr=1e-4", "model.dropout=0.0", "train.steps=3", "train.untimed_steps=1",
       "train.check_memory=false", "train.save_model=false"]
HEADLINE = (1, 16)  # (sequences, tokens each) a step
TOKENS = [(1, 8), HEADLINE, (2, 32), (4, 64), (8, 128)]
TARGET = 0.6


def uploaded(checkpoint: Path, workdir: Path, rows: int, seq_len: int, by_need: bool) -> dict:
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    keys = [f"model.pretrained={checkpoint}", *RUN, f"data.seq_len={seq_len}", f"strategy.microbatch_size={rows}",
            "strategy.num_microbatches=1", f"strategy.experts_by_need={str(by_need).lower()}"]
    results = run(compose_config(keys), workdir / f"{rows}x{seq_len}_{by_need}", table=False)
    report = results["strategy_report"]
    return {"uploaded_bytes": report["uploaded_bytes"], "loss": results["loss"],
            "experts": report.get("experts_by_need")}


def shape(checkpoint: Path, workdir: Path, rows: int, seq_len: int) -> dict:
    whole = uploaded(checkpoint, workdir, rows, seq_len, False)
    streamed = uploaded(checkpoint, workdir, rows, seq_len, True)
    if streamed["loss"] != whole["loss"]:
        raise SystemExit(f"{rows} x {seq_len}: by need trained other losses ({streamed['loss']} vs {whole['loss']})")
    experts = streamed["experts"]
    return {"sequences": rows, "seq_len": seq_len, "tokens": rows * seq_len,
            "step_bytes_ratio": streamed["uploaded_bytes"] / whole["uploaded_bytes"],
            "expert_bytes_ratio": experts["uploaded_bytes"] / experts["whole_bytes"],
            "whole_gib": whole["uploaded_bytes"] / 2**30, "by_need_gib": streamed["uploaded_bytes"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_by_need_") as tmp:
        workdir = Path(tmp)
        checkpoint = make_checkpoint(workdir / "checkpoint", SIZES, "qwen3_moe")
        curve = [shape(checkpoint, workdir, rows, seq_len) for rows, seq_len in TOKENS]
    for point in curve:
        print(f"{point['sequences']} x {point['seq_len']} tokens a step: {point['by_need_gib']:.3f} of "
              f"{point['whole_gib']:.3f} GiB uploaded over the measured steps ({point['step_bytes_ratio']:.3f}; "
              f"experts' bytes {point['expert_bytes_ratio']:.3f})")
    chosen = next(p for p in curve if (p["sequences"], p["seq_len"]) == HEADLINE)
    results = {"curve": curve, "model": SIZES,
               "headlines": {"moe_streamed_expert_bytes_ratio": headline([chosen["step_bytes_ratio"]], TARGET,
                                                                         lower_is_better=True)}}
    print(headline_line("moe_streamed_expert_bytes_ratio", results["headlines"]["moe_streamed_expert_bytes_ratio"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
