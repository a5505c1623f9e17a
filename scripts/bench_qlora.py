"""QLoRA under L2L against LoRA under L2L: the base's host memory and throughput.

Bf16 checkpoints of the Llama layout (made here by save_pretrained, as users' checkpoints are)
are fine-tuned or built under `strategy=l2l`, each in a process of its own, twice: `adapter=qlora`
(LoRA over the blocks' linear weights quantized to NF4 at load) and `adapter=lora` (the same LoRA
over the bf16 base), same model, minibatch and optimizer. A process measures the frozen base the
L2L strategy's eager param server holds on the host: the bytes of every storage of its parts'
frozen tensors (NF4 codes and scales, the bf16 embeddings, norms and head), and the resident set
the build added (after `malloc_trim`, so what loading freed is not counted); beside them the
planner's closed form (`ModelFacts.frozen_host_bytes`). Headlines:

- `qlora_l2l_host_bytes_ratio`: the base's host bytes, NF4 / bf16 (target <= 0.35), of the model
  the issue is named for, Llama-3-70B, with every width cut by 16 and its depth kept (`SEVENTY_B`:
  80 blocks, 267 M parameters; the ratio depends on the model's proportions only). Built once
  each (the bytes of a build are exact; nothing is trained).
- `qlora_l2l_vs_lora_l2l`: samples/s, NF4 base / bf16 base, median over alternating rounds of
  training runs (target >= 0.8), on a model of Llama-3-8B's proportions (`SIZES`).
- `moe_qlora_host_bytes_ratio`: the same bytes ratio (target <= 0.35) of a mixture, Qwen3-30B-A3B
  with every width cut by 8 and its depth and 128 experts kept (`THIRTY_B_A3B`: 48 blocks, 478 M
  parameters), whose fused experts (97 % of a block) are held in NF4 too. Built once each.

The bytes ratio is set by how much of the base is the blocks' linear weights (4.5 bits a weight
under NF4) against the embeddings, norms and head (kept in bf16 in both runs, as bitsandbytes
keeps them): 3 % of Llama-3-70B's bf16 base, 13 % of Llama-3-8B's (2 x 128256 x 4096 of 8.03 B
values). The ratio of the training runs' model, Llama-3-8B's proportions at 1/32 of its width, is
reported beside the headline (`host_bytes_ratio_8b_proportions`; closed form 0.377, Llama-3-8B's
own 0.375): no model of those proportions reaches 0.35 while its ends stay bf16.

    .venv/bin/python scripts/bench_qlora.py --json bench_qlora.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

from bench_lora import RUN, make_checkpoint
from bench_lora import SIZES as LORA_SIZES
from benchlib import alternating_rounds, child_run, contest_args, contest_dirs, headline, headline_line

ADAPTERS = ("qlora", "lora")
# Llama-3-8B's proportions at 1/32 of its width (see the module): bench_lora's 8 blocks of hidden
# 1024, GQA 16/4 and an untied 8k vocabulary, with Llama's MLP of 3.5 x hidden (126 M parameters).
SIZES = {**LORA_SIZES, "intermediate_size": 3584}
# Llama-3-70B with every width / 16 and its depth: hidden 8192 -> 512, MLP 28672 -> 1792, 64 heads
# and 8 KV heads of 128 -> 8 and 1 of 64 (the same 8:1 grouping), vocabulary 128256 -> 8016.
SEVENTY_B = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=80, num_attention_heads=8,
                 num_key_value_heads=1, vocab_size=8016, tie_word_embeddings=False)
# Qwen3-30B-A3B with every width / 8 and its depth and experts: hidden 2048 -> 256, expert MLP 768 -> 96
# (the dense MLP 6144 -> 768 is never built: every layer routes), 32 query and 4 KV heads of 128 -> of 16,
# vocabulary 151936 -> 18992; 128 experts, 8 a token.
THIRTY_B_A3B = dict(hidden_size=256, moe_intermediate_size=96, intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=16, vocab_size=18992, num_experts=128,
                    num_experts_per_tok=8, tie_word_embeddings=False)
BUILD_ONLY = 0  # --steps of a child that builds the strategy and trains nothing


def parse_args() -> argparse.Namespace:
    return contest_args(__doc__, ("CHECKPOINT", "ADAPTER"), steps=4, untimed="the first is")


def resident_bytes() -> tuple[int, int]:
    """This process's resident set and its anonymous part, after handing glibc's freed pages back
    to the kernel. The rest is file pages: the checkpoint's safetensors, mapped by the loader and
    kept mapped while a tensor of it lives (the bf16 embeddings and head do), which the kernel
    takes back when it needs the memory. Under QLoRA they are every block weight the quantizer
    read; the anonymous part is what a machine must really hold."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fields = dict(line.split()[:2] for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Rss:"]) * 1024, int(fields["Anonymous:"]) * 1024


def base_on_the_host(cfg) -> tuple[int, int, int]:
    """The frozen base the L2L strategy's eager param server holds (bytes of its storages), and the
    resident set building the strategy added, all of it and its anonymous part."""
    from relaytrain.models import build_model
    from relaytrain.strategies import build_strategy, strategy_class

    before = resident_bytes()
    model = build_model(cfg.model, adapter=cfg.adapter, quiet=True, compact_base=strategy_class("l2l").compact_base)
    strategy = build_strategy(model, cfg)
    try:
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                    for part in strategy.eps.parts for t in part.frozen}
        del model
        after = resident_bytes()
        return sum(storages.values()), after[0] - before[0], after[1] - before[1]
    finally:
        strategy.close()


