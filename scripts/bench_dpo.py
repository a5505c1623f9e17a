"""DPO: relaytrain against TRL's DPOTrainer, L2L against the baseline, LoRA DPO against LoRA SFT.

A float32 checkpoint of the Llama layout (made here by save_pretrained, with a byte-level BPE
tokenizer and a chat template) trains on preference pairs whose prompt and replies fill every
row to data.seq_len (TRL pads a batch to its longest row, relaytrain to data.seq_len: rows that
are all full make the work equal). Each contestant runs in a process of its own, in alternating
order, and the reference's log-probs are computed before training on both sides (TRL's
`precompute_ref_log_probs=True`; relaytrain's reference pass, cached by a warm-up run), so the
timed steps are the policy's alone. Headlines (median over rounds):

- `dpo_vs_trl`: pairs/s, relaytrain baseline / TRL's DPOTrainer (AdamW, fp32), target >= 1.05;
- `dpo_l2l_vs_recompute_baseline`: pairs/s, l2l / baseline with recompute=block, target >= 0.95;
- `dpo_lora_vs_sft_lora`: tokens/s of a LoRA DPO step / a LoRA SFT step on the same rows, under
  l2l (the SFT run trains on every chosen and rejected row as a conversation of its own), target >= 0.6.

    .venv/bin/python scripts/bench_dpo.py --json bench_dpo.json [--rounds 3] [--only dpo_vs_trl]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchlib import (
    alternating_rounds,
    chat_llama_checkpoint,
    child_run,
    contest_args,
    contest_dirs,
    headline,
    report,
    step_timer,
)

HERE = Path(__file__).resolve().parent
SIZES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1376, vocab_size=4096, max_position_embeddings=256)
SEQ, MICROBATCH, ACCUMULATE, PAIRS = 128, 4, 2, 64
COMPARISONS = ("dpo_vs_trl", "dpo_l2l_vs_recompute_baseline", "dpo_lora_vs_sft_lora")
# What each comparison runs: its two contestants, numerator first.
CONTESTS = {
    "dpo_vs_trl": ("relaytrain:baseline", "trl"),
    "dpo_l2l_vs_recompute_baseline": ("relaytrain:l2l", "relaytrain:baseline_recompute"),
    "dpo_lora_vs_sft_lora": ("relaytrain:l2l_lora", "relaytrain:l2l_lora_sft"),
}
STRATEGIES = {
    "baseline": ["strategy=baseline"], "baseline_recompute": ["strategy=baseline", "strategy.recompute=block"],
    "l2l": ["strategy=l2l"], "l2l_lora": ["strategy=l2l", "adapter=lora"],
    "l2l_lora_sft": ["strategy=l2l", "adapter=lora"],
}


def parse_args():
    return contest_args(__doc__, ("CONTESTANT", "WORKDIR"), steps=5, untimed="the first is",
                        comparisons=COMPARISONS, rounds=3)


def make_inputs(workdir: Path) -> None:
    """The checkpoint, its tokenizer, the pairs (jsonl) and the same rows as conversations (SFT)."""
    chat_llama_checkpoint(workdir / "checkpoint", SIZES)
    words = "the quick brown fox jumps over the lazy dog and what is the capital of france".split()
    pairs, chats = [], []
    for i in range(PAIRS):
        text = " ".join(words[(i + k) % len(words)] for k in range(200))  # longer than any row: every row is full
        prompt, chosen, rejected = f"Question {i}: {text[:120]}", f" Yes: {text}", f" No: {text[::-1]}"
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        for reply in (chosen, rejected):
            chats.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]})
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (workdir / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))


def relaytrain_child(name: str, workdir: Path, run_dir: Path, steps: int) -> dict:
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    sft = name.endswith("_sft")
    data = ["data=chat", f"data.path={workdir / 'chats.jsonl'}"] if sft else [
        "data=preference", f"data.path={workdir / 'pairs.jsonl'}", "objective=dpo"]
    microbatch = MICROBATCH * 2 if sft else MICROBATCH  # the same rows a micro-batch: 2 a pair
    given = [f"model.pretrained={workdir / 'checkpoint'}", *data, f"data.seq_len={SEQ}", "data.shuffle=false",
             f"data.cache_dir={workdir / 'cache'}", "model.dropout=0.0", *STRATEGIES[name],
             f"strategy.microbatch_size={microbatch}", f"strategy.num_microbatches={ACCUMULATE}", "optim=adamw",
             "optim.lr=1e-5", f"train.steps={steps}", "train.untimed_steps=1", "train.check_memory=false"]
    results = run(resolve(compose_config(given), given), run_dir, table=False, quiet=True)
    rows_per_s = results["throughput"]["samples_per_s"] * (1 if sft else 2)  # a DPO sample is a pair: two rows
    return {"pairs_per_s": rows_per_s / 2, "tokens_per_s": rows_per_s * SEQ}


def trl_child(workdir: Path, run_dir: Path, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    records = [json.loads(line) for line in (workdir / "pairs.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32)
    arguments = DPOConfig(
        output_dir=str(run_dir), per_device_train_batch_size=MICROBATCH, gradient_accumulation_steps=ACCUMULATE,
        max_steps=steps, learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[],
        save_strategy="no", max_length=SEQ, bf16=False, use_cpu=True, disable_tqdm=True, logging_steps=1000,
        train_sampling_strategy="sequential", precompute_ref_log_probs=True, gradient_checkpointing=False,
        optim="adamw_torch", adam_epsilon=1e-6)
    timer = step_timer()
    trainer = DPOTrainer(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                         processing_class=AutoTokenizer.from_pretrained(workdir / "checkpoint"), callbacks=[timer])
    trainer.train()
    step_s = statistics.mean(timer.times[1:])
    return {"pairs_per_s": MICROBATCH * ACCUMULATE / step_s, "tokens_per_s": 2 * MICROBATCH * ACCUMULATE * SEQ / step_s}


def child(contestant: str, workdir: str, run_dir: str, steps: int) -> None:
    run_dir, workdir = Path(run_dir), Path(workdir)
    run_dir.mkdir(parents=True, exist_ok=True)
    kind, _, name = contestant.partition(":")
    figures = trl_child(workdir, run_dir, steps) if kind == "trl" else relaytrain_child(name, workdir, run_dir, steps)
    (run_dir / "bench.json").write_text(json.dumps(figures))


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    chosen = args.only.split(",")
    with contest_dirs() as (workdir, runs, load):
        make_inputs(workdir)
        # A warm-up: the tokenize caches and the reference's log-probs, so that no timed run makes them.
        for warm in ("relaytrain:baseline", "relaytrain:l2l_lora", "relaytrain:l2l_lora_sft"):
            child_run(__file__, 1, [warm, str(workdir)], runs, "warmup")
        contestants = sorted({c for name in chosen for c in CONTESTS[name]})
        rounds = alternating_rounds(contestants, args.rounds,
                                    lambda c: child_run(__file__, args.steps, [c, str(workdir)], runs, c.replace(":", "-")))
    figure = {"dpo_lora_vs_sft_lora": "tokens_per_s"}
    headlines, target = {}, {"dpo_vs_trl": 1.05, "dpo_l2l_vs_recompute_baseline": 0.95, "dpo_lora_vs_sft_lora": 0.6}
    for name in chosen:
        top, bottom = CONTESTS[name]
        key = figure.get(name, "pairs_per_s")
        headlines[name] = headline([r[top][key] / r[bottom][key] for r in rounds], target[name])
    results = {"command": f"python scripts/bench_dpo.py --rounds {args.rounds} --steps {args.steps}",
               "model": SIZES, "seq_len": SEQ, "microbatch": MICROBATCH, "accumulate": ACCUMULATE,
               "rounds": rounds, "other_load_cores": load.cores, "headlines": headlines}
    report(results, args.json)


if __name__ == "__main__":
    main()
