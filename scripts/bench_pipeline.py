"""Pipeline benchmarks (not a test): throughput ratios from one run of each contestant.

1. pipe_flush against PyTorch's own torch.distributed.pipelining.Schedule1F1B: same model,
   same partition (relaytrain's stage modules), same micro-batches, same threads per worker,
   the same tied-weight gradient sum (wte on the first stage, lm_head on the last), the same
   continuous step clock.
   Target ratio (ours / torch) >= 1.0.
2. pipe_2bw against pipe_flush at m = d, printed beside what the bubble formula predicts:
   a flush idles (d-1)/(m+d-1) of the time, 2BW (almost) never, so at most
   (m+d-1)/m times faster. On the model with 8 blocks (`EIGHT_BLOCKS`), balanced layout.
   Target >= 1.2, and >= 0.95 of the formula's prediction.
3. pipe_interleaved (v = 2 chunks a stage) against pipe_flush, both at m = 2d: the bubble
   formula predicts (m + d - 1)/(m + (d - 1)/v) times the flush's throughput, before the
   interleaved schedule's v times as many messages. Target >= 1.0; the ratio to the formula's
   prediction is reported beside it.
4. pipe_flush with strategy.layout=balanced against even, on gpt2_tiny's own shapes with 8
   blocks (hidden 128, a vocabulary of 8192: the head weighs about five blocks), d = 2, m = 4.
   Target >= 1.0, printed beside the cost model's predicted gain.

    .venv/bin/python scripts/bench_pipeline.py [--steps 14] [--rounds 5] [--json bench_pipeline.json]

Throughput is mean step time after warm-up steps, from results.json (ours) or the same
clock around `schedule.step` (torch). The contestants run in `--rounds` rounds, each
comparison's two side by side, the order reversed every other round; each comparison's
headline is the median of the rounds' own ratios, with the best round and the spread beside it.
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchlib import alternating_rounds, headline
from relaytrain.cost.formulas import fill_and_drain_bubble
from relaytrain.models.layered import MicroBatch
from relaytrain.planner.plan import predict
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.strategies.pipeline.schedule import InterleavedSchedule

MODEL = [
    "model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
    "model.intermediate_size=1024", "model.vocab_size=2048", "model.dropout=0.0",
    "data.seq_len=64", "data.num_samples=2048", "optim=sgd", "optim.lr=0.01",
]
EIGHT_BLOCKS = ["model.num_layers=8"]
HEAVY_HEAD = ["model=gpt2_tiny", "model.num_layers=8", "model.dropout=0.0", "data.seq_len=64", "data.num_samples=2048",
              "optim=sgd", "optim.lr=0.01"]
CHUNKS = 2  # model chunks a stage for pipe_interleaved: the model's 4 blocks as 2 x 2 chunks of one


def bench_cfg(strategy: str, stages: int, m: int, steps: int, warmup: int, *more: str, model: list[str] = MODEL):
    return compose_config([
        *model, f"strategy={strategy}", f"strategy.stages={stages}", f"strategy.num_microbatches={m}",
        "strategy.microbatch_size=4", f"train.steps={steps}", f"train.untimed_steps={warmup}", "train.log_every=1000",
        *more,
    ])


def ours(cfg) -> float:
    """Mean measured step time of a relaytrain pipeline run."""
    with tempfile.TemporaryDirectory() as run_dir:
        return run(cfg, run_dir)["throughput"]["step_time_s"]


# ----------------------------------------------------------------- torch.distributed.pipelining


class TorchStage(torch.nn.Module):
    """relaytrain's stage module behind the single-tensor interface torch's pipelining wants."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: input ids on the first stage, hidden states elsewhere. The last stage returns its
        # hidden state; the loss function applies the head.
        mb = MicroBatch(input_ids=x, labels=x)
        model = self.stage.model
        hidden = model.embed(x) if self.stage.first else x
        ctx = model.context(mb, hidden)
        for block in model.blocks:
            hidden = block(hidden, ctx)
        return hidden


