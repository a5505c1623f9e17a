"""The conformance matrix: every cell (strategy x family x feature x adapter) a strategy must
train exactly, its config, and the pairwise cover of it that the default suite runs.

Axes:
- strategy: every `strategy=` option, from the registry (a new strategy joins the moment it is registered);
- family: `bert` (an encoder built by relaytrain), `llama` (a Llama-layout checkpoint: grouped-query
  attention, rotary positions, untied head) and `gpt2` (a GPT-2 checkpoint: Conv1D layers, tied
  embeddings), both decoders written by Hugging Face's `save_pretrained`;
- feature: `plain` (the strategy's defaults), `dropout` (dropout 0.1 on a decoder; BERT's cells draw
  dropout in every feature), `replicas` (two data-parallel replicas), `offload` (a pipeline's fp32
  masters and optimizer in host memory);
- adapter: `none`, or `lora` (a peft LoRA adapter continued, the base frozen).

l2l_stash_cpu is L2L with its stash on the host: the stash's own cells are that strategy's.

Dropout is on where the reference is relaytrain's plain loop alone (BERT, the `dropout` feature),
and off where an independent loop (Hugging Face's or peft's, which draw their own masks) is the
reference: every other decoder cell.

The default suite runs `pairwise_cover()`: every pair of values of any two axes that some valid
cell has appears in a default cell. The rest of the product is `slow` (CI's slow step).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path

import pytest

from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.strategies import choices
from tests.conftest import TINY_BERT

STEPS = 2  # enough for 2BW's delayed rule to differ from the plain loop's
LAYERS = 4  # two pipeline stages of two chunks each (pipe_interleaved) need four blocks
STRATEGIES = tuple(choices())
FAMILIES = ("bert", "llama", "gpt2")
DECODERS = ("llama", "gpt2")
FEATURES = {  # feature -> (the strategies it applies to, its overrides); None: every strategy
    "plain": (None, []),
    "dropout": (None, ["model.dropout=0.1"]),
    "replicas": ({"baseline", "l2l", "l2l_stash_cpu", "pipe_flush"}, ["strategy.replicas=2"]),
    "offload": ({"pipe_flush", "pipe_2bw"}, ["strategy.offload=host"]),
}
ADAPTERS = ("none", "lora")
AXES = ("strategy", "family", "feature", "adapter")
# What every cell's run adds to its model: four micro-batches of two, AdamW with weight decay and a
# warm-up step, the first step untimed (the phase times cover the timed one), a checkpoint every
# step, held-out data, the model saved. The rate moves every weight ~1e-2, a thousand times the
# tolerance, so a wrongly decayed norm or a wrong gradient shows. Adam's eps is 1e-4, not 1e-6:
# with 1e-6, a gradient that is nearly zero (a token seen once) is divided by its own size, and
# summing it in another order (two replicas) flips its sign: float noise turned into a full step.
RUN_KEYS = [
    "data.seq_len=16", "data.num_samples=128", "data.eval_fraction=0.25", "optim=adamw", "optim.lr=0.02",
    "optim.eps=1e-4", "optim.weight_decay=0.1", "optim.warmup_steps=1", "optim.schedule=linear",
    f"train.steps={STEPS}", "train.untimed_steps=1", "train.checkpoint_every=1", "train.keep_checkpoints=0",
    "train.save_model=true", "strategy.num_microbatches=4", "strategy.microbatch_size=2", "strategy.timeout_s=60",
]


@dataclass(frozen=True)
class Cell:
    strategy: str
    family: str
    feature: str
    adapter: str = "none"

    @property
    def id(self) -> str:
        return "-".join(getattr(self, axis) for axis in AXES)

    @property
    def lora(self) -> bool:
        return self.adapter == "lora"

    @property
    def dropout(self) -> bool:
        """Dropout on: BERT's cells and the `dropout` feature (their reference draws the same masks)."""
        return self.family == "bert" or self.feature == "dropout"

    @property
    def independent(self) -> bool:
        """Held to a loop with nothing of relaytrain on its path (Hugging Face's, or peft's)."""
        return self.family in DECODERS and not self.dropout

    def valid(self) -> bool:
        strategies, _ = FEATURES[self.feature]
        if strategies is not None and self.strategy not in strategies:
            return False
        if self.family == "bert":  # an encoder of relaytrain's: no adapter made by peft, no decoder-only feature
            return not self.lora and self.feature != "dropout"
        return not (self.lora and self.dropout)  # peft's loop draws its own masks


def every_cell() -> list[Cell]:
    """The whole product's valid cells, in a fixed order."""
    cells = (Cell(*values) for values in product(STRATEGIES, FAMILIES, FEATURES, ADAPTERS))
    return [cell for cell in cells if cell.valid()]


def pairs_of(cell: Cell) -> set[tuple]:
    """The pairs of axis values the cell exercises, e.g. (("strategy", "l2l"), ("family", "gpt2"))."""
    return {((a, getattr(cell, a)), (b, getattr(cell, b))) for a, b in combinations(AXES, 2)}


def pairwise_cover(cells: list[Cell] | None = None) -> list[Cell]:
    """A deterministic all-pairs cover, greedily: take the cell that exercises the most pairs no
    chosen cell does yet (the first such, in `every_cell()`'s order), until none is left."""
    cells = every_cell() if cells is None else cells
    uncovered = set().union(*map(pairs_of, cells))
    chosen = []
    while uncovered:
        best = max(cells, key=lambda cell: len(pairs_of(cell) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def cell_params(where=lambda cell: True) -> list:
    """Every valid cell `where` holds, as pytest params: the cover's in the default suite, the rest `slow`."""
    default = set(pairwise_cover())
    return [pytest.param(cell, id=cell.id, marks=() if cell in default else pytest.mark.slow)
            for cell in every_cell() if where(cell)]


@dataclass(frozen=True)
class Bases:
    """What the decoder cells start from: a checkpoint per family, and a peft adapter made for it."""

    checkpoints: dict[str, Path]
    adapters: dict[str, Path]


def cell_cfg(cell: Cell, bases: Bases, *overrides: str):
    """The config the cell trains: its model, its feature's and adapter's keys, RUN_KEYS; a
    checkpoint's model keys taken from it, but for the ones given here (dropout), as the CLI does."""
    _, feature_keys = FEATURES[cell.feature]
    if cell.family == "bert":
        model = [*TINY_BERT, f"model.num_layers={LAYERS}", "model.dropout=0.1"]
    else:
        model = [f"model.pretrained={bases.checkpoints[cell.family]}", "model.dropout=0.0"]
    adapter = ["adapter=lora", f"adapter.pretrained={bases.adapters[cell.family]}"] if cell.lora else []
    keys = [*model, f"strategy={cell.strategy}", *RUN_KEYS, *feature_keys, *adapter, *overrides]
    return resolve(compose_config(keys), keys)
