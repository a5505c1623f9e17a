"""Partitioning: which blocks each stage holds, and the stage module built from a layered model.

Stage 0 holds the embeddings, the last stage the head and the loss, and the blocks are
split as evenly as possible (`strategy.layout` overrides the split). A stage is the layered
model itself with the other stages' parts removed, so the family's own `context` and
`head_loss` run unchanged and parameter names stay the layered model's.
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
    count on the last stage.
    """

    def __init__(self, model: LayeredModel, blocks: range, first: bool, last: bool, recompute: bool):
        super().__init__()
        self.block_offset = blocks.start
        self.first, self.last, self.recompute = first, last, recompute
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
        m = self.model
        if self.first:
            hidden = m.embed(mb.input_ids)
        ctx = m.context(mb, hidden)
        for block in m.blocks:
            if self.recompute:
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False)
            else:
                hidden = block(hidden, ctx)
        return m.head_loss(hidden, mb.labels) / loss_items if self.last else hidden

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under the whole layered model's names (blocks renumbered)."""
        return {
            _renumber(name, self.block_offset): tensor.detach().cpu().clone()
            for name, tensor in self.model.state_dict().items()
        }

    def load_global_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of `global_state_dict`: exactly this stage's tensors, or an error."""
        self.model.load_state_dict({_renumber(name, -self.block_offset): t for name, t in state.items()}, strict=True)


def _renumber(name: str, shift: int) -> str:
    if not name.startswith("blocks."):
        return name
    index, rest = name[len("blocks."):].split(".", 1)
    return f"blocks.{int(index) + shift}.{rest}"
