"""A mixture of experts: relaytrain's baseline against Hugging Face's Trainer, and L2L against the
recompute baseline on a Qwen3-MoE layout (issue 38's two headlines) and on a DeepSeek-V3 layout
(issue 57's).

The model is a Qwen3-MoE layout (`MOE`): benchlib.DECODER's 8 blocks of hidden 512 with
grouped-query attention 8/2, each MLP a router over 8 SwiGLU experts of width 688 with 2 routed
per token, so a token's active MLP width is DECODER's 1,376 while the blocks hold four times its
MLP weights; the router's balancing loss on (coefficient 0.001, as Qwen3-MoE's checkpoints).
Each comparison is its own script's, run on this model:

- `moe_baseline_vs_hf_trainer` (target >= 1.05): `bench_hf_trainer.compare`, both tools in fresh
  processes, alternating rounds, the same samples, optimizer and batch. The two losses differ by
  convention only: relaytrain averages the aux term over the micro-batches, Trainer sums it over
  its accumulation steps (docs/design.md); the work of a step is the same.
- `moe_l2l_vs_recompute_baseline` (target >= 0.95): `bench_l2l.compare_steps`, both strategies in
  one process, ABBA rounds of one step each on the same minibatches. L2L uploads every expert of a
  block while its work is the active ones only, so this is where a mixture costs L2L most.
- `deepseek_l2l_vs_recompute_baseline` (target >= 0.95): the same comparison on a DeepSeek-V3
  layout (`DEEPSEEK`): the same depth, width, experts and vocabulary, with multi-head latent
  attention (queries through a rank-256 bottleneck, keys and values from a latent of 128 plus a
  32-wide rotary key), the first block dense, a shared expert beside the routed ones, sigmoid
  scores with a balancing bias over 2 expert groups, and YaRN rotary scaling to 163,840 positions
  as published.

    .venv/bin/python scripts/bench_moe.py [--only NAME,...] [--quick] [--json out.json]

Trainer needs accelerate: `pip install -e '.[bench]'` (`make bench` installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from types import SimpleNamespace

import torch

import bench_hf_trainer
import bench_l2l
from benchlib import headline, headline_line
from relaytrain.run.launch import keep_freed_host_memory

MOE = ["model=qwen3_30b_a3b", "model.num_layers=8", "model.hidden_size=512", "model.num_heads=8",
       "model.num_kv_heads=2", "model.head_dim=64", "model.num_experts=8", "model.experts_per_token=2",
       "model.expert_intermediate_size=688", "model.vocab_size=8192", "model.max_seq_len=2048",
       "model.output_router_logits=true", "model.router_aux_loss_coef=0.001", "model.dropout=0.0"]
DEEPSEEK = ["model=deepseek_v3_671b", "model.num_layers=8", "model.hidden_size=512", "model.num_heads=8",
            "model.num_kv_heads=8", "model.head_dim=32", "model.intermediate_size=1376", "model.num_experts=8",
            "model.experts_per_token=2", "model.expert_intermediate_size=688", "model.vocab_size=8192",
            "model.architecture.first_k_dense_replace=1", "model.architecture.n_group=2",
            "model.architecture.topk_group=1", "model.architecture.q_lora_rank=256",
            "model.architecture.kv_lora_rank=128", "model.architecture.qk_rope_head_dim=32",
            "model.architecture.qk_nope_head_dim=32", "model.architecture.v_head_dim=64"]
QUICK_DEEPSEEK = [*DEEPSEEK, "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                  "model.num_kv_heads=4", "model.head_dim=8", "model.intermediate_size=64",
                  "model.expert_intermediate_size=32", "model.vocab_size=512", "model.architecture.q_lora_rank=32",
                  "model.architecture.kv_lora_rank=16", "model.architecture.qk_rope_head_dim=8",
                  "model.architecture.qk_nope_head_dim=8", "model.architecture.v_head_dim=16"]
QUICK_MOE = [*MOE, "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.head_dim=16",
             "model.expert_intermediate_size=32", "model.vocab_size=512"]
BATCH = {"seq_len": 128, "microbatch_size": 2, "microbatches": 4}
QUICK_BATCH = {"seq_len": 32, "microbatch_size": 2, "microbatches": 2}
RUNS = {"trainer": {"rounds": 5, "steps": 5, "warmup": 2}, "l2l": {"rounds": 10, "warmup": 1}}
QUICK_RUNS = {"trainer": {"rounds": 1, "steps": 2, "warmup": 1}, "l2l": {"rounds": 2, "warmup": 1}}
COMPARISONS = ("moe_baseline_vs_hf_trainer", "moe_l2l_vs_recompute_baseline", "deepseek_l2l_vs_recompute_baseline")


def against_trainer(model: list[str], batch: dict, runs: dict) -> dict:
    """relaytrain's baseline / Trainer on the mixture (bench_hf_trainer's comparison)."""
    overrides = [*model, f"data.seq_len={batch['seq_len']}", f"strategy.microbatch_size={batch['microbatch_size']}",
                 f"strategy.num_microbatches={batch['microbatches']}"]
    return bench_hf_trainer.compare("moe_baseline_vs_hf_trainer", overrides, **runs)


def against_recompute_baseline(key: str, model: list[str], batch: dict, runs: dict) -> dict:
    """l2l / the baseline with recompute on a mixture (bench_l2l's step comparison, its defaults
    otherwise: AdamW, fp32, the CPU), reported as headline `key`."""
    args = SimpleNamespace(**batch, optim="adamw", precision="fp32", device="cpu", warmup=runs["warmup"])
    _, results = bench_l2l.compare_steps(args, model, runs["rounds"], torch.device("cpu"))
    results["headlines"] = {key: headline(results["throughput_ratio_per_round"], bench_l2l.TARGET)}
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(COMPARISONS), help="the comparisons to run, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny mixture, one or two short rounds")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(COMPARISONS))
    if unknown:
        parser.error(f"--only: no comparison {', '.join(unknown)}; choose from {', '.join(COMPARISONS)}")
    return args


def main() -> None:
    keep_freed_host_memory()  # as every relaytrain process does (the launcher's setting)
    args = parse_args()
    wanted = args.only.split(",")
    if "moe_baseline_vs_hf_trainer" in wanted and importlib.util.find_spec("accelerate") is None:
        sys.exit("bench_moe: transformers.Trainer needs accelerate: pip install -e '.[bench]' (make bench does)")
    model, deepseek, batch, runs = ((QUICK_MOE, QUICK_DEEPSEEK, QUICK_BATCH, QUICK_RUNS) if args.quick
                                    else (MOE, DEEPSEEK, BATCH, RUNS))
    results = {}
    if "moe_baseline_vs_hf_trainer" in wanted:
        results["hf_trainer"] = against_trainer(model, batch, runs["trainer"])
    if "moe_l2l_vs_recompute_baseline" in wanted:
        results["l2l"] = against_recompute_baseline("moe_l2l_vs_recompute_baseline", model, batch, runs["l2l"])
    if "deepseek_l2l_vs_recompute_baseline" in wanted:
        results["deepseek_l2l"] = against_recompute_baseline("deepseek_l2l_vs_recompute_baseline", deepseek, batch,
                                                             runs["l2l"])
    headlines = {key: h for result in results.values() for key, h in result["headlines"].items()}
    for key, h in headlines.items():
        print(headline_line(key, h) + f", target >= {h['target']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "headlines": headlines}, f, indent=2)


if __name__ == "__main__":
    main()
