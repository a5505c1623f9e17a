"""Streamed training data (`data.streaming=true`): records read and tokenized as they are trained
on, never all in memory, for corpora larger than it.

A streamed set (`StreamedSet`) is no rows but how to read them: every process opens the records
itself (`datasets` in streaming mode: JSON lines, parquet, csv, text files, a glob, a hub id)
and `StreamLoader` serves the minibatches the in-memory loader would: minibatch p is rows
[p R, (p + 1) R) of the epoch (R = micro-batch rows x micro-batches); an epoch ends where fewer
than R rows are left (they are dropped, as the in-memory loader drops the rows past its last
whole minibatch), and the next starts again from the first record. The source says how records
become rows (`StreamRows`): for jsonl a record is a row; for chat (`ChatRows`) a record is
rendered, cut or dropped past data.seq_len, and one a row or packed, one at a time as the
in-memory source does it for the whole set. In order (data.shuffle=false) a streamed run
therefore trains on exactly the in-memory run's rows; with data.shuffle=true the records of each
epoch pass through a shuffle buffer (data.shuffle_buffer records) drawn from (data.seed, epoch),
so the order is random beyond the buffer's reach only.
Each replica takes its share of every micro-batch's rows, as from the in-memory loader.

Where to continue is the step, which the checkpoint holds already: a resumed run at step p skips
the first p whole minibatches of rows (over as many passes as they span; the buffer's draws
are replayed) and continues with the record after the last one trained, so a run stopped and
resumed equals the uninterrupted one. Skipping reads the records before it again: a resume late
in a long stream takes the time of reading that far (jsonl tokenizes nothing it skips; chat
renders what it skips, since whether a record is dropped, and where a packed row ends, is known
only rendered).

Every row is tokenized by the configured tokenizer (model.pretrained's or data.tokenizer): one
trained here would need the whole corpus first. A bad record is one line naming its file and row
when the stream reaches it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

import torch

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset, minibatch_keys
from relaytrain.data.encode import encode_rows
from relaytrain.data.reading import Where, stream_rows
from relaytrain.data.samples import parse_sample
from relaytrain.data.tokenizer import find_tokenizer
from relaytrain.models.layered import Draw, MicroBatch
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective


class StreamRows:
    """How a streamed source's records become rows, and a minibatch of rows tensors. This one,
    data=jsonl's: a row is a record, tokenized only when its minibatch is encoded, so the
    minibatches a resume skips are read, not tokenized. A source whose rows are made otherwise
    (chat: rendered, cut or dropped, packed) gives its own."""

    unit = "records"  # what a row is, for the line refusing a stream shorter than a minibatch

    def __init__(self, objective: Objective | None = None):
        self.objective = objective  # the run's: what a record's labels are (data=jsonl's rows need it)

    def tokenizer(self, cfg):
        return find_tokenizer(cfg)

    def rows(self, cfg, records: Iterator[tuple[Where, dict]], tokenizer) -> Iterator:
        return records

    def encode(self, cfg, rows: list, tokenizer) -> TokenDataset:
        samples = [parse_sample(cfg, record, where, self.objective) for where, record in rows]
        return encode_rows(cfg, samples, tokenizer, self.objective, always_mask=True)


@dataclass
class StreamedSet:
    """A training set read as it is trained on: the config says where and how, `rows` how its
    records become rows (picklable: every process of a run opens the stream itself). `facts` as
    a TokenDataset's."""

    cfg: object
    facts: dict = field(default_factory=dict)
    rows: StreamRows = field(default_factory=StreamRows)


def check_streaming(*, mixes: bool, eval_fraction: float, shuffle_buffer: int, objective: Objective,
                    tokenizer: tuple[str, str] | None) -> None:
    """What a stream cannot do, refused before any work (one line each), from the data keys'
    values (`mixes`: data.mix is set), the run's `objective` and the configured `tokenizer` it
    tokenizes with (`tokenizer.tokenizer_location`: None when one would be trained here)."""
    refused = [(mixes, "data.mix (a mixture draws from every part's whole set)"),
               (eval_fraction > 0, "data.eval_fraction (it holds out a share of the whole set; give data.eval_path)"),
               (labels.masked_token_labels(objective), f"model.task={objective.name} (its masks are drawn over the "
                                                       f"whole set; stream causal_lm or classification)")]
    for on, what in refused:
        if on:
            raise ConfigError(f"data.streaming=true cannot take {what}; drop data.streaming or it")
    if tokenizer is None:
        raise ConfigError("data.streaming=true tokenizes as it reads, so it needs a tokenizer made beforehand: set "
                          "model.pretrained or data.tokenizer=DIR")
    if shuffle_buffer < 1:
        raise ConfigError(f"data.shuffle_buffer={shuffle_buffer} must be positive (records held to shuffle a stream)")


