"""The relay of L2L (Algorithm 2 of the L2L paper): parts of the model travel to the device
one visit at a time, and block inputs wait for the backward in a stash. (A recomputed block
draws its forward's dropout masks again by itself: the draws are keyed by micro-batch and
block, `models.layered.keyed_draws`.)

- `WeightRelay` brings the parts to the device in relay order (embed, blocks, head, blocks in
  reverse, embed), never more than a fixed number at once, prefetching the next visit.
- `ActivationStash` keeps each block's input per micro-batch on the device, or on the host.

The strategy that walks the relay and feeds the eager param server is `l2l.py`.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from relaytrain.strategies.eps import Part
from relaytrain.strategies.experts_by_need import ExpertsByNeed, ExpertVisit
from relaytrain.strategies.transfers import Transfer, Transfers, UploadCounts
from relaytrain.utils.units import gib

# --------------------------------------------------------------------------- weight relay


class PendingUpdates(Protocol):
    """Host updates a step may still be landing when the next one reads the parts (the EPS)."""

    def landed(self, index: int) -> bool:
        """Whether part `index`'s host copy has all its updates."""

    def await_part(self, index: int) -> None:
        """Return once it has."""


@dataclass
class Resident:
    """A part's weights on the device: the autograd leaves its gradients land on."""

    transfer: Transfer
    leaves: list[torch.Tensor]
    frozen: list[torch.Tensor]  # an adapter's base: computed with, never differentiated
    experts: ExpertVisit | None = None  # its frozen experts where they travel by need


