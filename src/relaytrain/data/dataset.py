"""Token datasets held as tensors, and the loader that cuts them into minibatches of micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from relaytrain.models.layered import MicroBatch


@dataclass
class TokenDataset:
    """`input_ids` [N, S]; `labels` [N] (classification) or [N, S] (LM, -100 = ignored);
    `attention_mask` [N, S] or None when no sample is padded."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def take(self, index: torch.Tensor) -> MicroBatch:
        mask = None if self.attention_mask is None else self.attention_mask[index]
        return MicroBatch(self.input_ids[index], self.labels[index], mask)


class MicroBatchLoader:
    """Endless minibatches: each is `num_microbatches` micro-batches of `microbatch_size` samples.

    Epochs are reshuffled from (seed, epoch), so the same config always sees the same
    samples in the same order, whichever strategy runs it. `position` (minibatches served)
    is all a checkpoint needs to continue the stream exactly.
    """

    def __init__(self, dataset: TokenDataset, microbatch_size: int, num_microbatches: int, shuffle: bool, seed: int):
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.num_microbatches = num_microbatches
        self.shuffle = shuffle
        self.seed = seed
        self.position = 0
        minibatch = microbatch_size * num_microbatches
        if len(dataset) < minibatch:
            from relaytrain.errors import ConfigError

            raise ConfigError(
                f"the dataset has {len(dataset)} samples, fewer than one minibatch "
                f"(strategy.microbatch_size × strategy.num_microbatches = {minibatch}); use more data or a smaller batch"
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
        return [
            self.dataset.take(order[start + k * self.microbatch_size : start + (k + 1) * self.microbatch_size])
            for k in range(self.num_microbatches)
        ]

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        batch = self.minibatch(self.position)
        self.position += 1
        return batch
