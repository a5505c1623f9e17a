"""Measurements: step times, device memory from the allocator, host peak RSS from the OS.

Honesty rules (docs/design.md): throughput counts whole steps after warm-up with the device
synchronised; device memory comes from the CUDA allocator only (on CPU there is no separate
device memory, and the report says so); host memory is the OS's peak resident set size.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostMemory:
    """Peak RSS of this process. On Linux the kernel's high-water mark (VmHWM) can be reset by
    writing 5 to /proc/self/clear_refs, so each job of a multirun sweep gets its own peak."""

    def __init__(self):
        self._sampled_peak = 0

    def reset_peak(self) -> None:
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self._sampled_peak = 0  # no kernel reset: fall back to sampling

    def current_bytes(self) -> int:
        return psutil.Process().memory_info().rss

    def sample(self) -> None:
        self._sampled_peak = max(self._sampled_peak, psutil.Process().memory_info().rss)

    def peak_bytes(self) -> int:
        try:
            status = _STATUS.read_text()
        except OSError:  # no procfs (not Linux): the sampled peak is all there is
            status = ""
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        self.sample()
        return self._sampled_peak


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        # The allocator's statistics exist once CUDA is up: in a process that has not touched the
        # GPU yet, resetting them raises "Invalid device argument" (seen with torch 2.11 on an H100).
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)


def device_allocated(device: torch.device) -> int | None:
    """Bytes the CUDA allocator holds for tensors now; None where there is no separate device."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def device_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None,
                "note": "CPU run: no separate device memory (see host peak RSS)"}
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "note": "CUDA caching allocator",
    }


class PhaseTimer:
    """Wall-clock seconds per named phase, summed over the measured steps (e.g. forward, backward).

    The trainer resets it when the warm-up steps end, so phase times cover the same steps as
    the step time they are reported beside.
    """

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._paused = False

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if not self._paused:
                self.add(name, time.perf_counter() - start)

    @contextmanager
    def paused(self):
        """Work outside the steps (a pipeline's drain): its phases are not the steps' phases."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


def sequences(items: int, rows_per_item: int) -> int:
    """Sequences `items` items of the data run through the model: one a sample, two a preference
    pair (chosen and rejected, `Objective.rows_per_item`). The one count that the cost model's
    estimates (a micro-batch of strategy.microbatch_size items) and a run's tokens are sized by."""
    return items * rows_per_item


def tokens_per_step(samples: int, rows_per_item: int, seq_len: int) -> int:
    """Tokens a step of `samples` items runs through the model: every row of every item, seq_len
    each (padding included: the model computes it)."""
    return sequences(samples, rows_per_item) * seq_len


def throughput(step_times: list[float], samples_per_step: int, tokens_per_step: int, flops_per_token: float) -> dict:
    """Samples (items: a preference pair is one), tokens (of every row) and model FLOPs a second
    over the measured steps."""
    if not step_times:
        return {"samples_per_s": None, "tokens_per_s": None, "step_time_s": None, "model_flops_per_s": None}
    mean = sum(step_times) / len(step_times)
    return {
        "samples_per_s": samples_per_step / mean,
        "tokens_per_s": tokens_per_step / mean,
        "step_time_s": mean,
        "model_flops_per_s": tokens_per_step * flops_per_token / mean,
    }


def cpu_threads() -> int:
    return torch.get_num_threads() or os.cpu_count() or 1
