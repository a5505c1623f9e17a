"""`make bench`: every benchmark, each in its own process (a clean allocator and thread pool),
then one summary table, each headline beside its target, and the list of the targets missed.
Each script also runs alone; see docs/benchmarks.md.

    python scripts/bench.py [--only baseline,hf_trainer,step_overhead,...,moe,experts_by_need,...,grpo] [--out bench-results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "baseline": HERE / "bench_baseline.py",
    "hf_trainer": HERE / "bench_hf_trainer.py",
    "step_overhead": HERE / "bench_step_overhead.py",
    "l2l": HERE / "bench_l2l.py",
    "pipeline": HERE / "bench_pipeline.py",
    "l2l_scaling": HERE / "bench_l2l_scaling.py",
    "data_parallel": HERE / "bench_data_parallel.py",
    "planner": HERE / "bench_planner.py",
    "axonn": HERE / "bench_axonn.py",
    "compile": HERE / "bench_compile.py",
    "lora": HERE / "bench_lora.py",
    "qlora": HERE / "bench_qlora.py",
    "data_cache": HERE / "bench_data_cache.py",
    "long_context": HERE / "bench_long_context.py",
    "sequence_parallel": HERE / "bench_sequence_parallel.py",
    "moe": HERE / "bench_moe.py",
    "experts_by_need": HERE / "bench_experts_by_need.py",
    "dpo": HERE / "bench_dpo.py",
    "muon": HERE / "bench_muon.py",
    "lowbit": HERE / "bench_lowbit.py",
    "grpo": HERE / "bench_grpo.py",
}
# The comparisons each script reports as a median over its rounds (scripts/benchlib.py), in
# the order of the summary table, with what each compares.
COMPARED = {
    "baseline_vs_plain_loop": "baseline / plain PyTorch loop",
    "baseline_vs_hf_trainer": "baseline / Hugging Face Trainer (bert_base)",
    "compiled_vs_eager": "baseline, train.compile=true / eager (bert_base, after warm-up)",
    "decoder_baseline_vs_hf_trainer": "baseline / Hugging Face Trainer (Llama layout, 8 x 512, GQA 8/2)",
    "step_overhead_share": "baseline step outside the forward, backward and optimizer calls / the step (the same decoder)",
    "l2l_vs_recompute_baseline": "l2l / baseline with recompute",
    "decoder_l2l_vs_recompute_baseline": "l2l / baseline with recompute (the same Llama-layout model)",
    "moe_baseline_vs_hf_trainer": "baseline / Hugging Face Trainer (Qwen3-MoE layout, 8 x 512, 8 experts, top 2)",
    "moe_l2l_vs_recompute_baseline": "l2l / baseline with recompute (the same Qwen3-MoE-layout model)",
    "deepseek_l2l_vs_recompute_baseline": "l2l / baseline with recompute (a DeepSeek-V3 layout of the same size)",
    "eps_vs_fused_adamw": "EPS per-part updates / whole-model fused AdamW",
    "eps_vs_deepspeed_cpu_adam": "EPS per-part updates / whole-model DeepSpeedCPUAdam (where installed)",
    "eps_exposed_share": "EPS work exposed after overlap with backward",
    "lora_l2l_host_bytes_ratio": "l2l host memory, adapter=lora / full fine-tuning (bf16 Llama layout)",
    "lora_l2l_vs_full_l2l": "l2l samples/s, adapter=lora / full fine-tuning (the same model and batch)",
    "qlora_l2l_host_bytes_ratio": "l2l host bytes of the base, adapter=qlora (NF4) / adapter=lora (bf16), Llama-3-70B / 16",
    "qlora_l2l_vs_lora_l2l": "l2l samples/s, adapter=qlora (NF4 base) / adapter=lora (bf16 base)",
    "moe_streamed_expert_bytes_ratio": "l2l weight bytes uploaded a step, experts by need / whole (LoRA, Qwen3-MoE layout, 32 experts top 2, 1 x 16 tokens)",
    "moe_qlora_host_bytes_ratio": "l2l host bytes of the base, adapter=qlora / adapter=lora, experts in NF4 too (Qwen3-30B-A3B / 8)",
    "flush_vs_torch_1f1b": "pipe_flush / torch Schedule1F1B (d = 2, m = 4)",
    "2bw_vs_flush_of_formula": "(pipe_2bw / pipe_flush at m = d, 8 blocks) / bubble formula",
    "interleaved_vs_flush": "pipe_interleaved (d = 2, v = 2, m = 4) / pipe_flush (d = 2, m = 4)",
    "balanced_vs_even_layout": "pipe_flush, balanced / even layout (gpt2_tiny, 8 blocks, d = 2)",
    "baseline_replicas_scaling": "baseline, 2 replicas / (2 x one worker)",
    "fsdp_vs_baseline_replicas": "fsdp / baseline, 2 replicas each",
    "fsdp_no_reshard_vs_baseline_replicas": "fsdp without resharding / baseline, 2 replicas each",
    "md_vs_static_gpipe_jitter": "GPipe d = 2, stage 0 jittered: message-driven / static",
    "md_vs_static_gpipe_even": "GPipe d = 2, no jitter: message-driven / static",
    "md_vs_static_flush_jitter": "1F1B d = 3, stage 1 jittered: message-driven / static",
    "md_vs_static_flush_even": "1F1B d = 3, no jitter: message-driven / static",
    "offload_exposed_pipe_2bw": "pipe_2bw offload=host: exposed update / step, worst stage",
    "offload_exposed_pipe_flush": "pipe_flush offload=host: exposed update / step, worst stage",
    "l2l_replicas_scaling": "l2l, 2 replicas / (2 x one worker)",
    "plan_worst_error": "plan: worst |predicted / measured step - 1| of a round",
    "chunked_loss_vs_full": "baseline samples/s, loss in chunks of tokens / whole-sequence logits (128 k vocabulary, 2 x 1,024 tokens)",
    "long_context_peak_vs_hf_trainer": "peak memory, baseline with recompute=block / Hugging Face Trainer with gradient checkpointing (128 k vocabulary, 1 x 4,096 tokens)",
    "sequence_parallel_scaling": "tokens/s, 2 workers each holding half of one 4,096-token sequence / 2 x one worker's",
    "data_cache_prepare_ratio": "prepare_s, second identical start / first (tokenize cache, 100 k chat records)",
    "dpo_vs_trl": "DPO pairs/s, baseline / TRL's DPOTrainer (Llama layout, reference precomputed on both sides)",
    "dpo_l2l_vs_recompute_baseline": "DPO pairs/s, l2l / baseline with recompute (reference cached)",
    "dpo_lora_vs_sft_lora": "tokens/s under l2l, LoRA DPO / LoRA SFT on the same rows",
    "muon_l2l_vs_adamw_l2l": "samples/s under l2l, optim=muon / optim=adamw (Llama layout, 4 x 512)",
    "lowbit_host_bytes_ratio": "l2l EPS host bytes, 8-bit states + bf16 masters / fp32 (Llama layout, 4 x 512, cmp_bf16)",
    "lowbit_eps_vs_fp32_eps": "l2l samples/s, 8-bit states + bf16 masters / fp32 (the same run)",
    "grpo_vs_trl": "s per GRPO step, TRL's GRPOTrainer / baseline (Llama layout, 4 x 256, G = 8, 48-token completions)",
    "rollout_vs_hf_generate": "completion tokens/s, relaytrain's rollout engine / model.generate (the same batch)",
    "grpo_l2l_vs_baseline": "s per GRPO step, baseline / l2l (the same model and batch)",
}
def run(name: str, script: Path, workdir: Path) -> dict:
    out = workdir / f"{name}.json"
    start = time.perf_counter()
    subprocess.run([sys.executable, str(script), "--json", str(out)], check=True)
    print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
    return json.loads(out.read_text())


def medians_table(headlines: dict) -> Table:
    table = Table(title="relaytrain benchmarks: median of each comparison's rounds (idle machine assumed)")
    for column in ("comparison", "median", "best", "spread", "rounds", "target", "met"):
        table.add_column(column)
    for key, what in COMPARED.items():
        if key not in headlines:
            continue
        h = headlines[key]
        low, high = h["spread"]
        table.add_row(what, f"{h['median']:.3f}", f"{h['best']:.3f}", f"{low:.3f}-{high:.3f}", str(len(h["rounds"])),
                      f"{'<' if h['lower_is_better'] else '>='} {h['target']}", "yes" if h["met"] else "no")
    return table


def missed_line(headlines: dict) -> str:
    """The headlines whose median misses its target, each with both, or that none does."""
    missed = [f"{key} {h['median']:.3f} ({'<' if h['lower_is_better'] else '>='} {h['target']})"
              for key, h in headlines.items() if not h["met"]]
    return f"targets missed ({len(missed)} of {len(headlines)}): " + "; ".join(missed) if missed else \
        f"every target met ({len(headlines)} headlines)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--out", help="write every result to this JSON file")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.only.split(","):
            results[name] = run(name, BENCHMARKS[name], Path(workdir))
    headlines = {key: h for result in results.values() for key, h in result.get("headlines", {}).items()}
    Console().print(medians_table(headlines))
    print(missed_line(headlines))
    if args.out:
        Path(args.out).write_text(json.dumps({"headlines": headlines, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
