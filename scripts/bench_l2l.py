"""L2L against the in-memory baseline with recompute, in one process, as ratios.

Both strategies train the same model (default: bert_base, 12 blocks of hidden 768, seq 128)
on the same minibatches with the same thread count. After warm-up, their steps are
interleaved in ABBA order so drift of the machine (other load, thermal) hits both alike; the
throughput ratio is L2L's samples/s over the baseline's. Also reported: the EPS optimizer's
parameters per second inside the run (sharing the cores with backward), its updates alone against
one fused AdamW step over the whole model (same parameters, alternating rounds),
and how much of the EPS's work stays exposed after overlapping with backward. Where DeepSpeed
is installed (`pip install relaytrain[fast]`), also the EPS's updates alone (its host kernel
as `optim.host_kernel` picks it) against DeepSpeed's own `DeepSpeedCPUAdam` stepping the same
tensors on the same threads (headline `eps_vs_deepspeed_cpu_adam`).

Then the same step comparison on a causal LM of the Llama layout (benchlib.DECODER: 8 blocks of
hidden 512, grouped-query attention 8/2; headline `decoder_l2l_vs_recompute_baseline`), at the
same sequence length, minibatch, optimizer and precision: `--decoder-rounds 0` leaves it out.

    .venv/bin/python scripts/bench_l2l.py --json bench_l2l.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time

import torch

from benchlib import DECODER, headline
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.records.checkpoint import unique_named_parameters
from relaytrain.run.compose import compose_config
from relaytrain.run.launch import keep_freed_host_memory
from relaytrain.step import metrics
from relaytrain.step.optim import build_optimizer, param_groups
from relaytrain.step.precision import LossScaler
from relaytrain.strategies import build_strategy
from relaytrain.strategies.eps import EagerParamServer, EpsStats
from relaytrain.strategies.l2l import L2L, HeadLoss

TARGET = 0.95  # l2l / recompute baseline, on either model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert_base")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--optim", default="adamw")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--rounds", type=int, default=10, help="ABBA rounds; each runs one step of both")
    p.add_argument("--decoder-rounds", type=int, default=10,
                   help="ABBA rounds of the same comparison on the decoder (0: not run)")
    p.add_argument("--update-rounds", type=int, default=40,
                   help="rounds of the EPS-updates-alone comparison (one update of each a round, ~0.15 s)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both; 0 keeps torch's default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args()


def configs(args, model: list[str]) -> dict:
    """Both strategies' configs for the model `model` (overrides) and the command line's batch."""
    common = [*model, "model.dropout=0.0", f"data.seq_len={args.seq_len}",
              f"strategy.microbatch_size={args.microbatch_size}", f"strategy.num_microbatches={args.microbatches}",
              f"optim={args.optim}", f"precision={args.precision}", f"train.device={args.device}"]
    baseline_precision = args.precision.replace("cmp_", "amp_")  # the baseline's nearest mixed precision
    return {
        "baseline": compose_config([*common, "strategy=baseline", "strategy.recompute=block",
                                    f"precision={baseline_precision}"]),
        "l2l": compose_config([*common, "strategy=l2l"]),
    }


class Runner:
    """One strategy on its own copy of the model, timing whole synchronised steps."""

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg.model, seed=0)
        self.strategy = build_strategy(self.model, cfg, device)
        self.step_times: list[float] = []
        self.exposed_shares: list[float] = []  # l2l: the EPS's work left exposed, per measured step
        self.optimizer_s = 0.0
        if cfg.strategy.name == "baseline":
            self._time_baseline_optimizer()

    def _time_baseline_optimizer(self) -> None:
        optimizer, started = self.strategy.optimizer, []
        optimizer.register_step_pre_hook(lambda *_: started.append(time.perf_counter()))

        def add(*_):
            self.optimizer_s += time.perf_counter() - started.pop()

        optimizer.register_step_post_hook(add)

    def reset_measurements(self) -> None:
        """Forget the warm-up steps' figures (first steps allocate optimizer state and buffers)."""
        self.optimizer_s = 0.0
        if isinstance(self.strategy, L2L):
            self.strategy.timer.reset()
            self.strategy.transfers.wait_s = 0.0
            self.strategy.eps.stats = EpsStats(host_kernel=self.strategy.eps.stats.host_kernel)

    def step(self, minibatch, measured: bool) -> None:
        eps = self.strategy.eps if isinstance(self.strategy, L2L) else None
        before = (eps.stats.exposed_s, eps.stats.busy_s) if eps else None
        metrics.synchronize(self.device)
        start = time.perf_counter()
        self.strategy.step(minibatch, self.cfg.optim.lr)
        self.strategy.drain()  # the steps of two strategies alternate: none may run into the other's
        metrics.synchronize(self.device)
        if measured:
            self.step_times.append(time.perf_counter() - start)
            if eps:
                exposed, busy = eps.stats.exposed_s - before[0], eps.stats.busy_s - before[1]
                self.exposed_shares.append(min(exposed / busy, 1.0))


