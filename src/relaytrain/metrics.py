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

from relaytrain.models.family import BlockShape

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


def model_flops_per_token(num_params: int, num_layers: int, attention_width: int, seq_len: int) -> float:
    """Training FLOPs per token of the model's math (6N plus attention scores), without recompute.

    An estimate from the model's shape, the usual "model FLOPs" convention: recomputation
    is work the strategy chose to do, not work the model needs. The attention term, 3 x 4 s
    per query value, takes the queries' width (`attention_width`: heads x head width, the
    hidden size unless a model sets its heads' width apart from it).
    """
    return 6.0 * num_params + 12.0 * num_layers * attention_width * seq_len


def attention_width(m) -> int:
    """The `model` config's query width, heads x head width, as its family reports the block."""
    return query_width(block_shape(m))


# --------------------------------------------------------------------------- a block's widths and work


def block_shape(m) -> BlockShape:
    """One block's widths, as the model's family reports them for the `model` keys."""
    from relaytrain.models import family_spec  # the families register themselves on import

    return family_spec(m.family).block_shape(m)


def query_width(shape: BlockShape) -> int:
    """Width of the queries (and of the attention's output): heads x head width."""
    return shape.num_heads * shape.head_dim


def key_value_width(shape: BlockShape) -> int:
    """Width of the keys, and of the values: grouped-query attention has fewer heads for them."""
    return shape.num_kv_heads * shape.head_dim


def mlp_projections(shape: BlockShape) -> int:
    """Weight matrices of the MLP: up and down, and a gate beside up in a gated MLP (SwiGLU, GeGLU)."""
    return 3 if shape.gated_mlp else 2


def block_matmul_flops(shape: BlockShape) -> int:
    """Forward FLOPs of one block's weight matmuls per token: 2 x (the query, key, value and
    output projections, h x q + 2 h x kv + q x h, and the MLP's 2 or 3 matrices of h x i): 24 h^2
    for BERT's and GPT-2's (q = kv = h, i = 4 h)."""
    h, q, kv = shape.hidden, query_width(shape), key_value_width(shape)
    return 2 * (h * q + 2 * h * kv + q * h + mlp_projections(shape) * h * shape.intermediate)


def attention_flops(shape: BlockShape, seq_len: int) -> int:
    """Forward FLOPs of one block's attention per token, scores and their weighted sum over the
    values: 2 x 2 s q (every query head scores all s positions, grouped or not; causal
    masking is not subtracted, as in the usual model-FLOPs count)."""
    return 4 * seq_len * query_width(shape)


def throughput(step_times: list[float], samples_per_step: int, tokens_per_step: int, flops_per_token: float) -> dict:
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
