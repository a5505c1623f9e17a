"""Baseline throughput against a plain PyTorch training loop: same model, batch, data and threads.

The plain loop is what a user would write by hand: the Hugging Face model's own forward with
labels on each micro-batch, loss / num_microbatches, backward, torch's fused AdamW. Rounds of
the two alternate (ABAB...) so drift on the machine hits both alike; the ratio compares the
median step times of one run.

    python scripts/bench_baseline.py [--rounds 5] [--steps 6] [--json out.json] [KEY=VALUE ...]

`--keyed-draws` measures instead what keyed dropout draws cost (`models.layered.keyed_draws`):
one bert_base baseline (dropout 0.1) stepped with them and with them replaced by a no-op (the
global stream's draws), rounds alternating on the same model and strategy.

    python scripts/bench_baseline.py --keyed-draws [--rounds 7] [--steps 3] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch

from benchlib import headline
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model, layered
from relaytrain.run.compose import compose_config
from relaytrain.run.launch import keep_freed_host_memory
from relaytrain.step.optim import build_optimizer
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


KEYED_DRAWS = ["model=bert_base", "model.dropout=0.1", "data.seq_len=128", "strategy.microbatch_size=4",
               "strategy.num_microbatches=2", "data.num_samples=64"]


@contextlib.contextmanager
def _unkeyed(*args, **kwargs):
    yield


def keyed_draws_step_fns(cfg) -> dict:
    """The baseline's step with keyed draws, and the same step (one model, one strategy) with
    `keyed_draws` a no-op: everything else the same, so the difference is their cost."""
    step = relaytrain_step_fn(cfg)

    def unkeyed(minibatch):
        with mock.patch.object(layered, "keyed_draws", _unkeyed):
            return step(minibatch)

    return {"unkeyed": unkeyed, "keyed": step}


def keyed_draws_per_step(step, minibatch) -> int:
    """How many times one step enters `keyed_draws` (a part on a micro-batch, recomputes included)."""
    calls = []
    keyed = layered.keyed_draws

    def counted(*args, **kwargs):
        calls.append(1)
        return keyed(*args, **kwargs)

    with mock.patch.object(layered, "keyed_draws", counted):
        step(minibatch)
    return len(calls)


def keyed_draws_call_s(calls: int = 20000) -> float:
    """Seconds one entry and exit of `keyed_draws` takes on this machine's device (the CPU)."""
    draw = layered.Draw(0, 5, 1)
    start = time.perf_counter()
    for _ in range(calls):
        with layered.keyed_draws(draw, 3, torch.device("cpu")):
            pass
    return (time.perf_counter() - start) / calls


def keyed_draws_main(args) -> None:
    cfg = compose_config([*KEYED_DRAWS, *args.overrides])
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    minibatches = [next(loader) for _ in range(args.steps + 1)]
    runners = keyed_draws_step_fns(cfg)
    calls, call_s = keyed_draws_per_step(runners["keyed"], minibatches[0]), keyed_draws_call_s()
    per_round = []  # each round's unkeyed / keyed median step time: 1 = free, 0.98 = keyed costs 2 %
    medians = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, step in runners.items():
            medians[name].append(statistics.median(time_steps(step, minibatches)[1:]))
        per_round.append(medians["unkeyed"][-1] / medians["keyed"][-1])
    result = {
        "benchmark": "keyed_dropout_draws",
        "model": f"{cfg.model.name} L{cfg.model.num_layers} H{cfg.model.hidden_size} seq{cfg.data.seq_len}",
        "minibatch": f"{cfg.strategy.microbatch_size}x{cfg.strategy.num_microbatches}",
        "threads": torch.get_num_threads(),
        "step_s": {name: statistics.median(m) for name, m in medians.items()},
        "keyed_draws_per_step": calls,
        "keyed_draws_call_s": call_s,
        "keyed_draws_share_of_step": calls * call_s / statistics.median(medians["keyed"]),
        "headlines": {"unkeyed_over_keyed_step_time": headline(per_round, 0.98)},
    }
    print(f"keyed dropout draws ({result['model']}, minibatch {result['minibatch']}, {result['threads']} threads): "
          f"step {result['step_s']['keyed']:.3f} s keyed, {result['step_s']['unkeyed']:.3f} s unkeyed; "
          f"unkeyed/keyed median round {statistics.median(per_round):.4f}, rounds "
          f"{', '.join(f'{r:.4f}' for r in per_round)} (target >= 0.98); {calls} keyed parts a step x "
          f"{call_s * 1e6:.1f} us = {result['keyed_draws_share_of_step']:.2e} of a step")
    write_result(args.json, result)


def write_result(path: str | None, result: dict) -> None:
    """The --json file, when one was asked for."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


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
    parser.add_argument("--keyed-draws", action="store_true", help="measure keyed dropout draws' cost instead")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.keyed_draws:
        keyed_draws_main(args)
        return
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
    write_result(args.json, result)


if __name__ == "__main__":
    main()