def _torch_worker(rank: int, world: int, cfg_dict: dict, port: int, out, tuned_allocator: bool) -> None:
    from omegaconf import OmegaConf
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from relaytrain.data import build_dataset, build_loader
    from relaytrain.models import build_model
    from relaytrain.objectives.base import Divisor
    from relaytrain.run.launch import keep_freed_host_memory
    from relaytrain.step.optim import build_optimizer
    from relaytrain.strategies.base import minibatch_divisor
    from relaytrain.strategies.pipeline.stage import StageModule, partition

    cfg = OmegaConf.create(cfg_dict)
    s = cfg.strategy
    if tuned_allocator:
        keep_freed_host_memory()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    blocks = partition(cfg.model.num_layers, world)[rank]
    stage = StageModule(build_model(cfg.model, seed=0), blocks, first=rank == 0, last=rank == world - 1)
    optimizer = build_optimizer(stage.named_parameters(), cfg.optim)
    divisor = {"now": Divisor(1)}

    def loss_fn(hidden, labels):
        # torch's schedule hands the loss only the labels: the objective reads nothing else here
        return stage.model.head_loss(hidden, MicroBatch(input_ids=labels, labels=labels)).over(divisor["now"])

    # GPT-2's wte (stage 0) and lm_head (last stage) are one tied weight: as relaytrain does, sum
    # their gradients over the two copies every step, or torch would train (and time) an untied model.
    params = dict(stage.named_parameters())
    tied = [params[name] for name in stage.tied_names]
    tied_group = dist.new_group([0, world - 1]) if world > 1 else None
    pipe = PipelineStage(TorchStage(stage), rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(pipe, n_microbatches=s.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    times = []
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.train.steps):
        # The clock runs continuously, data loading included, as relaytrain's does (a step there
        # ends when the last stage's last backward of the batch ends).
        minibatch = next(loader)
        ids = torch.cat([mb.input_ids for mb in minibatch])
        labels = torch.cat([mb.labels for mb in minibatch])
        divisor["now"] = minibatch_divisor(stage.model, minibatch)
        if rank == 0:
            schedule.step(ids)
        elif rank == world - 1:
            schedule.step(target=labels)
        else:
            schedule.step()
        for p in tied:
            dist.all_reduce(p.grad, group=tied_group)
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        end = time.perf_counter()
        times.append(end - start)
        start = end
    if rank == world - 1:
        out.put(times)
    dist.destroy_process_group()


def torch_1f1b(cfg, tuned_allocator: bool = False) -> float:
    """Mean measured step time of torch's Schedule1F1B; `tuned_allocator`: with relaytrain's
    malloc setting (`launch.keep_freed_host_memory`), to show what that setting is worth."""
    import queue
    import socket

    from omegaconf import OmegaConf

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    world = cfg.strategy.stages
    config = OmegaConf.to_container(cfg, resolve=True)
    procs = [ctx.Process(target=_torch_worker, args=(r, world, config, port, out, tuned_allocator))
             for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            times = out.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a torch Schedule1F1B worker failed (its traceback is above)") from None
    for p in procs:
        p.join()
    measured = times[cfg.train.untimed_steps:]
    return sum(measured) / len(measured)


# ----------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the headline is their median ratio")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    d = args.stages

    def layout_cfg(layout: str):
        return bench_cfg("pipe_flush", d, 2 * d, args.steps, args.warmup, f"strategy.layout={layout}", model=HEAVY_HEAD)

    flush_cfg = bench_cfg("pipe_flush", d, 2 * d, args.steps, args.warmup)
    # In run order: each comparison's contestants side by side (ours_flush between its two), so a
    # ratio compares runs seconds apart, not a round's first and last, minutes apart on a VM whose
    # speed drifts; the order reverses every other round, so neither side always goes first.
    contestants = {
        "torch_flush_kept_malloc": lambda: torch_1f1b(flush_cfg, tuned_allocator=True),
        "torch_flush": lambda: torch_1f1b(flush_cfg),
        "ours_flush": lambda: ours(flush_cfg),
        "interleaved": lambda: ours(bench_cfg("pipe_interleaved", d, 2 * d, args.steps, args.warmup,
                                              f"strategy.chunks={CHUNKS}")),
        "flush_md": lambda: ours(bench_cfg("pipe_flush", d, d, args.steps, args.warmup, *EIGHT_BLOCKS)),
        "2bw_md": lambda: ours(bench_cfg("pipe_2bw", d, d, args.steps, args.warmup, *EIGHT_BLOCKS)),
        "balanced": lambda: ours(layout_cfg("balanced")),
        "even": lambda: ours(layout_cfg("even")),
    }
    rounds = alternating_rounds(contestants, args.rounds, lambda name: contestants[name]())
    best = {name: min(r[name] for r in rounds) for name in contestants}
    ours_flush, torch_flush, flush_md, two_bw_md = (best[n] for n in ("ours_flush", "torch_flush", "flush_md", "2bw_md"))

    # The headline is the median of each round's own ratio: robust to one lucky round of either side.
    predicted = 1.0 / (1.0 - fill_and_drain_bubble(d, d))
    interleaved_predicted = (1 - InterleavedSchedule.bubble(d, 2 * d, CHUNKS)) / (1 - fill_and_drain_bubble(d, 2 * d))
    headlines = {
        "flush_vs_torch_1f1b": headline([r["torch_flush"] / r["ours_flush"] for r in rounds], 1.0),
        "2bw_vs_flush_of_formula": headline([r["flush_md"] / r["2bw_md"] / predicted for r in rounds], 0.95),
        "interleaved_vs_flush": headline([r["ours_flush"] / r["interleaved"] for r in rounds], 1.0),
        "balanced_vs_even_layout": headline([r["even"] / r["balanced"] for r in rounds], 1.0),
    }
    balanced_predicted = predict(layout_cfg("even")).step_time_s / predict(layout_cfg("balanced")).step_time_s
    layouts = {name: strategy_class("pipe_flush").state_layout(layout_cfg(name))["stages"] for name in ("balanced", "even")}
    median_interleaved = headlines["interleaved_vs_flush"]["median"]
    median_flush = headlines["flush_vs_torch_1f1b"]["median"]
    median_2bw = headlines["2bw_vs_flush_of_formula"]["median"] * predicted
    figures = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rounds": rounds,
        "torch": torch.__version__,
        "model": MODEL,
        "flush_vs_torch_1f1b": {
            "stages": d, "microbatches": 2 * d, "ours_step_s": ours_flush, "torch_step_s": torch_flush,
            "ratio": torch_flush / ours_flush, "ratio_median_round": median_flush, "target": 1.0,
            "torch_with_relaytrain_malloc_setting_step_s": best["torch_flush_kept_malloc"],
            "ratio_against_that_median_round": statistics.median(
                r["torch_flush_kept_malloc"] / r["ours_flush"] for r in rounds),
        },
        "2bw_vs_flush_at_m_eq_d": {
            "stages": d, "microbatches": d, "flush_step_s": flush_md, "2bw_step_s": two_bw_md,
            "ratio": flush_md / two_bw_md, "ratio_median_round": median_2bw,
            "predicted_by_bubble_formula": predicted, "target": 1.2,
        },
        "interleaved_vs_flush": {
            "stages": d, "chunks": CHUNKS, "microbatches": 2 * d, "flush_step_s": ours_flush,
            "interleaved_step_s": best["interleaved"], "ratio_median_round": median_interleaved,
            "predicted_by_bubble_formula": interleaved_predicted,
            "of_formula_median_round": median_interleaved / interleaved_predicted, "target": 1.0,
        },
        "balanced_vs_even_layout": {
            "model": HEAVY_HEAD, "layouts": layouts, "balanced_step_s": best["balanced"], "even_step_s": best["even"],
            "ratio_median_round": headlines["balanced_vs_even_layout"]["median"],
            "predicted_by_cost_model": balanced_predicted, "target": 1.0,
        },
        "headlines": headlines,
    }
    a, b = figures["flush_vs_torch_1f1b"], figures["2bw_vs_flush_at_m_eq_d"]
    print(f"pipe_flush vs torch Schedule1F1B (d={d}, m={2 * d}): {a['ours_step_s']:.3f} s vs "
          f"{a['torch_step_s']:.3f} s per step -> ratio {a['ratio']:.2f}, median round {median_flush:.2f} (target >= 1.0)")
    print(f"pipe_2bw vs pipe_flush (d=m={d}): {b['2bw_step_s']:.3f} s vs {b['flush_step_s']:.3f} s per step -> "
          f"ratio {b['ratio']:.2f}, median round {median_2bw:.2f} (target >= 1.2; bubble formula predicts {predicted:.2f})")
    print(f"pipe_interleaved (v={CHUNKS}) vs pipe_flush (d={d}, m={2 * d}): {best['interleaved']:.3f} s vs "
          f"{ours_flush:.3f} s per step -> median round {median_interleaved:.2f} (target >= 1.0; the bubble formula "
          f"predicts {interleaved_predicted:.2f}, so {median_interleaved / interleaved_predicted:.2f} of it)")
    print(f"pipe_flush balanced {layouts['balanced']} vs even {layouts['even']} (gpt2_tiny, 8 blocks, d={d}, m={2 * d}): "
          f"median round {headlines['balanced_vs_even_layout']['median']:.2f} (target >= 1.0; the cost model predicts "
          f"{balanced_predicted:.2f})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
