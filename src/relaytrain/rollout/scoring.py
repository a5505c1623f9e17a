"""Scoring a rollout batch's rows: each labelled token's log-prob under the sampling policy
(`old_logps`, num_iterations > 1) or the reference (`ref_token_logps`, beta > 0), as TRL computes
them: a forward of the model over the rows, the logits at the sampling temperature.

A model on the device scores a micro-batch a forward. A relayed one (`on_device.RelayCopy`, a
host-held policy streamed through the device) would stream every block once for each such
forward, so its micro-batches go through together, each block visiting all of them while it is
on the device (`RelayCopy.each_logits`): one stream of the model a scoring pass. The reference
with adapters is the policy with them off (`ReferenceView`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from relaytrain.models.layered import MicroBatch, eval_mode
from relaytrain.rollout.on_device import relay_of
from relaytrain.rollout.sampling import quiet_router
from relaytrain.schema.row import IGNORE_INDEX


class ReferenceView(nn.Module):
    """The policy with its adapters off, as the reference (TRL's `disable_adapter()` for a peft
    model): peft's layers skip their adapters while this view computes."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: the view owns nothing

    def parameters(self, recurse: bool = True):
        return self.policy.parameters(recurse)

    def forward(self, **kwargs):
        with adapters_off(self.policy):
            return self.policy(**kwargs)


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """peft's adapter layers of `model` computing as their base layers alone, for the duration."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:  # the flag itself: peft's enable_adapters(False) would also freeze the adapters' weights
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before, strict=True):
            m._disable_adapters = flag


@torch.no_grad()
def token_logps(model: nn.Module, rows: list[MicroBatch], temperature: float, autocast=None) -> list[torch.Tensor]:
    """Each micro-batch's labelled tokens' log-probs under `model` (a Hugging Face causal LM, or a
    `ReferenceView` of one) at `temperature`, at each token's own position [rows, seq] (0
    elsewhere), as the loss aligns them; on the host. `autocast`: the run's, or None."""
    underlying = model.policy if isinstance(model, ReferenceView) else model
    relay = relay_of(underlying)
    device = next(underlying.parameters()).device
    batches = [MicroBatch(input_ids=mb.input_ids, labels=mb.labels, attention_mask=mb.attention_mask).to(device)
               for mb in rows]
    off = adapters_off(underlying) if underlying is not model else contextlib.nullcontext()
    with eval_mode(underlying), autocast or contextlib.nullcontext(), off:
        if relay is not None and relay.scores_together and len(batches) > 1:
            logits = relay.each_logits(batches)
        else:
            logits = (underlying(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                 **quiet_router(underlying)).logits for mb in batches)
        return [_at_labels(x, mb.labels, temperature) for x, mb in zip(logits, batches, strict=True)]


def _at_labels(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-softmax of `logits` / `temperature` at each next labelled token, on the host."""
    x = logits[:, :-1].float() / temperature
    y = labels[:, 1:]
    token = torch.gather(x.log_softmax(-1), -1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(labels.shape, dtype=torch.float32)
    out[:, 1:] = torch.where(y != IGNORE_INDEX, token, 0.0).cpu()
    return out
