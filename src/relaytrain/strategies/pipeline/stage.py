"""Partitioning: which blocks each stage holds, and the stage module built from a layered model.

Stage 0 holds the embeddings, the last stage the head and the loss, and the blocks are
split as evenly as possible (`strategy.layout` overrides the split). A stage is the layered
model itself with the other stages' parts removed, so the family's own `context` and
`head_loss` run unchanged, and every parameter keeps its Hugging Face name
(`LayeredModel.hf_name`), which is what checkpoints and saved models use.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from relaytrain.models.layered import LayeredModel, MicroBatch


def partition(num_blocks: int, stages: int, layout: list[int] | None = None) -> list[range]:
    """Block ranges per stage. Leftover blocks go to the first stages: the last one also
    carries the head (for an LM the vocabulary matmul, often the costliest layer)."""
    counts = list(layout) if layout is not None else [
        num_blocks // stages + (1 if s < num_blocks % stages else 0) for s in range(stages)
    ]
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


class StageModule(nn.Module):
    """Blocks `blocks` of `model`, plus the embeddings on the first stage and the head on the last.

    `forward` maps the received hidden state (or the input ids on stage 0) to the hidden
    state to send on, or to the micro-batch's summed loss divided by the minibatch's item
    count on the last stage. `recompute`: `block` keeps each block's input and recomputes the
    block in backward; `stage` keeps only the stage's input (PipeDream-2BW's choice) and
    recomputes the whole stage.
    """

    def __init__(self, model: LayeredModel, blocks: range, first: bool, last: bool, recompute: str = "none"):
        super().__init__()
        self.block_offset = blocks.start
        self.first, self.last, self.recompute = first, last, str(recompute)
        model.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if not first:
            model.embed = None
        if not last:
            model.head = None
        # The full Hugging Face model would keep every other stage's weights alive.
        object.__setattr__(model, "hf_model", None)
        self.model = model
        self.tied_names = self._tied_names(model)

    def _tied_names(self, model: LayeredModel) -> list[str]:
        """Names of this stage's copies of weights another stage also holds (GPT-2's wte/lm_head)."""
        if self.first == self.last:  # a middle stage, or one stage holding both ends (one tensor)
            return []
        side = 0 if self.first else 1
        return [f"model.{pair[side]}" for pair in model.tied_parameters()]

    def forward(self, mb: MicroBatch, hidden: torch.Tensor | None, loss_items: int) -> torch.Tensor:
        if self.recompute == "stage" and torch.is_grad_enabled():
            return checkpoint(self._forward, mb, hidden, loss_items, use_reentrant=False)
        return self._forward(mb, hidden, loss_items)

    def _forward(self, mb: MicroBatch, hidden: torch.Tensor | None, loss_items: int) -> torch.Tensor:
        hidden = self.trunk(mb, hidden)
        return self.model.head_loss(hidden, mb.labels) / loss_items if self.last else hidden

    def trunk(self, mb: MicroBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """The stage's embeddings (first stage) and blocks: the hidden state it passes on."""
        m = self.model
        if self.first:
            hidden = m.embed(mb.input_ids)
        ctx = m.context(mb, hidden)
        for block in m.blocks:
            if self.recompute == "block" and torch.is_grad_enabled():
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False)
            else:
                hidden = block(hidden, ctx)
        return hidden
