"""Baseline throughput against a plain PyTorch training loop: same model, batch, data and threads.

The plain loop is what a user would write by hand: the Hugging Face model's own forward with
labels on each micro-batch, loss / num_microbatches, backward, torch's fused AdamW. Rounds of
the two alternate (ABAB...) so drift on the machine hits both alike; the ratio compares the
median step times of one run.

    python scripts/bench_baseline.py [--rounds 5] [--steps 6] [--json out.json] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchlib import headline
from relaytrain.compose import compose_config
from relaytrain.data import build_dataset, build_loader
from relaytrain.launch import keep_freed_host_memory
from relaytrain.models import build_model
from relaytrain.optim import build_optimizer
from relaytrain.strategies import build_strategy

DEFAULT = [
    "model=bert_tiny", "model.num_layers=6", "model.hidden_size=256", "model.num_heads=4",
    "model.intermediate_size=1024", "model.dropout=0.0", "data.seq_len=128",
    "strategy.microbatch_size=8", "strategy.num_microbatches=4",
]


def plain_step_fn(cfg):
    hf_model = build_model(cfg.model, seed=0).hf_model
    optimizer = build_optimizer(hf_model.named_parameters(), cfg.optim)
    n = cfg.strategy.num_microbatches

    def step(minibatch):
        for mb in minibatch:
            loss = hf_model(input_ids=mb.input_ids, labels=mb.labels).loss / n
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def relaytrain_step_fn(cfg):
    model = build_model(cfg.model, seed=0)
    strategy = build_strategy(model, cfg)
    return lambda minibatch: strategy.step(minibatch, cfg.optim.lr).loss


def time_steps(step, minibatches) -> list[float]:
    times = []
    for mb in minibatches:
        start = time.perf_counter()
        step(mb)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    keep_freed_host_memory()  # as every relaytrain process does (the launcher's setting)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round (after one warm-up)")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose_config([*DEFAULT, *args.overrides])
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    minibatches = [next(loader) for _ in range(args.steps + 1)]
    runners = {"plain": plain_step_fn(cfg), "relaytrain": relaytrain_step_fn(cfg)}
    times = {name: [] for name in runners}
    per_round = []  # each round's ratio of median step times
    for _ in range(args.rounds):
        medians = {}
        for name, step in runners.items():
            measured = time_steps(step, minibatches)[1:]
            times[name] += measured
            medians[name] = statistics.median(measured)
        per_round.append(medians["plain"] / medians["relaytrain"])
    median = {name: statistics.median(t) for name, t in times.items()}
    samples = cfg.strategy.microbatch_size * cfg.strategy.num_microbatches
    result = {
        "benchmark": "baseline_vs_plain_pytorch",
        "model": f"{cfg.model.name} L{cfg.model.num_layers} H{cfg.model.hidden_size} seq{cfg.data.seq_len}",
        "minibatch": f"{cfg.strategy.microbatch_size}x{cfg.strategy.num_microbatches}",
        "threads": torch.get_num_threads(),
        "plain_samples_per_s": samples / median["plain"],
        "relaytrain_samples_per_s": samples / median["relaytrain"],
        "ratio": median["plain"] / median["relaytrain"],
        "target": 0.95,
        "headlines": {"baseline_vs_plain_loop": headline(per_round, 0.95)},
    }
    print(f"baseline vs plain PyTorch ({result['model']}, minibatch {result['minibatch']}, "
          f"{result['threads']} threads): plain {result['plain_samples_per_s']:.1f} samples/s, "
          f"relaytrain {result['relaytrain_samples_per_s']:.1f} samples/s, ratio {result['ratio']:.3f} "
          f"(target >= {result['target']}; median round {statistics.median(per_round):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
