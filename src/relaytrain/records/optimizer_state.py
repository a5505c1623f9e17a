"""Optimizer state in a checkpoint: each parameter's, keyed by the parameter's name, copied to
the host (`optimizer_state`), and put back through torch's own `load_state_dict`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor


def optimizer_state(optimizers, name_of: Callable[[torch.Tensor], str]) -> dict:
    """Every optimizer's per-parameter state, keyed by parameter name."""
    by_name = {}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            by_name[name_of(p)] = {k: host_copy(v) if torch.is_tensor(v) else v for k, v in state.items()}
    return by_name


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a state tensor. A tensor subclass (torchao's 8- and 4-bit moments: codes,
    scales and their map) is copied part by part and rebuilt, as it flattens itself for torch."""
    if type(t) is torch.Tensor or isinstance(t, DTensor) or not hasattr(t, "__tensor_flatten__"):
        return t.detach().cpu().clone()
    names, context = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: host_copy(getattr(t, n)) for n in names}, context, t.shape, t.stride())


def load_optimizer_state(optimizers, name_of: Callable[[torch.Tensor], str], by_name: dict) -> None:
    # Rebuilt in torch's own (index-keyed) format so `load_state_dict` applies torch's rules for
    # where each state tensor lives (fused kernels keep `step` on the device, others on the CPU);
    # the config's hyperparameters stay, only per-parameter state comes from the checkpoint.
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state_dict = optimizer.state_dict()
        state_dict["state"] = {i: by_name[name_of(p)] for i, p in enumerate(params) if name_of(p) in by_name}
        optimizer.load_state_dict(state_dict)