def eps_against_fused_adamw(cfg, rounds: int) -> dict:
    """The EPS's per-part updates against one fused optimizer step over the whole model (below)."""
    return eps_against_whole_model(cfg, rounds, lambda named: build_optimizer(named, cfg.optim))


def eps_against_deepspeed_cpu_adam(cfg, rounds: int) -> dict | None:
    """The EPS's per-part updates against DeepSpeed's `DeepSpeedCPUAdam` over the whole model (the
    same tensors, gradients and threads; AdamW mode, the config's decay groups), or None without
    DeepSpeed. The EPS runs the kernel `optim.host_kernel` picks: DeepSpeed's op under `auto`."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    o = cfg.optim

    def whole(named):
        return DeepSpeedCPUAdam(param_groups(named, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                adamw_mode=True)

    return eps_against_whole_model(cfg, rounds, whole)


def eps_against_whole_model(cfg, rounds: int, whole_optimizer) -> dict:
    """The EPS's per-part updates against one optimizer step over the whole model
    (`whole_optimizer(named parameters)`): the same parameters, the same gradients, alternating
    rounds (nothing else running).
    One update is ~75 ms (bert_base on 2 cores), so one round's ratio swings by several per
    cent with the machine's noise: the comparison takes its own, more numerous rounds.

    EPS: every part's gradients submitted in backward order, then `wait()`, timed end to end
    (the worker's queueing, the gradients folded into the masters, every part's optimizer).
    Whole model: what the baseline does, one `optimizer.step()` over every parameter on the
    calling thread. One unmeasured round of each first: it allocates the optimizer state.
    """
    model = build_model(cfg.model, seed=0)
    modules = [("embed", model.embed), *((f"block.{i}", b) for i, b in enumerate(model.blocks)),
               ("head", HeadLoss(model))]
    eps = EagerParamServer(modules, cfg.optim, LossScaler(False))
    whole = whole_optimizer(unique_named_parameters(model))
    generator = torch.Generator().manual_seed(0)
    # One gradient per parameter, handed to the part that owns it. A tied weight's second use
    # (the head's) gets none: summing the two uses is the backward's work in the baseline
    # (autograd adds them), not the optimizer's, and this compares the updates alone.
    grads = [[torch.randn(p.shape, generator=generator) * 1e-3 if any(p is q for q in part.owned) else None
              for p in part.masters] for part in eps.parts]

    def eps_round() -> float:
        fresh = [[None if g is None else g.clone() for g in part_grads] for part_grads in grads]
        start = time.perf_counter()
        for index in reversed(range(len(eps.parts))):
            eps.submit(index, fresh[index])
        eps.wait()
        return time.perf_counter() - start

    def whole_round() -> float:
        for part, part_grads in zip(eps.parts, grads, strict=True):
            for p, g in zip(part.masters, part_grads, strict=True):
                if g is not None:
                    p.grad = g.clone()
        start = time.perf_counter()
        whole.step()
        whole.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    try:
        eps_round(), whole_round()
        eps.stats = EpsStats(host_kernel=eps.stats.host_kernel)
        times = [(eps_round(), whole_round()) if r % 2 == 0 else tuple(reversed((whole_round(), eps_round())))
                 for r in range(rounds)]
    finally:
        eps.close()
    parameters = model.num_parameters()
    return {
        "eps_host_kernel": eps.stats.host_kernel,
        "eps_s": [e for e, _ in times],
        "whole_model_s": [w for _, w in times],
        "eps_parameters_per_s": parameters / statistics.median(e for e, _ in times),
        "whole_model_parameters_per_s": parameters / statistics.median(w for _, w in times),
        "ratio_per_round": [w / e for e, w in times],
    }


def compare_steps(args, model: list[str], rounds: int, device: torch.device) -> tuple[dict, dict]:
    """Both strategies on the model `model`: warm-up steps, then `rounds` ABBA rounds of one step
    each on the same minibatches. Returns the configs and the summary."""
    cfgs = configs(args, model)
    runners = {name: Runner(cfg, device) for name, cfg in cfgs.items()}
    loader = iter(build_loader(cfgs["l2l"], build_dataset(cfgs["l2l"])))
    for _ in range(args.warmup):
        minibatch = next(loader)
        for runner in runners.values():
            runner.step(minibatch, measured=False)
    for runner in runners.values():
        runner.reset_measurements()
    for r in range(rounds):
        minibatch = next(loader)
        order = ["baseline", "l2l"] if r % 2 == 0 else ["l2l", "baseline"]
        for name in order:
            runners[name].step(minibatch, measured=True)
    results = summarize(args, model, runners)
    for runner in runners.values():
        runner.strategy.close()
    return cfgs, results


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfgs, results = compare_steps(args, [f"model={args.model}"], args.rounds, device)
    results["eps_vs_fused_adamw"] = eps_against_fused_adamw(cfgs["l2l"], args.update_rounds)
    results["headlines"] = {
        "l2l_vs_recompute_baseline": headline(results["throughput_ratio_per_round"], TARGET),
        "eps_vs_fused_adamw": headline(results["eps_vs_fused_adamw"]["ratio_per_round"], 1.0),
        "eps_exposed_share": headline(results["eps_exposed_share_per_round"], 0.03, lower_is_better=True),
    }
    results["eps_vs_deepspeed_cpu_adam"] = eps_against_deepspeed_cpu_adam(cfgs["l2l"], args.update_rounds)
    if results["eps_vs_deepspeed_cpu_adam"] is not None:
        results["headlines"]["eps_vs_deepspeed_cpu_adam"] = headline(
            results["eps_vs_deepspeed_cpu_adam"]["ratio_per_round"], 1.0)
    if args.decoder_rounds:
        _, results["llama_layout"] = compare_steps(args, DECODER, args.decoder_rounds, device)
        results["headlines"]["decoder_l2l_vs_recompute_baseline"] = headline(
            results["llama_layout"]["throughput_ratio_per_round"], TARGET)
    return results


def summarize(args, model: list[str], runners) -> dict:
    samples = args.microbatch_size * args.microbatches
    base, l2l = runners["baseline"], runners["l2l"]
    report = l2l.strategy.report()
    per_round = [b / t for b, t in zip(base.step_times, l2l.step_times, strict=True)]
    mean = {name: statistics.mean(r.step_times) for name, r in runners.items()}
    measured_steps = len(l2l.step_times)
    return {
        "command": "python scripts/bench_l2l.py " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in
                                                           vars(args).items() if v is not None and k != "json"),
        "model": l2l.cfg.model.name,
        "model_overrides": model,
        "hidden_size": l2l.cfg.model.hidden_size,
        "parameters": l2l.model.num_parameters(),
        "blocks": l2l.model.num_blocks,
        "samples_per_step": samples,
        "seq_len": args.seq_len,
        "optimizer": args.optim,
        "precision": {name: r.cfg.precision.name for name, r in runners.items()},
        "threads": torch.get_num_threads(),
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "rounds": measured_steps,
        "step_time_s": mean,
        "samples_per_s": {name: samples / t for name, t in mean.items()},
        "throughput_ratio": mean["baseline"] / mean["l2l"],
        "throughput_ratio_per_round": per_round,
        "eps_exposed_share_per_round": l2l.exposed_shares,
        "baseline_optimizer_s_per_step": base.optimizer_s / measured_steps,
        "baseline_optimizer_parameters_per_s": base.model.num_parameters() * measured_steps / base.optimizer_s,
        "l2l_phase_s_per_step": {k: v / measured_steps for k, v in report["phase_times_s"].items()},
        "eps": report["eps"],
        "peak_resident_blocks": report["peak_resident_blocks"],
    }


def print_table(results: dict) -> None:
    eps, alone, heads = results["eps"], results["eps_vs_fused_adamw"], results["headlines"]
    rows = [
        ("model", f"{results['model']} ({results['blocks']} blocks, {results['parameters'] / 1e6:.1f} M params)"),
        ("minibatch", f"{results['samples_per_step']} samples x seq {results['seq_len']}, {results['optimizer']}"),
        ("threads / device", f"{results['threads']} / {results['device']}"),
        ("baseline (recompute) samples/s", f"{results['samples_per_s']['baseline']:.3f}"),
        ("l2l samples/s", f"{results['samples_per_s']['l2l']:.3f}"),
        ("throughput ratio l2l / baseline", f"{results['throughput_ratio']:.3f} "
                                            f"(median round {heads['l2l_vs_recompute_baseline']['median']:.3f})"),
        ("l2l phases s/step", " · ".join(f"{k} {v:.2f}" for k, v in results["l2l_phase_s_per_step"].items())),
        ("baseline optimizer", f"{results['baseline_optimizer_parameters_per_s'] / 1e6:.0f} M params/s, "
                               f"{results['baseline_optimizer_s_per_step']:.3f} s/step, all exposed"),
        ("EPS optimizer in run", f"{eps['parameters_per_s'] / 1e6:.0f} M params/s (sharing cores with backward)"),
        ("EPS updates alone / fused AdamW",
         f"{alone['eps_parameters_per_s'] / 1e6:.0f} / {alone['whole_model_parameters_per_s'] / 1e6:.0f} M params/s, "
         f"ratio median {heads['eps_vs_fused_adamw']['median']:.3f}"),
        ("EPS updates alone / DeepSpeedCPUAdam", versus_deepspeed(results)),
        ("EPS work exposed", f"median step {heads['eps_exposed_share']['median']:.1%} "
                             f"of {eps['busy_s'] / max(eps['steps'], 1):.3f} s/step"),
        ("peak resident blocks", str(results["peak_resident_blocks"])),
    ]
    if "llama_layout" in results:
        d = results["llama_layout"]
        rows += [
            ("Llama-layout model", f"{d['model']} ({d['blocks']} blocks of hidden {d['hidden_size']}, "
                                   f"{d['parameters'] / 1e6:.1f} M params)"),
            ("its l2l / baseline (recompute)",
             f"{d['samples_per_s']['l2l']:.3f} / {d['samples_per_s']['baseline']:.3f} samples/s, "
             f"median round {heads['decoder_l2l_vs_recompute_baseline']['median']:.3f}"),
        ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def versus_deepspeed(results: dict) -> str:
    alone = results["eps_vs_deepspeed_cpu_adam"]
    if alone is None:
        return "not run: DeepSpeed is not installed (pip install relaytrain[fast])"
    return (f"{alone['eps_parameters_per_s'] / 1e6:.0f} ({alone['eps_host_kernel']}) / "
            f"{alone['whole_model_parameters_per_s'] / 1e6:.0f} M params/s, "
            f"ratio median {results['headlines']['eps_vs_deepspeed_cpu_adam']['median']:.3f}")


def main() -> None:
    keep_freed_host_memory()  # as every relaytrain process does (the launcher's setting)
    args = parse_args()
    results = run(args)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
