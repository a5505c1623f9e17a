"""This machine's bandwidths, timed for a measured profile (`relaytrain.cost.profile.measure`):
host to device over pinned memory, a device's own memory, between two GPUs, and gloo between two
CPU ranks over localhost (the transport CPU workers use)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from relaytrain.utils.errors import ConfigError

REPEATS = 5  # timed repetitions per figure, after one warm-up (the profile keeps their median)


def pinned_copy_rate(device: torch.device, megabytes: int = 256) -> float:
    """Host -> device bytes/s of a pinned copy, timed (the L2L relay's uploads are pinned)."""
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(REPEATS):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return REPEATS * host.numel() / (time.perf_counter() - start)


def memory_rate(device: torch.device, megabytes: int = 256) -> float:
    """Bytes/s read from `device`'s memory, timed as a copy within it (each byte read and written)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(REPEATS):
        target.copy_(source)
    _synchronize(device)
    return 2 * REPEATS * source.numel() / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def links_of_this_machine(device: torch.device, workers: int) -> tuple[float, float, float, str]:
    """Stage-to-stage and all-reduce bandwidth (bytes/s) and latency per message, and how they
    were found. CPU workers talk over gloo on localhost: timed between two spawned processes
    (only when a run may have several workers). CUDA: a copy between the first two devices."""
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            return float("inf"), float("inf"), 0.0, "one CUDA device: no link between workers"
        rate = _device_copy_rate()
        return rate, rate, 20e-6, "timed cuda:0 -> cuda:1 copy (all-reduce assumed at the same rate)"
    if workers < 2:
        return float("inf"), float("inf"), 0.0, "one worker: no link between workers"
    p2p, allreduce, latency = gloo_rates()
    return p2p, allreduce, latency, "gloo over localhost TCP between two ranks, timed"


GLOO_BYTES = 16 * 2**20


def gloo_rates() -> tuple[float, float, float]:
    """Point-to-point bytes/s, all-reduce bus bytes/s and per-message latency of gloo on this
    machine: two ranks over localhost TCP, the transport CPU workers use, as two threads of
    this process (gloo releases the GIL while it moves bytes)."""
    store = dist.HashStore()
    figures: dict[int, tuple[float, float, float]] = {}
    ranks = [threading.Thread(target=_gloo_rank, args=(rank, store, figures)) for rank in (0, 1)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    if 0 not in figures:
        raise ConfigError("timing gloo on this machine failed; plan with plan.workers=1")
    return figures[0]


def _gloo_rank(rank: int, store, figures: dict) -> None:
    group = dist.ProcessGroupGloo(dist.PrefixStore("relaytrain-plan", store), rank, 2, timedelta(seconds=60))
    big, small = torch.ones(GLOO_BYTES // 4), torch.ones(1)
    peer = 1 - rank

    def round_trip(t: torch.Tensor) -> None:
        first, second = (group.send, group.recv) if rank == 0 else (group.recv, group.send)
        first([t], peer, 0).wait()
        second([t], peer, 0).wait()

    def timed(fn) -> float:
        fn()
        group.barrier().wait()
        start = time.perf_counter()
        for _ in range(REPEATS):
            fn()
        return (time.perf_counter() - start) / REPEATS

    latency = timed(lambda: round_trip(small)) / 2
    one_way = max(timed(lambda: round_trip(big)) / 2 - latency, 1e-9)
    allreduce = timed(lambda: group.allreduce([big]).wait())
    figures[rank] = (GLOO_BYTES / one_way, GLOO_BYTES / allreduce, latency)


def _device_copy_rate(megabytes: int = 256) -> float:
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device="cuda:0")
    target = torch.empty_like(source, device="cuda:1")
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        target.copy_(source)
    torch.cuda.synchronize()
    return REPEATS * source.numel() / (time.perf_counter() - start)
