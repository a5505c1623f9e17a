"""AdamW with 8-bit moments and bf16 masters against fp32 ones, on the eager param server, on this
machine's CPU.

A float32 checkpoint of the Llama layout (made here by save_pretrained) trains on synthetic rows
under strategy=l2l, once with `optim.state_bits=8 optim.master_dtype=bf16` (torchao's AdamW8bit;
masters rounded back stochastically) and once with fp32 masters and moments; each run in a
process of its own, in alternating order. The runs compute in bf16 (precision=cmp_bf16, what a
GPU run uses) where this CPU multiplies bf16 at least half as fast as fp32, and in fp32
otherwise (`--precision auto`, said in the results): an AVX2 CPU without bf16 instructions
multiplies bf16 about 5 times slower than fp32, and a 40 s step hides any update. Two steps are
left out of the figures: torchao compiles its update for each tensor shape and, where an update
runs on a thread of another thread count (the caller's, finishing the EPS's queue), again. After
its run each process builds the same strategy under precision=cmp_bf16 (one short micro-batch),
steps it once and counts what its EPS holds between steps (masters, the copies that travel, the
optimizer's states: each storage once); the gradients, which live from their part's backward to
its update, are counted as the planner does (4 bytes a trained parameter in both runs).
Headlines (median over rounds):

- `lowbit_host_bytes_ratio`: the EPS's host bytes, low-bit / fp32, target <= 0.5.
- `lowbit_eps_vs_fp32_eps`: samples/s, low-bit / fp32, target >= 0.9.

Needs torchao (`pip install 'relaytrain[lowbit]'`).

    .venv/bin/python scripts/bench_lowbit.py --json bench_lowbit.json [--rounds 3]
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_muon import ACCUMULATE, MICROBATCH, SEQ, SIZES  # the same decoder and batch
from benchlib import (
    alternating_rounds,
    child_run,
    contest_args,
    contest_dirs,
    headline,
    llama_checkpoint,
    report,
)

COMPARISONS = ("lowbit_host_bytes_ratio", "lowbit_eps_vs_fp32_eps")
CONTESTANTS = {"lowbit": ["optim.state_bits=8", "optim.master_dtype=bf16"], "fp32": []}


def parse_args():
    return contest_args(__doc__, ("CONTESTANT", "WORKDIR", "PRECISION"), steps=6, untimed="the first two are",
                        comparisons=COMPARISONS, rounds=3,
                        extra=[("--precision", dict(choices=("auto", "cmp_bf16", "fp32"), default="auto",
                                                    help="what the timed runs compute in; auto: cmp_bf16 where "
                                                         "this CPU multiplies bf16 at least half as fast as fp32"))])


def timed_precision(asked: str) -> str:
    """The precision of the timed runs: as asked, or by a bf16 and an fp32 product timed here."""
    if asked != "auto":
        return asked
    import time

    import torch

    def product_s(dtype) -> float:
        a = torch.randn(512, 512, dtype=dtype)
        a @ a
        start = time.perf_counter()
        for _ in range(8):
            a @ a
        return time.perf_counter() - start

    return "cmp_bf16" if product_s(torch.bfloat16) <= 2 * product_s(torch.float32) else "fp32"


def child(contestant: str, workdir: str, precision: str, run_dir: str, steps: int) -> None:
    from relaytrain.models.pretrained import resolve
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run

    def config(*keys):
        given = [f"model.pretrained={Path(workdir) / 'checkpoint'}", f"data.seq_len={SEQ}", "data.num_samples=256",
                 "model.dropout=0.0", "strategy=l2l", "train.check_memory=false", *CONTESTANTS[contestant], *keys]
        return resolve(compose_config(given), given)

    results = run(config(f"precision={precision}", f"strategy.microbatch_size={MICROBATCH}",
                         f"strategy.num_microbatches={ACCUMULATE}", f"train.steps={steps}", "train.untimed_steps=2"),
                  Path(run_dir), table=False, quiet=True)
    # What the EPS holds depends on the precision (under cmp_bf16 a bf16 master travels itself),
    # not on the batch: counted under cmp_bf16, the layout, over one short micro-batch.
    held, trained = eps_held_bytes(config("precision=cmp_bf16", "strategy.microbatch_size=1",
                                          "strategy.num_microbatches=1"))
    (Path(run_dir) / "bench.json").write_text(json.dumps({
        "samples_per_s": results["throughput"]["samples_per_s"], "eps_held_bytes": held,
        "gradient_bytes": 4 * trained, "eps_host_bytes": held + 4 * trained, "trained_params": trained}))


def eps_held_bytes(cfg) -> tuple[int, int]:
    """What the EPS holds between steps, each storage once, and the trained parameters."""
    from relaytrain.data import build_dataset, build_loader
    from relaytrain.models import build_model
    from relaytrain.strategies import build_strategy

    strategy = build_strategy(build_model(cfg.model, seed=cfg.train.seed), cfg)
    try:
        strategy.step(next(build_loader(cfg, build_dataset(cfg), replicas=1)), cfg.optim.lr)
        strategy.drain()
        tensors = []
        for part in strategy.eps.parts:
            tensors += part.owned + part.wires
            if part.optimizer is not None:
                tensors += [v for state in part.optimizer.state.values() for v in state.values() if hasattr(v, "shape")]
        storages = {}
        for t in _plain(tensors):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()), sum(part.num_owned for part in strategy.eps.parts)
    finally:
        strategy.close()


def _plain(tensors):
    """Plain tensors, a quantized state (torchao's subclass) as the tensors it is made of."""
    for t in tensors:
        if hasattr(t, "__tensor_flatten__") and type(t).__name__.startswith("OptimState"):
            names, _ = t.__tensor_flatten__()
            yield from _plain([getattr(t, n) for n in names])
        else:
            yield t


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    precision = timed_precision(args.precision)
    with contest_dirs() as (workdir, runs, load):
        llama_checkpoint(workdir / "checkpoint", SIZES)
        rounds = alternating_rounds(list(CONTESTANTS), args.rounds,
                                    lambda c: child_run(__file__, args.steps, [c, str(workdir), precision], runs, c))
    headlines = {
        "lowbit_host_bytes_ratio": headline([r["lowbit"]["eps_host_bytes"] / r["fp32"]["eps_host_bytes"]
                                             for r in rounds], 0.5, lower_is_better=True),
        "lowbit_eps_vs_fp32_eps": headline([r["lowbit"]["samples_per_s"] / r["fp32"]["samples_per_s"]
                                            for r in rounds], 0.9),
    }
    results = {"command": f"python scripts/bench_lowbit.py --rounds {args.rounds} --steps {args.steps} "
                          f"--precision {args.precision}", "timed_precision": precision,
               "model": SIZES, "seq_len": SEQ, "microbatch": MICROBATCH, "accumulate": ACCUMULATE,
               "contestants": CONTESTANTS, "rounds": rounds, "other_load_cores": load.cores, "headlines": headlines}
    report(results, args.json)


if __name__ == "__main__":
    main()