class WeightRelay:
    """Brings parts to the device in relay order, never more than `capacity` at once.

    While part k computes, the part of the next visit is uploaded (prefetch). When room is
    needed, the resident part whose next visit is farthest away leaves; so at the turn-around
    the last block, needed again right after the head, stays and does not cross twice.
    """

    def __init__(self, parts: list[Part], transfers: Transfers, device: torch.device, capacity: int, prefetch: bool,
                 dtype: torch.dtype = torch.float32, updates: PendingUpdates | None = None,
                 experts_by_need: bool = False):
        self.parts = parts
        self.updates = updates  # the host's updates still landing (the EPS carrying them into this step)
        self.transfers = transfers
        self.capacity = capacity
        self.prefetch = prefetch and capacity >= 2
        self.dtype = dtype  # what the parts compute with: a frozen base stored in another dtype is cast to it
        head = len(parts) - 1
        # The backward stops at the lowest part that trains: below it no gradient is wanted (a
        # frozen embedding table under adapters).
        self.lowest_trained = next((i for i, part in enumerate(parts) if part.masters), 0)
        self.order = list(range(head + 1)) + list(range(head - 1, self.lowest_trained - 1, -1))
        # Buffers (position ids) are constant: on the device once, outside the relay.
        self.buffers = [{n: b.to(device) for n, b in p.module.named_buffers()} for p in parts]
        self.resident: dict[int, Resident] = {}
        self.cursor = 0
        self.peak_resident = 0
        self.counts = UploadCounts()
        # A dry run (the meta device) uploads every expert: it has no picks to read, and a streamed
        # tensor is whole on the device anyway.
        by_need = experts_by_need and device.type != "meta"
        self.by_need = ExpertsByNeed(parts, transfers, dtype, self._experts_visit, self.counts) if by_need else None

    def start_step(self) -> None:
        """Forget last step's device copies: the EPS has updated every part since."""
        self.resident.clear()
        self.cursor = 0
        if self.by_need is not None:
            self.by_need.start_step()

    def next_visit(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """The weights of the next part in relay order (for a functional call) and its leaves."""
        index = self.order[self.cursor]
        self._make_resident(index)
        ahead = self.order[self.cursor + 1] if self.cursor + 1 < len(self.order) else None
        # A part whose update is still landing is not prefetched: waiting for it here would hold
        # back the launch of this part's compute. Its own visit uploads it, once this part's
        # compute is queued on the device, so the wait and the copy overlap that compute.
        if self.prefetch and ahead is not None and (self.updates is None or self.updates.landed(ahead)):
            self._make_resident(ahead)
        self.cursor += 1
        resident, part = self.resident[index], self.parts[index]
        self.transfers.acquire(resident.transfer)
        if resident.experts is not None:
            self.transfers.acquire(resident.experts.transfer)
        # A bf16-stored base computes in the relay's dtype; an NF4 weight's uint8 storage travels
        # and stays as it is (its layer dequantizes it in the input's dtype).
        frozen = [t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t for t in resident.frozen]
        weights = (dict(zip(part.names, resident.leaves, strict=True)) | dict(zip(part.frozen_names, frozen, strict=True))
                   | self.buffers[index])
        return weights, resident.leaves

    def _make_resident(self, index: int) -> None:
        if index in self.resident:
            return
        while len(self.resident) >= self.capacity:
            del self.resident[self._farthest_needed()]
        part = self.parts[index]
        if self.updates is not None:
            self.updates.await_part(index)
        by_need = self.by_need.positions.get(index, ()) if self.by_need is not None else ()
        travelling = [t for position, t in enumerate(part.frozen) if position not in by_need]
        transfer = self.transfers.upload(part.wires + travelling)
        self.counts.parts += sum(t.numel() * t.element_size() for t in part.wires + travelling)
        leaves = [t.requires_grad_(True) for t in transfer.tensors[:len(part.wires)]]
        frozen, experts = transfer.tensors[len(part.wires):], None
        if by_need:  # the streamed tensors take their places among the frozen ones
            experts = self.by_need.arrive(index)
            uploaded = iter(frozen)
            frozen = [experts.tensors[p] if p in by_need else next(uploaded) for p in range(len(part.frozen))]
        self.resident[index] = Resident(transfer, leaves, frozen, experts)
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def _experts_visit(self, index: int) -> ExpertVisit | None:
        resident = self.resident.get(index)
        return None if resident is None else resident.experts

    def report(self) -> dict:
        """The strategy report's figures: the weights uploaded and, by need, the experts'."""
        figures = {"uploaded_bytes": self.counts.total}
        if self.by_need is not None:
            figures["experts_by_need"] = {"uploaded_bytes": self.counts.experts, "whole_bytes": self.counts.experts_whole,
                                          "recompute_misses": self.by_need.recompute_misses}
        return figures

    def by_need_summary(self) -> dict[str, str]:
        """The summary's line with experts streamed by need: the share of their bytes that crossed."""
        c = self.counts
        if not c.experts_whole:
            return {}
        return {"experts uploaded by need": f"{c.experts / c.experts_whole:.1%} of the whole experts' bytes "
                                            f"({gib(c.experts_whole - c.experts)} saved over the measured steps)"}

    @contextmanager
    def uncounted(self):
        """Uploads left out of the counts (an evaluation's: the counts are the training steps')."""
        saved = dataclasses.replace(self.counts)
        try:
            yield
        finally:
            self.counts.__dict__.update(vars(saved))  # in place: the experts by need add to these same counts

    def close(self) -> None:
        if self.by_need is not None:
            self.by_need.close()

    def _farthest_needed(self) -> int:
        current = self.order[self.cursor]

        def next_use(index: int) -> float:
            ahead = self.order[self.cursor + 1:]
            return ahead.index(index) if index in ahead else math.inf

        return max((i for i in self.resident if i != current), key=next_use)


# --------------------------------------------------------------------------- activation stash


class ActivationStash:
    """Each block's input per micro-batch, kept on the device or offloaded to the host.

    With `on_host`, `put` starts an asynchronous download and `take` brings the entry back,
    starting the upload of the entry the backward needs next so it overlaps the recompute.
    """

    def __init__(self, transfers: Transfers, on_host: bool):
        self.transfers = transfers
        self.on_host = on_host
        self.entries: dict[tuple[int, int], Transfer | torch.Tensor] = {}
        self.uploads: dict[tuple[int, int], Transfer] = {}

    def put(self, key: tuple[int, int], hidden: torch.Tensor) -> None:
        self.entries[key] = self.transfers.offload([hidden]) if self.on_host else hidden

    def take(self, key: tuple[int, int], next_key: tuple[int, int] | None) -> torch.Tensor:
        if not self.on_host:
            return self.entries.pop(key)
        transfer = self.uploads.pop(key, None) or self._upload(key)
        if next_key is not None:
            self.uploads[next_key] = self._upload(next_key)
        return self.transfers.acquire(transfer)[0]

    def _upload(self, key: tuple[int, int]) -> Transfer:
        offloaded = self.entries.pop(key)
        return self.transfers.upload(offloaded.tensors, after=offloaded.done)