def child(checkpoint: str, adapter: str, run_dir: str, steps: int) -> None:
    """One run in this process, then the base its strategy holds."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    given = [f"model.pretrained={checkpoint}", f"adapter={adapter}", *RUN, f"train.steps={steps}",
             "train.untimed_steps=1"]
    cfg = resolve(compose_config(given), given)
    results = run(cfg, Path(run_dir), table=False) if steps != BUILD_ONLY else None
    base_bytes, built_rss, built_anonymous = base_on_the_host(cfg)
    out = {"base_bytes": base_bytes, "built_rss_bytes": built_rss, "built_anonymous_bytes": built_anonymous,
           "closed_form_base_bytes": ModelFacts.of(cfg).frozen_host_bytes}
    if results is not None:
        out.update(samples_per_s=results["throughput"]["samples_per_s"],
                   peak_rss_bytes=results["memory"]["host_peak_rss_bytes"])
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # a build-only child ran nothing that made it
    Path(run_dir, "bench.json").write_text(json.dumps(out))


def one_run(checkpoint: Path, adapter: str, workdir: Path, steps: int) -> dict:
    return child_run(__file__, steps, [str(checkpoint), adapter], workdir, adapter)


def ratio(pair: dict, key: str) -> float:
    """NF4's figure over bf16's, of one round or build."""
    return pair["qlora"][key] / pair["lora"][key]


def described(adapter: str, f: dict) -> str:
    return (f"{adapter}: base {f['base_bytes'] / 2**20:.1f} MiB held ({f['built_rss_bytes'] / 2**20:.0f} MiB of "
            f"resident set built, {f['built_anonymous_bytes'] / 2**20:.0f} MiB of it anonymous, the rest the "
            f"checkpoint's file pages), {f['closed_form_base_bytes'] / 2**20:.1f} MiB closed form")


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    with contest_dirs() as (workdir, runs, load):
        checkpoint = make_checkpoint(workdir / "checkpoint", SIZES)
        rounds = alternating_rounds(ADAPTERS, args.rounds, lambda adapter: one_run(checkpoint, adapter, runs, args.steps))
        seventy = make_checkpoint(workdir / "seventy_b", SEVENTY_B)
        built = {adapter: one_run(seventy, adapter, runs, BUILD_ONLY) for adapter in ADAPTERS}
        mixture = make_checkpoint(workdir / "thirty_b_a3b", THIRTY_B_A3B, "qwen3_moe")
        moe_built = {adapter: one_run(mixture, adapter, runs, BUILD_ONLY) for adapter in ADAPTERS}
    speed = [r["qlora"]["samples_per_s"] / r["lora"]["samples_per_s"] for r in rounds]
    results = {
        "command": "python scripts/bench_qlora.py " + f"--rounds {args.rounds} --steps {args.steps}",
        "model": {**SIZES, "checkpoint_dtype": "bfloat16"}, "run": RUN, "rounds": rounds,
        "host_bytes_model": {**SEVENTY_B, "checkpoint_dtype": "bfloat16"}, "host_bytes_builds": built,
        "closed_form_ratio": ratio(built, "closed_form_base_bytes"),
        "moe_host_bytes_model": {**THIRTY_B_A3B, "model_type": "qwen3_moe", "checkpoint_dtype": "bfloat16"},
        "moe_host_bytes_builds": moe_built, "moe_closed_form_ratio": ratio(moe_built, "closed_form_base_bytes"),
        "host_bytes_ratio_8b_proportions": ratio(rounds[0], "base_bytes"),  # storage bytes: the same every round
        "closed_form_ratio_8b_proportions": ratio(rounds[0], "closed_form_base_bytes"),
        "other_load_cores": load.cores,
        "headlines": {"qlora_l2l_host_bytes_ratio": headline([ratio(built, "base_bytes")], 0.35, lower_is_better=True),
                      "qlora_l2l_vs_lora_l2l": headline(speed, 0.8),
                      "moe_qlora_host_bytes_ratio": headline([ratio(moe_built, "base_bytes")], 0.35,
                                                             lower_is_better=True)},
    }
    for name, h in results["headlines"].items():
        print(headline_line(name, h))
    print(f"  Llama-3-70B / 16 (built): closed-form ratio {results['closed_form_ratio']:.3f}")
    for adapter in ADAPTERS:
        print("    " + described(adapter, built[adapter]))
    print(f"  Qwen3-30B-A3B / 8 (built): closed-form ratio {results['moe_closed_form_ratio']:.3f}")
    for adapter in ADAPTERS:
        print("    " + described(adapter, moe_built[adapter]))
    print(f"  Llama-3-8B's proportions (trained): bytes ratio {results['host_bytes_ratio_8b_proportions']:.3f}, "
          f"closed form {results['closed_form_ratio_8b_proportions']:.3f}")
    for adapter in ADAPTERS:
        print("    " + described(adapter, rounds[0][adapter]) + f"; {rounds[0][adapter]['samples_per_s']:.2f} samples/s")
    print(f"  other processes kept {load.cores:.2f} cores busy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
