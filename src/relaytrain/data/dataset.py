"""Token datasets held as tensors, and the loader that cuts them into minibatches of micro-batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import field

import torch

from relaytrain.models.layered import Draw, MicroBatch
from relaytrain.schema.row import FIELDS, Field, row_values, with_row_fields
from relaytrain.utils.errors import ConfigError


@with_row_fields
class TokenDataset:
    """Every field of a row (`relaytrain.schema.row.FIELDS`) for all N rows: `input_ids` [N, S];
    `labels` [N] (classification) or [N, S] (LM, -100 = ignored); `attention_mask` [N, S] or None
    when no sample is padded; `position_ids` [N, S] when rows hold packed records (positions
    restart at 0 where each starts), else None.

    `facts`: what reading the source found that a run should report (records truncated or
    dropped); it goes to results.json's `data`.

    `rows_per_item`: how many consecutive rows make one item of the data, the unit that is
    shuffled, held out and counted by strategy.microbatch_size: 1, or 2 for a preference pair
    (its chosen row, then its rejected row), whose rows must travel in one micro-batch.

    `records`: the records as the source read them, where something after the tokenizer reads
    them (data=prompts: the prompt as written and the columns the rewards take), indexed by the
    rows' `record` field; None for other data."""

    facts: dict = field(default_factory=dict)
    rows_per_item: int = 1
    records: list | None = None

    def __post_init__(self) -> None:
        """A field filled in the wrong shape is said where it is made, not steps later in a loss."""
        rows, seq_len = self.input_ids.shape
        if rows % self.rows_per_item:
            raise ValueError(f"a set of items of {self.rows_per_item} rows has {rows} rows")
        for f in FIELDS:
            t = getattr(self, f.name)
            if (t is None and not f.optional) or (t is not None and not f.fits(t, rows, seq_len)):
                shape = "missing" if t is None else tuple(t.shape)
                raise ValueError(f"{f.name} is {shape} in a set of {rows} rows of {seq_len} tokens; a row's "
                                 f"{f.name} is {f.per.value}")

    def __len__(self) -> int:
        """Its items (rows where an item is one row)."""
        return self.input_ids.shape[0] // self.rows_per_item

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def _rows(self, items: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Every field's rows of these items, each item's rows together and in order."""
        step = self.rows_per_item
        index = items if step == 1 else (items.unsqueeze(1) * step + torch.arange(step)).flatten()
        return {name: None if t is None else t[index] for name, t in row_values(self).items()}

    def take(self, items: torch.Tensor, draw: Draw | None = None) -> MicroBatch:
        """These items' rows as a micro-batch, keyed by `draw` (a training micro-batch's)."""
        return MicroBatch(**self._rows(items), draw=draw)

    def subset(self, items: torch.Tensor) -> TokenDataset:
        """These items; `facts` stay with the whole (they describe reading the source), `records`
        go with every part (the rows' `record` numbers index the whole list)."""
        return TokenDataset(**self._rows(items), rows_per_item=self.rows_per_item, records=self.records)


def hold_out(dataset: TokenDataset, fraction: float, seed: int) -> tuple[TokenDataset, TokenDataset]:
    """`fraction` of the samples (at least one), drawn by `seed`, as a held-out set; the rest in order."""
    count = max(1, round(len(dataset) * fraction))
    if count >= len(dataset):
        raise ConfigError(f"data.eval_fraction={fraction} would hold out all {len(dataset)} samples; lower it")
    drawn = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + 7919))[:count]
    keep = torch.ones(len(dataset), dtype=torch.bool)
    keep[drawn] = False
    train = dataset.subset(keep.nonzero().squeeze(1))
    train.facts = dataset.facts
    return train, dataset.subset(drawn.sort().values)


def eval_batches(dataset: TokenDataset, microbatch_size: int, group: int, max_microbatches: int = 0) -> list[list[MicroBatch]]:
    """The held-out set in order, as micro-batches of `microbatch_size` items grouped `group` at a
    time (what a strategy runs per relay or pipeline pass). The last micro-batch is filled up to
    full size with copies of its first row labelled -100 (no item: they count nowhere), so every
    micro-batch has the shape the strategies' buffers expect. (Every target field, not only the
    labels, takes its pad value there; see `relaytrain.schema.row.Field`.)"""
    count = math.ceil(len(dataset) / microbatch_size)
    if max_microbatches:
        count = min(count, max_microbatches)
    micro = []
    for k in range(count):
        index = torch.arange(k * microbatch_size, min((k + 1) * microbatch_size, len(dataset)))
        mb = dataset.take(index)
        if len(index) < microbatch_size:
            mb = _padded(mb, microbatch_size * dataset.rows_per_item)
        micro.append(mb)
    return [micro[i : i + group] for i in range(0, len(micro), group)]


def _padded(mb: MicroBatch, rows: int) -> MicroBatch:
    missing = rows - mb.num_samples

    def filled(f: Field) -> torch.Tensor | None:
        t = getattr(mb, f.name)
        if t is None:
            return None
        shape = (missing, *t.shape[1:])
        return torch.cat([t, torch.full(shape, f.pad, dtype=t.dtype) if f.target else t[:1].expand(shape)])

    return dataclasses.replace(mb, **{f.name: filled(f) for f in FIELDS})


def minibatch_keys(replicas: int) -> str:
    """The keys whose product is a minibatch's rows (`microbatch_size` given to a loader holds
    every replica's share of a micro-batch)."""
    keys = "strategy.microbatch_size × strategy.num_microbatches"
    return f"{keys} × strategy.replicas" if replicas > 1 else keys


class MicroBatchLoader:
    """Endless minibatches: each is `num_microbatches` micro-batches of `microbatch_size` samples.

    Epochs are reshuffled from (seed, epoch), so the same config always sees the same
    samples in the same order, whichever strategy runs it. `position` (minibatches served)
    is all a checkpoint needs to continue the stream exactly.

    Each micro-batch carries its draw key (`MicroBatch.draw`): `dropout_seed` (train.seed), the
    minibatch's position and the micro-batch's index in it; the parts seed their dropout by it,
    so its masks do not depend on the order in which a strategy runs the micro-batches.
    """

    def __init__(self, dataset: TokenDataset, microbatch_size: int, num_microbatches: int, shuffle: bool, seed: int,
                 dropout_seed: int = 0, replicas: int = 1):
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.num_microbatches = num_microbatches
        self.shuffle = shuffle
        self.seed = seed
        self.dropout_seed = dropout_seed
        self.position = 0
        minibatch = microbatch_size * num_microbatches
        if len(dataset) < minibatch:
            raise ConfigError(
                f"the dataset has {len(dataset)} samples, fewer than one minibatch "
                f"({minibatch_keys(replicas)} = {minibatch}); use more data or a smaller batch"
            )
        self.minibatches_per_epoch = len(dataset) // minibatch

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def minibatch(self, position: int) -> list[MicroBatch]:
        epoch, slot = divmod(position, self.minibatches_per_epoch)
        order = self._order(epoch)
        start = slot * self.microbatch_size * self.num_microbatches
        return [self.dataset.take(order[start + k * self.microbatch_size : start + (k + 1) * self.microbatch_size],
                                  draw=Draw(self.dropout_seed, position, k))
                for k in range(self.num_microbatches)]

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        batch = self.minibatch(self.position)
        self.position += 1
        return batch
