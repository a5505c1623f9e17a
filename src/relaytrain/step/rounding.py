"""bf16 masters (`optim.master_dtype=bf16`): weights kept in bf16, each update made in fp32 and
rounded back stochastically, the draws keyed like dropout.

The eager param server keeps its masters at 2 bytes a parameter instead of 4, and under
`cmp_bf16` they are also what travels to the device, so there is no second copy. Rounding an
update to nearest would lose every change smaller than half a bf16 step (1/256 of the weight),
which late in training is most of them; stochastic rounding rounds away from zero with the
probability of the dropped fraction, so a weight moves by its update on average. The rule is
torchao's `_fp32_to_bf16_sr` (the low 16 bits of the fp32 pattern against 16 random bits;
tests/test_bf16_masters.py checks the two agree on the same draws).

The draws are not torch's generator's: they are a hash of (train.seed, the parameter's name in
the Hugging Face model, its update count, the element's index), so a parameter rounds alike
whichever strategy, part layout, worker or thread steps it, and a resumed run draws what the
uninterrupted one drew. The hash is integer arithmetic on int32 tensors (exact on every device:
a multiply wraps modulo 2^32, which the tests check against Python's integers), in chunks that
stay in the cache: 9.5 ms for 4 M parameters on the 2-core VM, against 2.2 ms for torch's fused
AdamW of them; relaytrain's C++ loop (`host_loops`, `optim.host_loops`) makes the same bits in
1.2 ms, and runs wherever it builds.

`Bf16Masters` is the server's side. The optimizer does not step the bf16 masters: it steps an
fp32 *stand-in* per master, an `nn.Parameter` whose storage exists only while its part updates.
Gradients sum on the stand-ins' `.grad` in fp32 (a bf16 `.grad` would sum micro-batches and tied
uses in bf16), so clipping, the fp16 overflow check and the optimizer see what they see with
fp32 masters. An update lends each stand-in an fp32 copy of its master (`KeptTensors`), the
optimizer steps, and the result is rounded back into the master. The update count of the key
lives in the stand-in's optimizer state (`ROUNDED`), so a checkpoint carries it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from relaytrain.step.flat import KeptTensors
from relaytrain.step.host_loops import host_loops

# What bf16 masters add to a host update, against torch's fused fp32 AdamW's own time: the copy up
# to fp32 and the rounding back, in relaytrain's C++ loop (optim.host_loops) or torch's kernels.
# Measured on the 2-core VM (2026-11-30, one 4 M-parameter tensor, 2 threads): 4.8 ms for the whole
# update against AdamW's 2.2 ms with the loop (the rounding 1.2 ms); 15.1 ms without (median of 5,
# the rounding 9.5 ms). The planner's host time adds it.
ROUNDING_VS_FP32_ADAMW = {True: 1.2, False: 5.9}
CHUNK = 1 << 18  # elements per pass: the int32 scratch of a chunk stays in a core's cache
_GOLDEN, _MIX1, _MIX2 = -1640531535, 0x7FEB352D, -2073254261  # int32 forms of 0x9E3779B1 and lowbias32's constants


def bf16_masters(o) -> bool:
    """Whether the optimizer keys `o` ask for bf16 masters."""
    return str(o.get("master_dtype", "fp32")) == "bf16"


def rounding_key(seed: int, name: str, update: int) -> int:
    """The 32-bit key (as a signed int32) of one parameter's rounding at one update."""
    digest = hashlib.blake2b(f"{seed}/{name}/{update}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little", signed=True)


@torch.no_grad()
def round_to_bf16(x: torch.Tensor, out: torch.Tensor, key: int, loops: bool = False) -> None:
    """`out` (bf16) = `x` (fp32, contiguous) rounded stochastically under `key`, element i with
    the draw `draws(key, i)`; `loops`: in relaytrain's C++ loop (`host_loops`) where it builds,
    one pass to the same bits."""
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or x.shape != out.shape:
        raise TypeError(f"round_to_bf16 takes an fp32 tensor and a bf16 one of its shape, not {x.dtype} "
                        f"{tuple(x.shape)} and {out.dtype} {tuple(out.shape)}")
    if x.device.type == "meta":  # a dry run: no values, and the chunks' scratch is too small to count
        return
    op = host_loops(loops) if x.device.type == "cpu" and x.is_contiguous() and out.is_contiguous() else None
    if op is not None:
        op.round_to_bf16(x, out, key)
        return
    bits, target = x.reshape(-1).view(torch.int32), out.view(-1).view(torch.int16)
    n = bits.numel()
    draw = torch.empty(min(n, CHUNK), dtype=torch.int32, device=x.device)
    other = torch.empty_like(draw)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        d, o, b = draw[:stop - start], other[:stop - start], bits[start:stop]
        _draws(d, o, start, key)
        torch.bitwise_and(b, 0xFFFF, out=o)  # the fraction bf16 drops, as an integer in [0, 2^16)
        torch.gt(o, d, out=o)  # 1 with probability fraction / 2^16
        torch.bitwise_right_shift(b, 16, out=d)  # toward zero: the pattern's upper half
        target[start:stop].copy_(d.add_(o))  # away from zero (sign and magnitude) when drawn


