"""Small tensor helpers every layer uses."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (its storage: writing to it writes the DTensor); a plain tensor is its own."""
    return t.to_local() if isinstance(t, DTensor) else t
