"""The papers' tables and figures, redone with relaytrain (results in docs/reproductions.md).

    python scripts/reproduce.py table4       # L2L Table 4: device memory against depth (simulated)
    python scripts/reproduce.py table3       # L2L Table 3: throughput against the inner micro-batch count (measured)
    python scripts/reproduce.py figure6      # 2BW Figure 6: throughput of 2BW, Flush, GPipe against batch size (measured)
    python scripts/reproduce.py figure8      # 2BW Figure 8: per-stage device memory (simulated)
    python scripts/reproduce.py convergence  # 2BW §5.1: 2BW's loss against the vanilla (flush) loss
    python scripts/reproduce.py planner      # the planner's choices for BERT-Large and GPT-2 on V100s and A100s
    python scripts/reproduce.py decoders     # the planner's choices for Llama 3 and Qwen3 on 24 GB and 80 GB GPUs
    python scripts/reproduce.py all [--images docs/images]

Simulated figures are a dry run of the real strategy code on the meta device
(`relaytrain.dryrun.memory.simulate`); measured ones are runs on this machine. Every command prints a
Markdown table with the paper's figure beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from relaytrain.models import count_parameters
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run

GIB = 2**30
QUIET = ["train.log_every=100000"]


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def measured(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        return run(compose_config([*overrides, *QUIET]), Path(run_dir), quiet=True)


# ------------------------------------------------------------------- L2L Table 4


# (method, micro-batch, layers) -> the paper's GB (16 GB V100, BERT-Large width, seq 128)
PAPER_TABLE4 = {("baseline", 24): "9.23", ("baseline", 48): "OOM", ("l2l", 24): "5.22", ("l2l", 48): "6.76",
                ("l2l", 96): "9.83", ("l2l_stash_cpu", 24): "3.69", ("l2l_stash_cpu", 96): "3.69",
                ("l2l_stash_cpu", 384): "3.69"}


def table4(args) -> str:
    """Simulated peak device memory of BERT-Large-wide models of growing depth: the baseline with
    a micro-batch of 2 (fp32, LAMB), L2L with one of 64 in cross mixed precision (the paper's rows)."""
    rows = []
    for strategy, microbatch, precision in (("baseline", 2, "fp32"), ("l2l", 64, "cmp_fp16"),
                                            ("l2l_stash_cpu", 64, "cmp_fp16")):
        for layers in (24, 48, 96, 384):
            cfg = compose_config(["model=bert_large", f"model.num_layers={layers}", "data.seq_len=128",
                                  f"strategy={strategy}", f"strategy.microbatch_size={microbatch}",
                                  "strategy.num_microbatches=1", "optim=lamb", f"precision={precision}"])
            peak = simulate(cfg, steps=2).peak_bytes
            fits = "fits" if peak <= 16 * GIB else "OOM"
            rows.append([strategy, microbatch, precision, layers, f"{count_parameters(cfg.model) / 1e9:.2f} B",
                         f"{peak / GIB:.2f} ({fits})", PAPER_TABLE4.get((strategy, layers), "—")])
    return table(["strategy", "micro-batch", "precision", "layers", "parameters", "simulated GiB (16 GB V100)",
                  "paper GB"], rows)


# ------------------------------------------------------------------- L2L Table 3


def table3(args) -> str:
    """Measured samples/s of l2l on this CPU as the inner loop grows (u micro-batches per
    relay of the weights), on a model and micro-batch that fit it."""
    model = ["model=bert_tiny", "model.num_layers=6", "model.hidden_size=512", "model.num_heads=8",
             "model.intermediate_size=2048", "model.dropout=0.0", "data.seq_len=128", "data.num_samples=1024",
             "optim=lamb", "strategy=l2l", "strategy.microbatch_size=8"]
    paper = {1: "52.48", 2: "70.97", 4: "84.91"}
    rates = {}
    for _ in range(args.rounds):
        for u in (1, 2, 4):
            results = measured([*model, f"strategy.num_microbatches={u}", "train.steps=6", "train.untimed_steps=2"])
            rates.setdefault(u, []).append(results["throughput"]["samples_per_s"])
    rows = [[8, u, 8 * u, f"{max(rates[u]):.2f}", f"{max(rates[u]) / max(rates[1]):.2f}x", paper[u],
             f"{float(paper[u]) / 52.48:.2f}x"] for u in (1, 2, 4)]
    return table(["micro-batch", "u", "device batch", "samples/s (here, best round)", "vs u=1",
                  "paper samples/s (V100)", "paper vs u=1"], rows)


# ------------------------------------------------------------------- 2BW Figure 6


def figure6(args) -> str:
    """Measured samples/s of the three pipelines, 2 stages on this CPU, as the batch grows
    (micro-batches per update m; 2BW never flushes, Flush and GPipe idle (d-1)/(m+d-1))."""
    model = ["model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
             "model.intermediate_size=1024", "model.vocab_size=2048", "model.dropout=0.0", "data.seq_len=64",
             "data.num_samples=2048", "optim=sgd", "strategy.stages=2", "strategy.microbatch_size=4",
             "strategy.recompute=block"]
    rows = []
    for m in (2, 4, 8):
        rates = {}
        for _ in range(args.rounds):
            for strategy in ("pipe_2bw", "pipe_flush", "pipe_gpipe"):
                results = measured([*model, f"strategy={strategy}", f"strategy.num_microbatches={m}",
                                    "train.steps=10", "train.untimed_steps=3"])
                rates.setdefault(strategy, []).append(results["throughput"]["samples_per_s"])
        best = {s: max(r) for s, r in rates.items()}
        rows.append([4 * m, m, f"{best['pipe_2bw']:.1f}", f"{best['pipe_flush']:.1f}", f"{best['pipe_gpipe']:.1f}",
                     f"{best['pipe_2bw'] / best['pipe_gpipe']:.2f}x", f"{(m + 1) / m:.2f}x"])
    return table(["batch", "m", "2BW samples/s", "Flush samples/s", "GPipe samples/s", "2BW / GPipe",
                  "bubble-free bound (m+d-1)/m"], rows)


# ------------------------------------------------------------------- 2BW Figure 8


def figure8(args) -> str:
    """Simulated worst-stage device memory of a GPT model of 2.2 B parameters on 8 stages with
    recompute, against the batch size (the paper's Figure 8a set-up: 16 GB V100s, seq 512; in
    fp32 here, the paper used mixed precision: a dry run cannot simulate autocast)."""
    model = ["model=gpt2_medium", "model.num_layers=40", "model.hidden_size=2048", "model.num_heads=16",
             "model.intermediate_size=8192", "model.max_seq_len=512", "data.seq_len=512", "strategy.stages=8",
             "strategy.recompute=block", "strategy.microbatch_size=1", "optim=adamw"]
    rows = []
    for batch in (8, 16, 32, 64):
        peaks = {}
        for strategy in ("pipe_2bw", "pipe_flush", "pipe_gpipe"):
            cfg = compose_config([*model, f"strategy={strategy}", f"strategy.num_microbatches={batch}"])
            peaks[strategy] = simulate(cfg, steps=2).peak_bytes / GIB
        params = count_parameters(cfg.model)
        rows.append([batch, f"{params / 1e9:.2f} B", *(f"{peaks[s]:.2f}" for s in ("pipe_2bw", "pipe_flush", "pipe_gpipe"))])
    return table(["batch (m, micro-batch 1)", "parameters", "2BW GiB", "Flush GiB", "GPipe GiB"], rows)


# ------------------------------------------------------------------- 2BW §5.1


def convergence(args) -> str:
    """2BW's loss against the vanilla (Flush) loss on the same task, data and seed."""
    common = ["model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=128", "model.num_heads=4",
              "model.intermediate_size=512", "model.vocab_size=512", "data.seq_len=64", "data.num_samples=4096",
              "data.eval_fraction=0.05", "optim=adamw", f"optim.lr={args.lr}", "optim.warmup_steps=20",
              "optim.schedule=linear", "strategy.stages=2", "strategy.num_microbatches=4",
              "strategy.microbatch_size=8", f"train.steps={args.steps}", "train.untimed_steps=2"]
    curves, finals = {}, {}
    for strategy in ("pipe_flush", "pipe_2bw"):
        results = measured([*common, f"strategy={strategy}"])
        curves[strategy], finals[strategy] = results["loss"], results["eval"][-1]
    if args.images:
        _plot_convergence(curves, Path(args.images) / "convergence_2bw.png")
    tail = {s: statistics.mean(c[-20:]) for s, c in curves.items()}
    rows = [[s, f"{curves[s][0]:.3f}", f"{tail[s]:.4f}", f"{finals[s]['loss']:.4f}", f"{finals[s]['perplexity']:.2f}"]
            for s in curves]
    # The same two update rules in one process, on the same minibatches: is a gap the rule or the pipeline?
    reference = compose_config([*(o for o in common if not o.startswith("strategy.")), "strategy=baseline",
                                "strategy.microbatch_size=32", "strategy.num_microbatches=1"])
    for name, delayed in (("one process, vanilla rule", False), ("one process, delayed rule", True)):
        losses = _one_process_losses(reference, delayed)
        rows.append([name, f"{losses[0]:.3f}", f"{statistics.mean(losses[-20:]):.4f}", "—", "—"])
    gap = abs(finals["pipe_2bw"]["loss"] - finals["pipe_flush"]["loss"]) / finals["pipe_flush"]["loss"]
    return table(["strategy", "first loss", "mean loss, last 20 steps", "held-out loss", "held-out perplexity"],
                 rows) + f"\n\nheld-out loss gap 2BW vs Flush: {100 * gap:.2f} %"


def _one_process_losses(cfg, delayed: bool) -> list[float]:
    """Train `cfg` in one process with W(t+1) = W(t) - lr * g(W(t)) (vanilla) or g(W(t-1))
    (2BW's delayed rule), with the same optimizer, schedule and minibatches as the runs."""
    import copy

    from relaytrain.data import build_dataset, build_loader
    from relaytrain.models import build_model
    from relaytrain.step.optim import build_optimizer, lr_at, set_lr
    from relaytrain.strategies.base import minibatch_divisor

    model = build_model(cfg.model, cfg.train.seed, quiet=True)
    stale = copy.deepcopy(model)  # the version a delayed gradient is taken at
    optimizer = build_optimizer(model.named_parameters(), cfg.optim)
    loader, previous, losses = iter(build_loader(cfg, build_dataset(cfg))), copy.deepcopy(model.state_dict()), []
    for step in range(cfg.train.steps):
        minibatch, net = next(loader), model
        if delayed:
            stale.load_state_dict(previous)
            previous, net = copy.deepcopy(model.state_dict()), stale
        divisor = minibatch_divisor(net, minibatch)
        loss = 0.0
        for mb in minibatch:
            part = net(mb, divisor)
            part.backward()
            loss += part.item()
        losses.append(loss)
        if delayed:
            for p, q in zip(model.parameters(), stale.parameters(), strict=True):
                p.grad, q.grad = q.grad, None
        set_lr(optimizer, lr_at(step, cfg.optim, cfg.train.steps))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _plot_convergence(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label={"pipe_flush": "vanilla (PipeDream-Flush)",
                                                          "pipe_2bw": "2BW (delay 1)"}[strategy], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean per token)")
    ax.set_title("2BW against vanilla updates: GPT-2 4x128, synthetic LM, AdamW")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- the planner's choices


# name: (the request's overrides, what the papers chose for the nearest set-up)
V100, A100 = "plan.device=v100_16gb", "plan.device=a100_40gb"
BERT_LARGE = ["model=bert_large", "data.seq_len=128", "optim=lamb"]
GPT2_XL = ["model=gpt2_xl", "data.seq_len=512", "optim=adamw"]
PLANNER_REQUESTS = {
    "BERT-Large, 8 x V100 16 GB": (
        [*BERT_LARGE, "plan.workers=8", V100],
        "2BW Table 1, BERT-24 on 2 x 8 1080Ti: (w, d) = (8, 2), b = 8, no recompute; "
        "on 4 x 8 V100: (8, 4), b = 4, recompute"),
    "BERT-Large, 8 x A100 40 GB": ([*BERT_LARGE, "plan.workers=8", A100], "none in the papers"),
    "BERT-Large, 1 x V100 16 GB": (
        [*BERT_LARGE, "plan.workers=1", V100],
        "L2L Table 4: the baseline fits BERT-Large (24 layers) at micro-batch 2 (9.23 GB), L2L at 64 (5.22 GB)"),
    "BERT 48 layers, 1 x V100 16 GB": (
        [*BERT_LARGE, "model.num_layers=48", "plan.workers=1", V100],
        "L2L Table 4: the baseline is out of memory at 48 layers; L2L fits (6.76 GB)"),
    "GPT-2 medium, 8 x V100 16 GB": (
        ["model=gpt2_medium", "data.seq_len=512", "optim=adamw", "plan.workers=8", V100],
        "2BW §5.2 (GPT 2.2 B, 8 V100): 8-deep, recompute, the largest micro-batch that fits"),
    "GPT-2 medium, 1 x V100 16 GB": (
        ["model=gpt2_medium", "data.seq_len=512", "optim=adamw", "plan.workers=1", V100],
        "none in the papers"),
    "GPT-2 1.5 B, 8 x V100 16 GB": (
        [*GPT2_XL, "plan.workers=8", V100],
        "2BW §5.2 (GPT 2.2 B, 8 V100): 8-deep, recompute; data parallelism does not fit"),
    "GPT-2 1.5 B, 8 x A100 40 GB": ([*GPT2_XL, "plan.workers=8", A100], "none in the papers"),
}
# The requests whose every strategy's fastest fit is shown, the reasoning behind the choice.
PLANNER_WHY = ["BERT-Large, 8 x V100 16 GB", "BERT-Large, 8 x A100 40 GB",
               "GPT-2 1.5 B, 8 x V100 16 GB", "GPT-2 1.5 B, 8 x A100 40 GB"]


def planner(args) -> str:
    """`relaytrain plan` for BERT-Large, GPT-2 medium and GPT-2 1.5 B on V100s and A100s (the
    shipped spec-sheet profiles): the best candidate that fits its own dry run, the command, and
    for the 8-GPU requests each strategy's fastest that fits (or why none does)."""
    return _plans(PLANNER_REQUESTS, PLANNER_WHY, "request (batch: the model's usual)", "the papers")


# Today's decoders: AdamW, 2048 tokens a sample, a global batch of 32 samples (65,536 tokens), in
# the planner's precision for a decoder on a GPU (cmp_bf16, amp_bf16 where a strategy has no eager
# param server) and again in fp32 beside it.
DECODER = ["data.seq_len=2048", "optim=adamw", "plan.batch_size=32"]
RTX4090, H100 = "plan.device=rtx4090_24gb", "plan.device=h100_80gb"
DECODER_REQUESTS = {
    **{f"{label}, {where}": ([f"model={model}", *DECODER, *request], "")
       for model, label in (("llama3_8b", "Llama-3-8B"), ("qwen3_8b", "Qwen3-8B"))
       for where, request in (("1 x RTX 4090 24 GB", ["plan.workers=1", RTX4090]),
                              ("1 x H100 80 GB", ["plan.workers=1", H100]),
                              ("8 x H100 80 GB", ["plan.workers=8", H100]))},
    "Llama-3-70B, 1 x H100 80 GB": (["model=llama3_70b", *DECODER, "plan.workers=1", H100], ""),
    "Llama-3-70B, 1 x H100 80 GB, 512 GB of host memory": (
        ["model=llama3_70b", *DECODER, "plan.workers=1", H100, "plan.host_memory_gb=512"], ""),
}


def decoders(args) -> str:
    """`relaytrain plan` for Llama-3-8B and Qwen3-8B on one 24 GB card, one 80 GB card and eight,
    and Llama-3-70B on one 80 GB card with the host memory it needs: the choice, and every
    strategy's fastest that fits (or why none does)."""
    bf16 = _plans(DECODER_REQUESTS, list(DECODER_REQUESTS), "request (seq 2048, batch 32, bf16, AdamW)", None)
    fp32 = {name: ([*overrides, "precision=fp32"], paper) for name, (overrides, paper) in DECODER_REQUESTS.items()}
    return "\n\n".join([bf16, _plans(fp32, [], "request (seq 2048, batch 32, fp32, AdamW)", None)])


def _plans(requests: dict, explained: list[str], request_header: str, papers: str | None) -> str:
    """Plan each request: one row for the planner's choice (with the papers' beside it where
    `papers` names that column), and for the `explained` requests each strategy's fastest that
    fits (or why none does)."""
    from relaytrain.planner.plan import make_plan

    choices = [request_header, "planner's choice", "predicted step s", "simulated GB", "host GB (estimate)",
               "strategies that fit", "command", *([papers] if papers else [])]
    reasons = ["request", "strategy", "its fastest that fits", "predicted step s", "samples/s", "simulated GB",
               "host GB (estimate)"]
    rows, why = [], []
    for name, (overrides, paper) in requests.items():
        start = time.perf_counter()
        plan = make_plan(overrides)
        best = plan.best
        fitting = sorted({_variant(c) for c in plan.candidates if c.fits})
        papers_column = [paper] if papers else []
        if best is None:
            rows.append([name, "nothing fits", "—", "—", "—", "—", "—", *papers_column])
        else:
            rows.append([name, f"`{best.shape.strategy}` {best.shape.describe()}", f"{best.cost.step_s:.3g}",
                         f"{_gb(best)}", f"{best.host_bytes / GIB:.0f}", ", ".join(fitting),
                         f"`{plan.command(best)}`", *papers_column])
        mine = [[name, *row] for row in _each_variant(plan)] if name in explained else []
        why.extend(mine)
        # Each request's rows as soon as it is planned: a long run keeps what it has done.
        done = [f"[{name}: {time.perf_counter() - start:.0f} s]", table(choices, rows[-1:])]
        print("\n\n".join([*done, *([table(reasons, mine)] if mine else [])]) + "\n", flush=True)
    return "\n\n".join([table(choices, rows), table(reasons, why)])


def _variant(c) -> str:
    from relaytrain.planner.candidates import variant

    return variant(c.shape)


def _gb(c) -> str:
    from relaytrain.planner.candidates import GiB as PLAN_GIB

    return f"{c.memory_bytes / PLAN_GIB:.2f}"


def _each_variant(plan) -> list[list[str]]:
    """Per strategy variant, fastest first: its fastest candidate that fits its dry run, or the
    first reason its candidates were refused or did not fit."""
    fastest, reason = {}, {}
    for c in plan.candidates:
        if c.fits:
            fastest.setdefault(_variant(c), c)
        elif c.why_not:
            reason.setdefault(_variant(c), c.why_not)
    rows = [[f"`{name}`", c.shape.describe(), f"{c.cost.step_s:.3g}", f"{c.samples_per_s:.3g}", _gb(c),
             f"{c.host_bytes / GIB:.0f}"]
            for name, c in sorted(fastest.items(), key=lambda item: item[1].cost.step_s)]
    rows += [[f"`{name}`", f"none: {why}", "—", "—", "—", "—"] for name, why in reason.items() if name not in fastest]
    undecided = dict.fromkeys(_variant(c) for c in plan.candidates)
    rows += [[f"`{name}`", "not decided: slower than the choice, no dry run spent on it", "—", "—", "—", "—"]
             for name in undecided if name not in fastest and name not in reason]
    return rows


COMMANDS = {"table4": table4, "table3": table3, "figure6": figure6, "figure8": figure8, "convergence": convergence,
            "planner": planner, "decoders": decoders}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=[*COMMANDS, "all"])
    parser.add_argument("--rounds", type=int, default=2, help="measured figures: best of this many rounds")
    parser.add_argument("--steps", type=int, default=1000, help="convergence: training steps")
    parser.add_argument("--lr", type=float, default=3e-4, help="convergence: peak learning rate (AdamW)")
    parser.add_argument("--images", help="write figures (PNG) into this directory")
    parser.add_argument("--json", help="also write every table's Markdown to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("CI", "1")
    out = {}
    for name in COMMANDS if args.what == "all" else [args.what]:
        out[name] = COMMANDS[name](args)
        print(f"## {name}\n\n{out[name]}\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
