"""GRPO: relaytrain against TRL's GRPOTrainer, its rollout engine against `model.generate`, L2L
against the baseline.

A float32 checkpoint of the Llama layout (made here by save_pretrained, with a byte-level BPE
tokenizer and a chat template) whose vocabulary is larger than its tokenizer's, so its end token
is drawn about once in 4096 tokens: every completion runs to max_completion_length on both
sides, and the contestants do the same work. Prompts are short questions; the reward is the
completion's length in characters (a function of TRL's signature). Each contestant runs in a
process of its own, in alternating order. Headlines (median over rounds):

- `grpo_vs_trl`: seconds per GRPO step (sampling, scoring and the update), TRL / relaytrain
  baseline, the same model, G, lengths, reward and AdamW; TRL samples with transformers'
  `generate` (no vLLM). Target >= 1.05.
- `rollout_vs_hf_generate`: completion tokens/s, relaytrain's engine (keyed sampling, KV cache) /
  `model.generate(do_sample=True)` with its KV cache, the same batch of prompts. Target >= 1.0.
- `grpo_l2l_vs_baseline`: seconds per GRPO step, baseline / l2l. Target >= 0.8.

    .venv/bin/python scripts/bench_grpo.py --json bench_grpo.json [--rounds 3] [--only grpo_vs_trl]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
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
SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=688, vocab_size=4096, max_position_embeddings=256)
PROMPTS, G, ACCUMULATE, LENGTH, SEQ = 2, 8, 2, 48, 80
COMPARISONS = ("grpo_vs_trl", "rollout_vs_hf_generate", "grpo_l2l_vs_baseline")
CONTESTS = {  # each comparison's two contestants, numerator first, and the figure compared
    "grpo_vs_trl": ("trl", "relaytrain:baseline", "step_s"),
    "rollout_vs_hf_generate": ("engine", "generate", "tokens_per_s"),
    "grpo_l2l_vs_baseline": ("relaytrain:baseline", "relaytrain:l2l", "step_s"),
}
TARGETS = {"grpo_vs_trl": 1.05, "rollout_vs_hf_generate": 1.0, "grpo_l2l_vs_baseline": 0.8}


def length_reward(prompts, completions, **kwargs):
    """The completion's length in characters over 100: a reward that differs within every group."""
    return [len(c) / 100 for c in completions]


def parse_args():
    return contest_args(__doc__, ("CONTESTANT", "WORKDIR"), steps=6, untimed="the first is",
                        comparisons=COMPARISONS, rounds=3)