def draws(key: int, n: int, start: int = 0) -> torch.Tensor:
    """The 16-bit draws of elements start .. start+n under `key` (int32 in [0, 2^16))."""
    out = torch.empty(n, dtype=torch.int32)
    _draws(out, torch.empty_like(out), start, key)
    return out


def _draws(h: torch.Tensor, scratch: torch.Tensor, start: int, key: int) -> None:
    """lowbias32 (Wellons' integer hash) of (index * golden + key), low 16 bits, into `h`."""
    torch.arange(start, start + h.numel(), dtype=torch.int32, out=h)
    h.mul_(_GOLDEN).add_(key)
    for shift, multiplier in ((16, _MIX1), (15, _MIX2), (16, None)):
        # int32 shifts are arithmetic: the sign's copies are masked off, as an unsigned shift.
        torch.bitwise_right_shift(h, shift, out=scratch).bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(scratch)
        if multiplier is not None:
            h.mul_(multiplier)
    h.bitwise_and_(0xFFFF)


ROUNDED = "rounded_updates"  # optimizer-state key: the updates rounded into this parameter's master


class Bf16Masters:
    """The fp32 stand-ins of bf16 masters and the rounding of their updates, for one EPS."""

    def __init__(self, seed: int, name_of: Callable[[nn.Parameter], str], loops: bool = True):
        self.seed = seed
        self.name_of = name_of  # a master's name in the model (the key of its rounding)
        self.loops = loops  # optim.host_loops: round in relaytrain's C++ loop where it builds
        self._stand_in: dict[int, nn.Parameter] = {}  # id(master) -> its stand-in (a tied master has one)
        self.master_of: dict[int, nn.Parameter] = {}  # id(stand-in) -> its master
        self._pool = KeptTensors()  # the fp32 copies an update works on, kept from part to part

    def stand_in(self, master: nn.Parameter) -> nn.Parameter:
        """The fp32 parameter the optimizer steps for `master` (storage only while it updates)."""
        proxy = self._stand_in.get(id(master))
        if proxy is None:
            proxy = nn.Parameter(_no_storage(master.shape, master.device))
            self._stand_in[id(master)] = proxy
            self.master_of[id(proxy)] = master
        return proxy

    @contextmanager
    def updating(self, optimizer: torch.optim.Optimizer, proxies: list[nn.Parameter]) -> Iterator[None]:
        """While the body steps `optimizer`, `proxies` hold fp32 copies of their masters; after,
        each one that stepped (it had a gradient) is rounded back into its master."""
        masters = [self.master_of[id(p)] for p in proxies]
        work = [self._pool.take(m) for m in masters]
        with torch.no_grad():
            for proxy, master, w in zip(proxies, masters, work, strict=True):
                proxy.data = w.copy_(master)
        try:
            yield
            self._round(optimizer, proxies, masters)
        finally:
            self._pool.give_back(work)
            for proxy in proxies:
                proxy.data = _no_storage(proxy.shape, proxy.device)

    def _round(self, optimizer, proxies, masters) -> None:
        for proxy, master in zip(proxies, masters, strict=True):
            if proxy.grad is None:  # did not step (no gradient this step)
                continue
            state = optimizer.state[proxy]  # made here for a rule that keeps none (SGD without momentum)
            update = state.get(ROUNDED, 0)
            round_to_bf16(proxy.data, master.data, rounding_key(self.seed, self.name_of(master), update), self.loops)
            state[ROUNDED] = update + 1


def _no_storage(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that holds one element (a stand-in at rest): its shape and count are
    what an optimizer reads when it is built (parameter groups, flat state offsets)."""
    return torch.zeros((), device=device).expand(shape)
