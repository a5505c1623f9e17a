"""Measurements a report relies on."""

import subprocess
import sys

import pytest
import torch

from relaytrain.step import metrics

# In a process of its own: a run earlier in the test process (launch.keep_freed_host_memory) may
# have made glibc keep freed memory, which the 256 MiB below would then reuse without growing the RSS.
PEAK_RESET = """
import torch
from relaytrain.step import metrics
host = metrics.HostMemory()
host.reset_peak()
before = host.peak_bytes()
big = torch.ones(64 * 2**20)  # 256 MiB, touched
during = host.peak_bytes()
del big
host.reset_peak()
after = host.peak_bytes()
assert during - before >= 200 * 2**20, (before, during)
assert after < during - 200 * 2**20, (during, after)  # the next job does not inherit this one's peak
"""


def test_host_peak_resets_between_jobs_of_a_sweep():
    done = subprocess.run([sys.executable, "-c", PEAK_RESET], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_cpu_runs_report_no_device_memory_rather_than_a_meaningless_number():
    figures = metrics.device_memory(torch.device("cpu"))
    assert figures["peak_allocated_bytes"] is None and "no separate device memory" in figures["note"]


def test_throughput_is_over_the_measured_steps():
    t = metrics.throughput([0.5, 0.5], samples_per_step=8, tokens_per_step=1024, flops_per_token=10.0)
    assert t == {"samples_per_s": 16.0, "tokens_per_s": 2048.0, "step_time_s": 0.5, "model_flops_per_s": 20480.0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_come_from_the_allocator():
    device = torch.device("cuda")
    metrics.reset_device_peak(device)
    x = torch.empty(2**28, dtype=torch.uint8, device=device)
    assert metrics.device_memory(device)["peak_allocated_bytes"] >= 2**28
    del x
