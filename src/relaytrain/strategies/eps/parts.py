"""A part and its flat buffers: what the EPS keeps of one relayed unit.

The model is split into *parts* in relay order: the embeddings, every block, the head. The
EPS keeps, per part, the fp32 master weights (the model's own parameters, so the Hugging
Face model always holds the trained weights), one optimizer built by `build_optimizer`
(the same update rule as the baseline's; AdamW, LAMB and SGD are all per-tensor, so
stepping part by part gives exactly the whole-model step) and a *wire* copy: what travels
to the device (the master itself for fp32, a half copy for cross mixed precision).

Flat buffers (`relaytrain.step.flat`). A part's own masters live in one contiguous buffer,
`Part.buffer`, in param-group order; each parameter's `.data` is a view into it, so the
model, checkpoints and `save_pretrained` see the same parameters as before. The part's
optimizer is the flat variant of the configured one (`build_optimizer(flat=True)`): its
state (Adam's moments, SGD's momentum) is one buffer per kind with a view per parameter,
keyed by parameter as torch's is (the checkpoint format does not change), and fused AdamW
updates the part with one kernel call per param group (decayed or not), without the Python
torch.optim wraps around each call. The numbers are bit for bit those of torch's per-tensor
optimizers. Gradients stay the tensors that arrive: gathering them into a buffer would add
a pass over every gradient, which costs more than it saves (docs/l2l.md, "Flat buffers").

Tied weights (GPT-2's `wte` and LM head) are one Parameter: the first part that uses it
(the embeddings) owns it, the head only uses it. Both parts' gradients are added into the
one master `.grad` (the head's arrives first), and only the owner's optimizer updates it.

bf16 masters (`optim.master_dtype=bf16`, `step.rounding.Bf16Masters`): the buffer is bf16, and the optimizer
steps fp32 stand-ins, on which the gradients sum (`Part.stepped`, `Part.summed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from relaytrain.step.flat import KeptTensors, flatten
from relaytrain.step.optim import param_groups

if TYPE_CHECKING:
    from relaytrain.step.rounding import Bf16Masters


@dataclass
class Part:
    """One relayed unit: its compute module and the master tensors it uses and owns."""

    name: str
    module: nn.Module
    names: list[str]  # parameter names inside `module`, for functional calls on the device
    masters: list[nn.Parameter]  # fp32 host parameters the module uses (tied ones included)
    owned: list[nn.Parameter]  # the subset this part's optimizer updates
    owned_names: list[str]
    wires: list[torch.Tensor]  # host copies in the device's dtype (the masters themselves in fp32)
    buffer: torch.Tensor | None  # the owned masters, contiguous (their `.data` are views); None if none
    # The frozen base an adapter sits on (adapter=lora): it travels to the device with the part
    # but has no master, no gradient and no optimizer state; kept in `frozen_dtype` on the host.
    frozen_names: list[str] = field(default_factory=list)
    frozen: list[torch.Tensor] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None  # None on a replica that does not own the part
    # What the optimizer steps, aligned with `owned`, and what gradients sum into, aligned with
    # `masters`: the masters themselves, or with bf16 masters their fp32 stand-ins.
    stepped: list[nn.Parameter] = field(default_factory=list)
    summed: list[nn.Parameter] = field(default_factory=list)

    @property
    def num_owned(self) -> int:
        return sum(p.numel() for p in self.owned)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.masters)



def build_parts(modules, wire_dtype: torch.dtype, pin: bool, frozen_dtype: torch.dtype | None = None,
                bf16: Bf16Masters | None = None) -> list[Part]:
    """The parts in relay order. A master belongs to the first part that uses it; each part's
    own masters move into one buffer (every replica builds the same layout), then the wires
    are made, so a wire of the masters' dtype is a view of the buffer too. Frozen parameters
    (an adapter's base) are no masters: they travel as they are, or stored in `frozen_dtype`
    where given. `bf16`: the masters are kept in bf16, and stepped through its stand-ins."""
    parts, wire_of = [], {}  # wire_of: id(master) -> its one wire, shared by every part using it
    for name, module in modules:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        owned = [(n, p) for n, p in named if id(p) not in wire_of]
        buffer = flatten(_layout(owned), pin, torch.bfloat16 if bf16 else None) if owned else None
        for _, p in owned:
            wire_of[id(p)] = _wire(p, wire_dtype, pin)
        masters = [p for _, p in named]
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]  # a tied one once
        part = Part(name, module, [n for n, _ in named], masters, [p for _, p in owned], [n for n, _ in owned],
                    [wire_of[id(p)] for p in masters], buffer,
                    [n for n, _ in frozen], [_frozen(p, frozen_dtype, pin) for _, p in frozen])
        stand_in = bf16.stand_in if bf16 else (lambda p: p)
        part.stepped, part.summed = [stand_in(p) for p in part.owned], [stand_in(p) for p in masters]
        parts.append(part)
    return parts


@torch.no_grad()
def _frozen(p: nn.Parameter, dtype: torch.dtype | None, pin: bool) -> torch.Tensor:
    """The host copy of a frozen parameter that travels: the parameter itself, stored in `dtype`
    where given (its `.data` then is that copy, so the fp32 one is freed), pinned for DMA."""
    if dtype is not None and p.dtype != dtype and p.device.type != "meta":
        p.data = p.data.to(dtype)
    if pin and not p.data.is_pinned():
        p.data = p.data.pin_memory()
    return p.detach()


def _layout(named: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    """A part's masters in param-group order (decayed, then not), the order of its optimizer's
    state buffers: each group is one stretch of both."""
    return [p for group in param_groups(named, weight_decay=0.0) for p in group["params"]]


def flat_masters(part: Part) -> list[torch.Tensor]:
    """What crosses between replicas for a part: its masters as one tensor (or nothing)."""
    return [] if part.buffer is None else [part.buffer]


def _wire(master: nn.Parameter, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    if dtype == master.dtype:
        return master.detach()  # travels straight from the master
    wire = master.detach().to(dtype)
    return wire.pin_memory() if pin else wire


@torch.no_grad()
def refresh_wires(part: Part) -> None:
    """After an update, the half copies that travel to the device follow the masters.

    Only the owner refreshes a tied weight's (shared) wire: the head's use of GPT-2's
    `wte` sees the embeddings' update through it.
    """
    owned = {id(p) for p in part.owned}
    stale = [(w, p) for w, p in zip(part.wires, part.masters, strict=True)
             if id(p) in owned and w.data_ptr() != p.data_ptr()]
    if stale:
        torch._foreach_copy_([w for w, _ in stale], [p for _, p in stale])


@torch.no_grad()
def accumulate(masters: list[nn.Parameter], grads: list[torch.Tensor | None], pool: KeptTensors) -> None:
    """Add gradients into the fp32 master `.grad`s (summing tied uses). An fp32 gradient becomes
    the `.grad` itself; a half one is converted into a tensor from `pool`."""
    for p, g in zip(masters, grads, strict=True):
        if g is None:
            continue
        if p.grad is not None:
            p.grad.add_(g)
        elif g.dtype == torch.float32:
            p.grad = g
        else:
            p.grad = pool.take(p).copy_(g)
