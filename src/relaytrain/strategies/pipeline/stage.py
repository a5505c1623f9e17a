"""Partitioning: which blocks each stage holds, and the stage module built from a layered model.

Stage 0 holds the embeddings, the last stage the head and the loss. The blocks are split by
cost (`balanced_layout`: the slowest stage as fast as it can be, the ends counted) unless
`strategy.layout` says `even` (as evenly as possible, `partition`) or lists the blocks. A stage is the layered
model itself with the other stages' parts removed, so the family's own `context` and
`head_loss` run unchanged, and every parameter keeps its Hugging Face name
(`LayeredModel.hf_name`), which is what checkpoints and saved models use. Its blocks keep their
index in the model, so each draws its dropout under its own key (`Block.forward`), as it does
in every other strategy.

Under an interleaved schedule a stage holds several *chunks* of consecutive blocks (stage s of
d: the model's chunks s, s + d, ...); the module keeps them all and runs one chunk per call:
the embeddings before the model's first chunk, the head after its last.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from relaytrain.dryrun import meta_autocast
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.models.moe import ROUTER
from relaytrain.objectives.base import Divisor


def partition(num_blocks: int, stages: int, layout: list[int] | None = None) -> list[range]:
    """Block ranges per stage. Leftover blocks go to the first stages: the last one also
    carries the head (for an LM the vocabulary matmul, often the costliest layer)."""
    counts = list(layout) if layout is not None else [
        num_blocks // stages + (1 if s < num_blocks % stages else 0) for s in range(stages)
    ]
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def balanced_layout(blocks: Sequence[float], parts: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Blocks per part for the blocks' costs `blocks` cut into `parts` contiguous parts, the
    first also paying `first` (the embeddings) and the last `last` (the head), each part at
    least one block: the cut that makes the costliest part cheapest (PipeDream's partitioner
    over a chain). Among such cuts, the one with the smallest sum of squared part costs (the
    most even), then the one whose earlier parts hold more blocks: with equal blocks and free
    ends this is the even split. Exact (dynamic programming over cut points), deterministic."""
    n = len(blocks)
    if not 1 <= parts <= n:
        raise ValueError(f"{n} blocks cannot make {parts} parts of at least one block")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + float(c))

    def cost(i: int, j: int, part: int) -> float:  # blocks i..j-1 as part `part`
        return prefix[j] - prefix[i] + (first if part == 0 else 0.0) + (last if part == parts - 1 else 0.0)

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300)

    # worst[p][i]: the smallest possible costliest part when blocks i.. make parts p..parts-1
    inf = float("inf")
    worst = [[inf] * (n + 1) for _ in range(parts + 1)]
    worst[parts][n] = 0.0
    for p in range(parts - 1, -1, -1):
        for i in range(p, n - (parts - p) + 1):
            worst[p][i] = min(max(cost(i, j, p), worst[p + 1][j]) for j in range(i + 1, n - (parts - p - 1) + 1))
    bound = worst[0][0] * (1 + 1e-9)
    # squares[p][i]: the smallest sum of squared costs of parts p.. over blocks i.., each part within bound
    squares = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    squares[parts][n] = 0.0
    for p in range(parts - 1, -1, -1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(n - (parts - p - 1), i, -1):  # more blocks first: ties go to the earlier parts
                c = cost(i, j, p)
                if c > bound or squares[p + 1][j] == inf:
                    continue
                total = c * c + squares[p + 1][j]
                if squares[p][i] == inf or (total < squares[p][i] and not close(total, squares[p][i])):
                    squares[p][i], cut[p][i] = total, j
    counts, i = [], 0
    for p in range(parts):
        counts.append(cut[p][i] - i)
        i = cut[p][i]
    return counts


class StageModule(nn.Module):
    """Blocks `blocks` of `model` (a range, or one range per chunk), plus the embeddings on the
    first stage and the head on the last.

    `forward` maps the received hidden state (or the input ids on stage 0) to the hidden
    state to send on, or to the micro-batch's summed loss divided by the minibatch's item
    count on the last stage. `recompute`: `block` keeps each block's input and recomputes the
    block in backward; `stage` keeps only the stage's input (PipeDream-2BW's choice) and
    recomputes the whole stage (the chunk). `routing` (a mixture's balancing loss): the unit's
    `routing.UnitRouting`, handed the tally the chunk's shared context makes (on a recompute too).
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
        trains = {name for name, p in model.named_parameters() if p.requires_grad}
        return [f"model.{pair[side]}" for pair in model.tied_parameters() if pair[side] in trains]

    def embeds(self, chunk: int) -> bool:
        """Whether this chunk starts the model: it reads the input ids."""
        return self.first and chunk == 0

    def computes_loss(self, chunk: int) -> bool:
        """Whether this chunk ends the model: its output is the loss."""
        return self.last and chunk == len(self.chunks) - 1

    def forward(self, mb: MicroBatch, hidden: torch.Tensor | None, divisor: Divisor, chunk: int = 0,
                routing=None) -> torch.Tensor:
        if self.recompute == "stage" and torch.is_grad_enabled():
            return checkpoint(self._forward, mb, hidden, divisor, chunk, routing, use_reentrant=False,
                              context_fn=meta_autocast.recompute_contexts)
        return self._forward(mb, hidden, divisor, chunk, routing)

    def _forward(self, mb: MicroBatch, hidden: torch.Tensor | None, divisor: Divisor, chunk: int,
                 routing=None) -> torch.Tensor:
        hidden = self.trunk(mb, hidden, chunk, routing)
        return self.model.head_loss(hidden, mb).over(divisor) if self.computes_loss(chunk) else hidden

    def trunk(self, mb: MicroBatch, hidden: torch.Tensor | None, chunk: int = 0, routing=None) -> torch.Tensor:
        """The chunk's embeddings (the model's first chunk) and blocks: the hidden state it passes on."""
        m = self.model
        if self.embeds(chunk):
            hidden = m.embed_input(mb.input_ids, mb.draw)
        ctx = m.context(mb, hidden)
        if routing is not None and ROUTER in ctx:
            routing.adopt(ctx[ROUTER])
        for block in (m.blocks[i] for i in self.chunks[chunk]):
            if self.recompute == "block" and torch.is_grad_enabled():
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False, context_fn=meta_autocast.recompute_contexts)
            else:
                hidden = block(hidden, ctx)
        return hidden
