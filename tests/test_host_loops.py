"""relaytrain's host loop for torchao's AdamW8bit and AdamW4bit (`step/host_loops.py`): the same
update as torchao's compiled one, state for state and weight for weight (bf16 masters' rounding loop:
tests/test_bf16_masters.py).

torch builds the loop with the C++ compiler on its first use (about 30 s on the 2-core VM): the
slow step's. The table that replaces the search is checked in the default suite.
"""

from __future__ import annotations

import pytest
import torch

from relaytrain.step.host_loops import _values, code_table, host_loops
from relaytrain.step.lowbit import optimizer_class
from tests.conftest import needs_extra

pytestmark = needs_extra("torchao", "lowbit")
STEPS = 4


def maps() -> list[torch.Tensor]:
    """torchao's maps: signed and unsigned, 8 and 4 bits."""
    from torchao.optim.subclass_4bit import get_qmap_signed as signed4
    from torchao.optim.subclass_4bit import get_qmap_unsigned as unsigned4
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return [torch.tensor(f()) for f in (get_qmap_signed, get_qmap_unsigned, signed4, unsigned4)]


@pytest.mark.parametrize("qmap", range(4), ids=["signed8", "unsigned8", "signed4", "unsigned4"])
def test_the_table_gives_torchaos_codes_at_every_turn_and_over_every_decade(qmap):
    """The table's code of a value (one lookup and one comparison) is torchao's binary search and
    rounding: on both sides of every turn from one code to the next, at the map's values and their
    midpoints, and for values over every decade of the map."""
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

    qmap = maps()[qmap]
    table = code_table(qmap)
    turns = table.long() >> 8
    buckets = torch.arange(table.numel(), dtype=torch.int64)
    starts = ((buckets - (1 << 16)) << 15)[turns < (1 << 15)] + turns[turns < (1 << 15)]
    torch.manual_seed(0)
    x = torch.rand(1 << 16) * 2 - 1
    x = torch.cat([x * 10.0 ** -k for k in range(8)] + [qmap, (qmap[:-1] + qmap[1:]) / 2,
                   _values(starts), _values(starts - 1), torch.tensor([0.0, -0.0, 1.0, -1.0])])
    bits = x.view(torch.int32)
    ordered = bits ^ (bits >> 31).bitwise_and(0x7FFFFFFF)
    entry = table.long()[(ordered >> 15) + (1 << 16)]
    codes = (entry & 0xFF) + ((ordered & 0x7FFF) >= (entry >> 8)).long()
    quantize = quantize_8bit_with_qmap if qmap.numel() == 256 else quantize_4bit_with_qmap
    assert torch.equal(codes.to(torch.uint8), quantize(x, qmap))


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


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_the_loop_s_path_without_avx2_steps_as_its_vector_path(bits, monkeypatch):
    """The loop's one-value-at-a-time path is what a CPU without AVX2 runs (an Arm host beside a
    GPU). Built here with AVX2 switched off (about 30 s, once), it makes the vector path's
    weights, codes and scales bit for bit: the same operations in the same order."""
    from relaytrain.step import lowbit
    from relaytrain.step.host_loops import build_loops

    vector, scalar = host_loops(), build_loops("relaytrain_host_loops_scalar", ["-mno-avx2"])
    assert vector is not None and scalar is not None
    torch.manual_seed(1)
    grads = [torch.randn(256, 96) * 10.0 ** -k for k in range(STEPS)]
    stepped = []
    for op in (vector, scalar):
        monkeypatch.setattr(lowbit, "host_loops", lambda wanted=True, op=op: op)
        (p, optimizer), _ = pair((256, 96), bits)
        train(p, optimizer, grads)
        stepped.append((p.detach(), optimizer.state[p]))
    (p, state), (q, other) = stepped
    assert torch.equal(p, q)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key].codes, other[key].codes) and torch.equal(state[key].scale, other[key].scale)