def make_inputs(workdir: Path) -> None:
    """The checkpoint, its tokenizer and the prompts (jsonl)."""
    chat_llama_checkpoint(workdir / "checkpoint", SIZES)
    prompts = [{"prompt": f"What is {i} plus {2 * i}? Think it over.", "answer": str(3 * i)} for i in range(64)]
    (workdir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


def relaytrain_child(name: str, workdir: Path, run_dir: Path, steps: int) -> dict:
    from relaytrain.models.pretrained import resolve
    from relaytrain.records.runlog import read_metrics
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    given = [f"model.pretrained={workdir / 'checkpoint'}", "data=prompts", f"data.path={workdir / 'prompts.jsonl'}",
             f"data.seq_len={SEQ}", "data.shuffle=false", f"data.cache_dir={workdir / 'cache'}", "objective=grpo",
             f"objective.num_generations={G}", f"objective.max_completion_length={LENGTH}",
             "objective.rewards=[bench_grpo:length_reward]", f"strategy={name}", f"strategy.microbatch_size={PROMPTS}",
             f"strategy.num_microbatches={ACCUMULATE}", "optim=adamw", "optim.lr=1e-5", f"train.steps={steps}",
             "train.untimed_steps=1", "train.check_memory=false"]
    cfg = resolve(compose_config(given), given)
    run(cfg, run_dir, table=False, quiet=True)
    rows = read_metrics(run_dir)[1:] or read_metrics(run_dir)  # the first step is untimed (a warm-up has one)
    step_s = statistics.mean(r["step_time_s"] + r["rollout_s"] for r in rows)
    return {"step_s": step_s, "rollout_s": statistics.mean(r["rollout_s"] for r in rows),
            "predicted_rollout_s": predicted_rollout_s(cfg),
            "completion_tokens": statistics.mean(r["completions/mean_length"] for r in rows)}


def predicted_rollout_s(cfg) -> float:
    """The planner's rollout batch for `cfg` on this machine: its profile measured here, as
    `relaytrain plan` measures it (a decoded token timed), then `planner.sampling.sampling_for`."""
    import torch

    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.cost.profile import measure
    from relaytrain.planner.sampling import sampling_for, time_decode
    from relaytrain.run.resolve import choose

    facts = ModelFacts.of(cfg)
    profile = measure(cfg, [facts.rows(cfg.strategy.microbatch_size)], [1], torch.device("cpu"), time_decode)
    return sampling_for(cfg, choose(cfg).strategy, facts, profile, 1, None).batch_s


def trl_child(workdir: Path, run_dir: Path, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    records = [json.loads(line) for line in (workdir / "prompts.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32)
    arguments = GRPOConfig(
        output_dir=str(run_dir), per_device_train_batch_size=PROMPTS * G, gradient_accumulation_steps=ACCUMULATE,
        num_generations=G, max_completion_length=LENGTH, max_steps=steps, learning_rate=1e-5,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no", bf16=False, use_cpu=True,
        disable_tqdm=True, logging_steps=1000, shuffle_dataset=False, optim="adamw_torch", adam_epsilon=1e-6)
    timer = step_timer()
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=arguments,
                          train_dataset=Dataset.from_list(records),
                          processing_class=AutoTokenizer.from_pretrained(workdir / "checkpoint"), callbacks=[timer])
    trainer.train()
    return {"step_s": statistics.mean(timer.times[1:])}


def sampling_child(name: str, workdir: Path, steps: int) -> dict:
    """Completion tokens/s of one batch (PROMPTS x G sequences, LENGTH tokens each), timed `steps`
    times after one untimed run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relaytrain.rollout.sampling import Sampling, sample, sample_key

    model = AutoModelForCausalLM.from_pretrained(workdir / "checkpoint", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(workdir / "checkpoint")
    records = [json.loads(line) for line in (workdir / "prompts.jsonl").read_text().splitlines()]
    prompts = [tok(r["prompt"])["input_ids"] for r in records[:PROMPTS * ACCUMULATE] for _ in range(G)]
    keys = [sample_key(0, 0, i // G, i % G) for i in range(len(prompts))]

    def engine():
        return sample(model, prompts, keys, Sampling(), LENGTH, set(), tok.pad_token_id, torch.device("cpu"))

    def generate():
        torch.manual_seed(0)
        tok.padding_side = "left"
        batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
        with torch.no_grad():
            return model.generate(**batch, do_sample=True, max_new_tokens=LENGTH, min_new_tokens=LENGTH,
                                  top_k=0, pad_token_id=tok.pad_token_id)

    once = engine if name == "engine" else generate
    once()
    start = time.perf_counter()
    for _ in range(steps):
        once()
    return {"tokens_per_s": steps * len(prompts) * LENGTH / (time.perf_counter() - start)}


def child(contestant: str, workdir: str, run_dir: str, steps: int) -> None:
    run_dir, workdir = Path(run_dir), Path(workdir)
    run_dir.mkdir(parents=True, exist_ok=True)
    kind, _, name = contestant.partition(":")
    if kind == "trl":
        figures = trl_child(workdir, run_dir, steps)
    elif kind == "relaytrain":
        figures = relaytrain_child(name, workdir, run_dir, steps)
    else:
        figures = sampling_child(kind, workdir, steps)
    (run_dir / "bench.json").write_text(json.dumps(figures))


def main() -> None:
    args = parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))  # the children import this module's reward by name
        child(*args.child, args.steps)
        return
    chosen = args.only.split(",")
    with contest_dirs() as (workdir, runs, load):
        make_inputs(workdir)
        child_run(__file__, 1, ["relaytrain:baseline", str(workdir)], runs, "warmup")  # the tokenize cache
        contestants = sorted({c for name in chosen for c in CONTESTS[name][:2]})
        rounds = alternating_rounds(contestants, args.rounds,
                                    lambda c: child_run(__file__, args.steps, [c, str(workdir)], runs, c.replace(":", "-")))
    headlines = {}
    for name in chosen:
        top, bottom, key = CONTESTS[name]
        headlines[name] = headline([r[top][key] / r[bottom][key] for r in rounds], TARGETS[name])
    # How near the planner's sampling time comes to the run's (not a headline: the cost model's check)
    predicted = [r[c]["predicted_rollout_s"] / r[c]["rollout_s"] for r in rounds for c in r if c.startswith("relaytrain")]
    if predicted:
        print(f"sampling_predicted_vs_run: median {statistics.median(predicted):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in predicted)})")
    results = {"command": f"python scripts/bench_grpo.py --rounds {args.rounds} --steps {args.steps}",
               "model": SIZES, "prompts": PROMPTS, "num_generations": G, "accumulate": ACCUMULATE,
               "max_completion_length": LENGTH, "seq_len": SEQ, "rounds": rounds, "other_load_cores": load.cores,
               "headlines": headlines,
               "sampling_predicted_vs_run": statistics.median(predicted) if predicted else None}
    report(results, args.json)


if __name__ == "__main__":
    main()