class StreamLoader:
    """The streamed twin of `MicroBatchLoader`: `minibatch(position)` for positions in order (a
    jump, as at a resume, reopens the stream there)."""

    def __init__(self, streamed: StreamedSet, microbatch_size: int, num_microbatches: int, shuffle: bool, seed: int,
                 dropout_seed: int = 0, replicas: int = 1):
        self.cfg, self.row_maker = streamed.cfg, streamed.rows
        self.microbatch_size, self.num_microbatches = microbatch_size, num_microbatches
        self.shuffle, self.seed, self.dropout_seed = shuffle, seed, dropout_seed
        self.rows = microbatch_size * num_microbatches
        self._groups: Iterator[list] | None = None
        self._next = 0  # the position the open stream serves next
        self._tokenizer = self.row_maker.tokenizer(self.cfg)
        self._check_one_minibatch(replicas)

    def _check_one_minibatch(self, replicas: int) -> None:
        """A stream too short for one minibatch, found by reading that many rows (no more)
        before any step, as the in-memory loader finds it by counting."""
        d = self.cfg.data
        rows = self.row_maker.rows(self.cfg, stream_rows(d.path, "data.path", d.split, d.name), self._tokenizer)
        held = sum(1 for _ in islice(rows, self.rows))
        if held < self.rows:
            raise ConfigError(f"the streamed data.path={d.path} holds {held} {self.row_maker.unit}, fewer than one "
                              f"minibatch ({minibatch_keys(replicas)} = {self.rows}); use more data or a smaller "
                              f"batch")

    def minibatch(self, position: int) -> list[MicroBatch]:
        if self._groups is None or position != self._next:
            self._groups = islice(self._all_groups(), position, None)  # skipped groups are read, not tokenized
        group = next(self._groups)
        self._next = position + 1
        batch = self.row_maker.encode(self.cfg, group, self._tokenizer)
        return [batch.take(torch.arange(k * self.microbatch_size, (k + 1) * self.microbatch_size),
                           draw=Draw(self.dropout_seed, position, k))
                for k in range(self.num_microbatches)]

    def _all_groups(self) -> Iterator[list]:
        """Every epoch's whole minibatches of raw records, epoch after epoch."""
        epoch = 0
        while True:
            served = 0
            rows = self.row_maker.rows(self.cfg, self._records(epoch), self._tokenizer)
            while len(group := list(islice(rows, self.rows))) == self.rows:
                served += 1
                yield group
            if not served:  # checked at the start: only a file shortened while training gets here
                raise ConfigError(f"the streamed data.path={self.cfg.data.path} ended before one minibatch")
            epoch += 1

    def _records(self, epoch: int) -> Iterator[tuple[Where, dict]]:
        d = self.cfg.data
        records = stream_rows(d.path, "data.path", d.split, d.name)
        if not self.shuffle:
            return records
        return _buffer_shuffled(records, d.shuffle_buffer, random.Random(self.seed * 1_000_003 + epoch))



def _buffer_shuffled(records: Iterator, size: int, rng: random.Random) -> Iterator:
    """`records` through a buffer of `size`: each record out is drawn from the buffer and
    replaced by the next one in; the rest, shuffled, at the end."""
    buffer = list(islice(records, size))
    for record in records:
        slot = rng.randrange(len(buffer))
        yield buffer[slot]
        buffer[slot] = record
    rng.shuffle(buffer)
    yield from buffer


def streamed_facts(source_name: str) -> dict:
    """What is known before reading: the source, and that it streams (nothing is counted ahead)."""
    return {"source": source_name, "streaming": True}
