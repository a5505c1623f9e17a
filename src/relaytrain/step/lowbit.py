"""AdamW with its moments in 8 or 4 bits (`optim.state_bits`): torchao's AdamW8bit and AdamW4bit.

The algorithm and the kernels are torchao's (`pip install 'relaytrain[lowbit]'`); relaytrain
only builds them from its keys and steps them where it steps AdamW (the eager param server's
parts, a whole-model strategy's optimizer). In torchao's scheme each moment of a tensor of at
least 4096 elements whose count the block divides is kept as codes on a quantization map, 8
bits (blocks of 256 elements) or 4 (blocks of 128), with one fp32 scale per block; smaller
tensors (norms, biases) keep fp32 moments. A step dequantizes both moments, makes AdamW's
update in fp32 and quantizes them again. torchao compiles that update once per tensor shape
(torch.compile, on a C++ compiler on the CPU): the first step of a run pays for it.

Checkpoints keep the codes and scales themselves (torchao's tensor subclasses, saved and loaded
by torch), so a resumed run steps the same states as the uninterrupted one.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from relaytrain.utils.errors import ConfigError

BLOCK = {8: 256, 4: 128}  # torchao's default block of each width
# torchao's update on a CPU against torch's fused fp32 AdamW, per parameter: its quantization
# finds each code by a branchless binary search of the map (eight lookups and comparisons a
# value in 8 bits), and decoding looks the codes up again. Measured on the 2-core VM
# (2026-11-29, one 4 M-parameter tensor, 2 threads, compiled): 107.7 ms (8-bit) and 289.0 ms
# (4-bit) against 2.8 ms. The planner times a host update from fp32's bytes times this; on a
# GPU torchao's update is bandwidth-bound like AdamW's, and the bytes alone count there. The
# same algorithm in torch's eager kernels is no faster on a CPU (2026-11-30: searchsorted alone
# takes 110 ms for 4 M values; a table over the values' fp32 bits in place of the search, in
# chunks, 147 ms the whole update against torchao's 95): what would help is a C++ loop.
HOST_TIME_VS_FP32 = {32: 1.0, 8: 38.0, 4: 100.0}
STATE_BITS = (32, *BLOCK)  # 32: torch's AdamW with fp32 moments
_CLASSES: dict[int, type] = {}


def state_bits(o) -> int:
    """The width of AdamW's moments the optimizer keys ask for; 32 for every other optimizer."""
    return o.get("state_bits", 32)


def state_words(bits: int) -> float:
    """fp32 words of AdamW state per parameter: two moments of `bits` and a scale per block each
    (the tensors torchao leaves in fp32 are too few to count)."""
    return 2.0 if bits == 32 else 2 * (bits / 32 + 1 / BLOCK[bits])


def lowbit_adamw(groups: list[dict], o) -> torch.optim.Optimizer:
    """torchao's AdamW with `o.state_bits`-bit moments over relaytrain's parameter groups."""
    return optimizer_class(o.state_bits)(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def optimizer_class(bits: int) -> type:
    """torchao's AdamW8bit or AdamW4bit with the interface relaytrain steps optimizers through."""
    if bits not in _CLASSES:
        # torch's compile cache says once that torchao's state tensors give it no stable hash:
        # nothing a run can act on (the update is only compiled again in a new process).
        warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
        base = getattr(_torchao_optim(bits), f"AdamW{bits}bit")
        _CLASSES[bits] = type(f"LowBitAdamW{bits}", (_Stepped, base), {"kernel": f"torchao AdamW{bits}bit"})
    return _CLASSES[bits]


def check_available(bits: int) -> None:
    """Refuse in one line where torchao is missing."""
    if bits != 32:
        _torchao_optim(bits)


class _Stepped:
    """`update()` and `drop_grads()`, as the eager param server steps its parts (`StepEachGroup`);
    under a dispatch mode (a dry run's memory tracker, which torch.compile refuses) the update
    runs uncompiled: the same operations and allocations."""

    def step(self, closure=None):
        if not is_in_torch_dispatch_mode():
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)

    def update(self) -> None:
        self.step()

    def drop_grads(self) -> None:
        self.zero_grad(set_to_none=True)


def _torchao_optim(bits: int):
    try:  # quiet at import: relaytrain/__init__.py lowers torchao's logger
        import torchao.optim
    except ImportError as err:
        raise ConfigError(f"optim.state_bits={bits} keeps AdamW's moments with torchao, which is not installed "
                          f"({err}); pip install 'relaytrain[lowbit]'") from err
    return torchao.optim
