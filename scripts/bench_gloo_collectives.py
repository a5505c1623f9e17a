"""Why FSDP's reduce-scatter runs as an all-reduce on gloo (strategies/fsdp.py,
`ReduceScatterByAllReduce`): gloo's all-reduce, all-gather and reduce-scatter of the same
fp32 buffer, timed on two local worker processes with one thread each, as FSDP's workers run.

gloo's all-reduce is a pipelined ring; its reduce-scatter moves half the bytes yet takes
longer. The default size is one block of the data-parallel benchmark's model (bert_tiny with
hidden 512: 3.15 M parameters, 12.6 MB); `--numel` sets another.

    .venv/bin/python scripts/bench_gloo_collectives.py [--numel 3.15e6] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, numel: int, repeats: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    whole, shard = torch.randn(numel), torch.empty(numel // 2)
    run = {"all_reduce": lambda: dist.all_reduce(whole),
           "all_gather": lambda: dist.all_gather_single(whole, shard),
           "reduce_scatter": lambda: dist.reduce_scatter_single(output=shard, input=whole)}
    times = {name: [] for name in COLLECTIVES}
    for _ in range(repeats + 2):  # the first two warm the connections up
        for name in COLLECTIVES:
            dist.barrier()
            start = time.perf_counter()
            run[name]()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        out.put({name: statistics.median(t[2:]) for name, t in times.items()})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=3.15e6, help="fp32 elements of the whole buffer (even)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    numel = int(args.numel) // 2 * 2
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(numel, args.repeats, free_port(), out), nprocs=2)
    medians = out.get()
    print(f"gloo, 2 workers, {numel * 4 / 1e6:.1f} MB fp32, median of {args.repeats}: "
          + ", ".join(f"{name} {medians[name] * 1e3:.1f} ms" for name in COLLECTIVES))


if __name__ == "__main__":
    main()
