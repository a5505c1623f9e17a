"""GRPO teaches: a tiny model taught two-digit addition by chat SFT, then trained by GRPO on the
exact-match reward, answers more sums right (docs/benchmarks.md, "GRPO on a toy task").

Both phases are relaytrain runs on this CPU: `data=chat` SFT of a random 4-block Llama-layout
model (made here, with the tests' byte-level BPE tokenizer and its chat template) on questions
"What is a + b?" answered "c", then `objective=grpo` from the saved model on held-apart
questions, rewarded by the built-in `exact_answer` (the reply, stripped, equals the record's
`answer`). It prints the mean reward of GRPO's first and last steps (over every completion of
those steps) and each phase's time; `--json` writes them.

    .venv/bin/python scripts/grpo_toy.py [--sft-steps 300] [--grpo-steps 40] [--json grpo_toy.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from benchlib import chat_llama_checkpoint

SIZES = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=344, vocab_size=320, max_position_embeddings=128)


def sums(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 19), rng.randint(0, 19)) for _ in range(count)]


def write_data(workdir: Path) -> None:
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": str(a + b)}]} for a, b in sums(4000, 0)]
    prompts = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
               for a, b in sums(2000, 1)]
    (workdir / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (workdir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


def train(overrides: list[str], run_dir: Path) -> float:
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    start = time.perf_counter()
    run(resolve(compose_config(overrides), overrides), run_dir, table=False, quiet=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--grpo-steps", type=int, default=80)
    p.add_argument("--json")
    p.add_argument("--keep", help="a directory to keep the runs in (their rollouts.jsonl, metrics.csv)")
    args = p.parse_args()
    from relaytrain.records.runlog import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        chat_llama_checkpoint(workdir / "random", SIZES)
        write_data(workdir)
        sft_s = train([f"model.pretrained={workdir / 'random'}", "data=chat", f"data.path={workdir / 'sft.jsonl'}",
                       "data.seq_len=32", f"data.cache_dir={workdir / 'cache'}", "strategy=baseline",
                       "strategy.microbatch_size=32", "strategy.num_microbatches=1", "optim=adamw", "optim.lr=1e-3",
                       "optim.weight_decay=0.0", f"train.steps={args.sft_steps}", "train.save_model=true",
                       "train.check_memory=false"], workdir / "sft")
        grpo_s = train([f"model.pretrained={workdir / 'sft' / 'model'}", "data=prompts",
                        f"data.path={workdir / 'prompts.jsonl'}", "data.seq_len=40", f"data.cache_dir={workdir / 'cache'}",
                        "objective=grpo", "objective.num_generations=8", "objective.max_completion_length=8",
                        "objective.rewards=[exact_answer]", "strategy=l2l", "strategy.microbatch_size=4",
                        "strategy.num_microbatches=2", "optim=adamw", "optim.lr=3e-4", "optim.weight_decay=0.0",
                        f"train.steps={args.grpo_steps}", "train.check_memory=false"], workdir / "grpo")
        rows = read_metrics(workdir / "grpo")
        reward = [r["rewards/exact_answer/mean"] for r in rows]
        window = max(1, len(reward) // 5)
        results = {"command": f"python scripts/grpo_toy.py --sft-steps {args.sft_steps} --grpo-steps {args.grpo_steps}",
                   "model": SIZES, "sft_s": sft_s, "grpo_s": grpo_s, "reward_per_step": reward,
                   "first_steps_reward": sum(reward[:window]) / window, "last_steps_reward": sum(reward[-window:]) / window}
    print(f"SFT {args.sft_steps} steps in {sft_s:.0f} s; GRPO {args.grpo_steps} steps in {grpo_s:.0f} s")
    print(f"exact-match reward, mean of the first {window} GRPO steps: {results['first_steps_reward']:.3f}; "
          f"of the last {window}: {results['last_steps_reward']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
