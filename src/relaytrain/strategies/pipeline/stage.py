"""Partitioning: which blocks each stage holds, and the stage module built from a layered model.

Stage 0 holds the embeddings, the last stage the head and the loss, and the blocks are
split as evenly as possible (`strategy.layout` overrides the split). A stage is the layered
model itself with the other stages' parts removed, so the family's own `context` and
`head_loss` run unchanged, and every parameter keeps its Hugging Face name
(`LayeredModel.hf_name`), which is what checkpoints and saved models use.

Under an interleaved schedule a stage holds several *chunks* of consecutive blocks (stage s of
d: the model's chunks s, s + d, ...); the module keeps them all and runs one chunk per call:
the embeddings before the model's first chunk, the head after its last.
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
    """Blocks `blocks` of `model` (a range, or one range per chunk), plus the embeddings on the
    first stage and the head on the last.

    `forward` maps the received hidden state (or the input ids on stage 0) to the hidden
    state to send on, or to the micro-batch's summed loss divided by the minibatch's item
    count on the last stage. `recompute`: `block` keeps each block's input and recomputes the
    block in backward; `stage` keeps only the stage's input (PipeDream-2BW's choice) and
    recomputes the whole stage (the chunk).
    """

    def __init__(self, model: LayeredModel, blocks: range | list[range], first: bool, last: bool,
                 recompute: str = "none"):
        super().__init__()
        chunks = [blocks] if isinstance(blocks, range) else list(blocks)
        self.block_indices = [i for chunk in chunks for i in chunk]  # each held block's index in the model
        starts = [sum(len(c) for c in chunks[:j]) for j in range(len(chunks))]
        self.chunks = [range(start, start + len(c)) for start, c in zip(starts, chunks, strict=True)]  # into model.blocks
        self.first, self.last, self.recompute = first, last, str(recompute)
        model.blocks = nn.ModuleList(model.blocks[i] for i in self.block_indices)
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

    def embeds(self, chunk: int) -> bool:
        """Whether this chunk starts the model: it reads the input ids."""
        return self.first and chunk == 0

    def computes_loss(self, chunk: int) -> bool:
        """Whether this chunk ends the model: its output is the loss."""
        return self.last and chunk == len(self.chunks) - 1

    def forward(self, mb: MicroBatch, hidden: torch.Tensor | None, loss_items: int, chunk: int = 0) -> torch.Tensor:
        if self.recompute == "stage" and torch.is_grad_enabled():
            return checkpoint(self._forward, mb, hidden, loss_items, chunk, use_reentrant=False)
        return self._forward(mb, hidden, loss_items, chunk)

    def _forward(self, mb: MicroBatch, hidden: torch.Tensor | None, loss_items: int, chunk: int) -> torch.Tensor:
        hidden = self.trunk(mb, hidden, chunk)
        return self.model.head_loss(hidden, mb.labels) / loss_items if self.computes_loss(chunk) else hidden

    def trunk(self, mb: MicroBatch, hidden: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        """The chunk's embeddings (the model's first chunk) and blocks: the hidden state it passes on."""
        m = self.model
        if self.embeds(chunk):
            hidden = m.embed(mb.input_ids)
        ctx = m.context(mb, hidden)
        for block in (m.blocks[i] for i in self.chunks[chunk]):
            if self.recompute == "block" and torch.is_grad_enabled():
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False)
            else:
                hidden = block(hidden, ctx)
        return hidden
