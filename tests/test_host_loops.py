"""relaytrain's host loop for torchao's AdamW8bit and AdamW4bit (`step/host_loops.py`): the same
update as torchao's compiled one, state for state and weight for weight (bf16 masters' rounding loop:
tests/test_bf16_masters.py).

torch builds the loop with the C++ compiler on its first use (about 30 s on the 2-core VM): the
slow step's. The table that replaces the search is checked in the default suite.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from relaytrain.step.host_loops import floors, host_loops
from relaytrain.step.lowbit import optimizer_class

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is the lowbit extra: make test-slow installs it")
STEPS = 4


def maps() -> list[torch.Tensor]:
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return [torch.tensor(get_qmap_signed()), torch.tensor(get_qmap_unsigned())]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_table_gives_the_search_result_at_every_bucket_start_and_value(signed):
    """At a bucket's lowest value the table is the search's answer; one comparison with the next
    map value gives it anywhere else, torchao's codes for values over every decade of the map."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    qmap = maps()[0 if signed else 1]
    table = floors(qmap)
    torch.manual_seed(0)
    x = torch.rand(1 << 16) * (2 if signed else 1) - (1 if signed else 0)
    x = torch.cat([x * 10.0 ** -k for k in range(8)] + [qmap, (qmap[:-1] + qmap[1:]) / 2])
    bits = x.view(torch.int32)
    bucket = (bits ^ (bits >> 31).bitwise_and(0x7FFFFFFF)).bitwise_right_shift(15) + (1 << 16)
    below = table.long()[bucket]
    below = below + ((below < 255) & (x >= qmap[(below + 1).clamp(max=255)])).long()
    above = (below + 1).clamp(max=255)
    codes = torch.where((x - qmap[below]) >= (qmap[above] - qmap[below]) * 0.5, above, below)
    assert torch.equal(codes.to(torch.uint8), quantize_8bit_with_qmap(x, qmap))


def pair(shape, bits: int = 8):
    """Our optimizer and torchao's over equal copies of one tensor."""
    import torchao.optim

    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(shape))
    theirs = torch.nn.Parameter(ours.detach().clone())
    keys = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    torchaos = getattr(torchao.optim, f"AdamW{bits}bit")
    return (ours, optimizer_class(bits)([ours], **keys)), (theirs, torchaos([theirs], **keys))


def train(p, optimizer, grads) -> None:
    for grad in grads:
        p.grad = grad
        optimizer.step()


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "bits"), [((256, 96), 8), ((4096,), 8), ((300,), 8), ((256, 96), 4)], ids=str)
def test_steps_equal_torchaos_compiled_update(shape, bits):
    """Bit for bit on this VM (2026-11-30); allowed to float noise, with a rare code flipped to its
    neighbour, where another compiler rounds an intermediate differently. A tensor torchao does
    not quantize (300 values) takes torchao's own update."""
    assert host_loops() is not None
    (ours, mine), (theirs, reference) = pair(shape, bits)
    grads = [torch.randn(shape) * 10.0 ** -k for k in range(STEPS)]  # moments over several decades of the map
    train(ours, mine, grads)
    train(theirs, reference, grads)
    assert mine.kernel == f"torchao AdamW{bits}bit, relaytrain's host loop"
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = mine.state[ours][key], reference.state[theirs][key]
        if hasattr(a, "codes"):
            assert (a.codes != b.codes).float().mean() <= 1e-3, key
            torch.testing.assert_close(a.scale, b.scale, atol=0, rtol=1e-5)
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=1e-6)


@pytest.mark.slow
def test_a_dry_run_earlier_in_the_process_leaves_the_loop_on(monkeypatch):
    """What turns the loop off is a dispatch mode on this thread (a dry run's tracker), not torch's
    process-wide flag of one, which an earlier dry run's ranks (threads) once left set: the slow
    step's loop tests then ran torchao's kernel. The meta tensors a dry run's EPS thread steps
    take torchao's update uncompiled."""
    from torch.utils import _python_dispatch

    assert host_loops() is not None
    monkeypatch.setattr(_python_dispatch, "_is_in_torch_dispatch_mode", True)
    (_, mine), _ = pair((256, 96))
    assert mine.kernel == "torchao AdamW8bit, relaytrain's host loop"
    shape = (256, 96)
    dry = torch.nn.Parameter(torch.empty(shape, device="meta"))
    optimizer = optimizer_class(8)([dry], lr=1e-2)
    dry.grad = torch.empty(shape, device="meta")
    optimizer.step()
    assert optimizer.kernel == "torchao AdamW8bit"
    assert type(optimizer.state[dry]["exp_avg"]).__name__ == "OptimState8bit"
