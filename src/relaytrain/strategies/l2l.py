"""L2L: layer-to-layer relay execution with the eager param server (Algorithm 2 of the paper).

The host owns the model (`relaytrain.eps`); the device holds only the part executing and
the one prefetched after it. One step walks the parts in *relay order*

    embed, block 0 .. block N-1, head, block N-1 .. block 0, embed

and runs every micro-batch through a part before the next is relayed in (the loop
inversion of Algorithm 2: weights cross once per minibatch, not once per micro-batch).

- Forward: each part runs over all micro-batches without autograd; only each block's
  input is stashed (on the device, or on the host for `stash=cpu`), together with the RNG
  state it started from.
- Turn-around: the head runs forward and backward at once per micro-batch (nothing to
  recompute), giving the gradient w.r.t. the last block's output.
- Backward: each block is recomputed per micro-batch from its stash with the RNG state of
  its first forward (the same dropout masks), backpropagated, its gradients summed over the
  micro-batches by autograd, shipped to the EPS and freed; the EPS updates it on the host
  while the blocks below run.

The embeddings and the head are relayed like blocks rather than kept resident: the
embedding table is the largest single part (31 M parameters in BERT-Large, the size of 2.5
blocks; GPT-2's is also the LM head), so holding it through the step would cost more
device memory than the executing block itself, and it has to cross after every update
anyway. Relaying it costs one extra upload per step, prefetched during block 0's backward.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from relaytrain import metrics
from relaytrain.eps import EagerParamServer, Part
from relaytrain.errors import ConfigError
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.precision import LossScaler
from relaytrain.strategies.base import StepResult, Strategy, minibatch_items
from relaytrain.strategies.relay import Transfer, Transfers

_PHASE_LABELS = {"forward": "forward", "recompute_backward": "recompute+backward",
                 "transfer_wait": "transfer wait", "optimizer_exposed": "exposed optimizer"}


class HeadLoss(nn.Module):
    """The head as a part: `(hidden, labels) -> summed loss`, computed by the model's `head_loss`.

    `head` is registered so a functional call swaps the head's parameters for device copies;
    `head_loss` reaches the same module object through the model.
    """

    def __init__(self, model: LayeredModel):
        super().__init__()
        self.head = model.head
        object.__setattr__(self, "_model", model)  # not a child: its parameters are not the head's

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._model.head_loss(hidden, labels)


# --------------------------------------------------------------------------- weight relay


@dataclass
class Resident:
    """A part's weights on the device: the autograd leaves its gradients land on."""

    transfer: Transfer
    leaves: list[torch.Tensor]


class WeightRelay:
    """Brings parts to the device in relay order, never more than `capacity` at once.

    While part k computes, the part of the next visit is uploaded (prefetch). When room is
    needed, the resident part whose next visit is farthest away leaves; so at the turn-around
    the last block, needed again right after the head, stays and does not cross twice.
    """

    def __init__(self, parts: list[Part], transfers: Transfers, device: torch.device, capacity: int, prefetch: bool):
        self.parts = parts
        self.transfers = transfers
        self.capacity = capacity
        self.prefetch = prefetch and capacity >= 2
        head = len(parts) - 1
        self.order = list(range(head + 1)) + list(range(head - 1, -1, -1))
        # Buffers (position ids) are constant: on the device once, outside the relay.
        self.buffers = [{n: b.to(device) for n, b in p.module.named_buffers()} for p in parts]
        self.resident: dict[int, Resident] = {}
        self.cursor = 0
        self.peak_resident = 0

    def start_step(self) -> None:
        """Forget last step's device copies: the EPS has updated every part since."""
        self.resident.clear()
        self.cursor = 0

    def next_visit(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """The weights of the next part in relay order (for a functional call) and its leaves."""
        index = self.order[self.cursor]
        self._make_resident(index)
        if self.prefetch and self.cursor + 1 < len(self.order):
            self._make_resident(self.order[self.cursor + 1])
        self.cursor += 1
        leaves = self.resident[index].leaves
        self.transfers.acquire(self.resident[index].transfer)
        weights = dict(zip(self.parts[index].names, leaves, strict=True)) | self.buffers[index]
        return weights, leaves

    def _make_resident(self, index: int) -> None:
        if index in self.resident:
            return
        while len(self.resident) >= self.capacity:
            del self.resident[self._farthest_needed()]
        transfer = self.transfers.upload(self.parts[index].wires)
        leaves = [t.requires_grad_(True) for t in transfer.tensors]
        self.resident[index] = Resident(transfer, leaves)
        self.peak_resident = max(self.peak_resident, len(self.resident))

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


# --------------------------------------------------------------------------- RNG replay


def capture_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextmanager
def replayed_rng(state, device: torch.device):
    """Run with the RNG as it was at `state` (same dropout masks), then continue the stream as before."""
    saved = capture_rng(device)
    _restore_rng(state, device)
    try:
        yield
    finally:
        _restore_rng(saved, device)


# --------------------------------------------------------------------------- the strategy


class L2L(Strategy):
    """Algorithm 2 over the eager param server. The EPS's masters *are* the model's parameters,
    so `sync_model` has nothing to copy; `step` returns only after every update has landed."""

    name = "l2l"

    def __init__(self, model, cfg, device, precision):
        super().__init__(model, cfg, device, precision)
        s = cfg.strategy
        self.stash_on_host = _stash_on_host(s)
        if s.max_resident_blocks < 1:
            raise ConfigError(f"strategy.max_resident_blocks={s.max_resident_blocks} must be at least 1")
        self.scaler = LossScaler(precision.needs_loss_scaling, cfg.precision.loss_scale, cfg.precision.growth_interval)
        modules = [("embed", model.embed), *((f"block.{i}", b) for i, b in enumerate(model.blocks)),
                   ("head", HeadLoss(model))]
        self.eps = EagerParamServer(modules, cfg.optim, self.scaler, precision.weight_dtype,
                                    pin=device.type == "cuda")
        self.transfers = Transfers(device)
        self.relay = WeightRelay(self.eps.parts, self.transfers, device, s.max_resident_blocks, s.prefetch)
        self.timer = metrics.PhaseTimer()
        self.head_index = len(self.eps.parts) - 1

    # -- one step -----------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        self.eps.set_lr(lr)
        items = minibatch_items(self.model, minibatch)
        mbs = [mb.to(self.device, non_blocking=True) for mb in minibatch]
        self.relay.start_step()
        stash = ActivationStash(self.transfers, self.stash_on_host)
        with self.timer.phase("forward"):
            hidden, ctxs, rng = self._forward(mbs, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("recompute_backward"):
            grads, loss = self._turnaround(hidden, mbs, items)
            self._backward(grads, mbs, ctxs, rng, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("optimizer_exposed"):
            skipped = self.eps.wait()
        return StepResult(loss=float(loss), skipped=skipped)

    def _forward(self, mbs: list[MicroBatch], stash: ActivationStash):
        """Every micro-batch through one part before the next part (no autograd, block inputs stashed)."""
        rng: dict[tuple[int, int], tuple] = {}
        hidden: list[torch.Tensor | None] = [None] * len(mbs)
        ctxs: list[dict | None] = [None] * len(mbs)
        for index in range(self.head_index):
            weights, _ = self.relay.next_visit()
            for u, mb in enumerate(mbs):
                if index > 0:
                    stash.put((index, u), hidden[u])
                rng[index, u] = capture_rng(self.device)
                with torch.no_grad():
                    hidden[u] = self._compute(index, weights, mb, hidden[u], ctxs[u])
            if index == 0:  # the attention masks, shared by every block of a micro-batch
                ctxs = [self.model.context(mb, h) for mb, h in zip(mbs, hidden, strict=True)]
        return hidden, ctxs, rng

    def _turnaround(self, hidden: list[torch.Tensor], mbs: list[MicroBatch], items: int):
        """Head forward and backward per micro-batch: the loss and its gradient w.r.t. the last block's output."""
        weights, leaves = self.relay.next_visit()
        module = self.eps.parts[self.head_index].module
        grads, loss_sum = [], torch.zeros((), device=self.device)
        for x, mb in zip(hidden, mbs, strict=True):
            x = x.requires_grad_(True)
            with self._autocast():
                loss = functional_call(module, weights, (x, mb.labels)) / items
            self.scaler.scale_loss(loss).backward()
            grads.append(x.grad)
            loss_sum += loss.detach()
        self._ship(self.head_index, leaves)
        return grads, loss_sum

    def _backward(self, grads, mbs, ctxs, rng, stash: ActivationStash) -> None:
        """Blocks in reverse, then the embeddings: recompute with the forward's RNG, backpropagate, ship."""
        for index in range(self.head_index - 1, -1, -1):
            weights, leaves = self.relay.next_visit()
            for u, mb in enumerate(mbs):
                x = None if index == 0 else stash.take((index, u), _next_stash_key(index, u, len(mbs)))
                if x is not None:
                    x.requires_grad_(True)
                with replayed_rng(rng[index, u], self.device):
                    y = self._compute(index, weights, mb, x, ctxs[u])
                torch.autograd.backward(y, grads[u])
                grads[u] = None if x is None else x.grad
            self._ship(index, leaves)

    def _compute(self, index: int, weights: dict, mb: MicroBatch, hidden: torch.Tensor | None, ctx: dict | None):
        """One part on one micro-batch: the embeddings read the input ids, a block the hidden state."""
        args = (mb.input_ids,) if index == 0 else (hidden, ctx)
        with self._autocast():
            return functional_call(self.eps.parts[index].module, weights, args)

    def _ship(self, index: int, leaves: list[torch.Tensor]) -> None:
        """Hand a part's minibatch gradients to the EPS (downloaded on the offload stream on CUDA)."""
        present = [i for i, t in enumerate(leaves) if t.grad is not None]
        transfer = self.transfers.offload([leaves[i].grad for i in present])
        for t in leaves:
            t.grad = None
        grads: list[torch.Tensor | None] = [None] * len(leaves)
        for i, g in zip(present, transfer.tensors, strict=True):
            grads[i] = g
        self.eps.submit(index, grads, transfer.done)

    def _autocast(self):
        return self.precision.autocast_context(self.device)

    # -- checkpoints, reporting and lifetime --------------------------------------------------
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self.eps.parts if part.optimizer is not None]

    def weights_loaded(self) -> None:
        self.eps.refresh_wires()

    def report(self) -> dict:
        phases = dict(self.timer.totals)
        phases["transfer_wait"] = self.transfers.wait_s
        eps = self.eps.stats.as_dict()
        steps = max(eps["steps"], 1)
        rate = eps["parameters_per_s"]
        summary = {
            "resident blocks (peak / bound)": f"{self.relay.peak_resident} / {self.relay.capacity}",
            "activation stash": "host" if self.stash_on_host else "device",
            **{f"{label} s/step": f"{phases.get(key, 0.0) / steps:.3f}" for key, label in _PHASE_LABELS.items()},
            "EPS optimizer": "n/a" if rate is None else f"{rate / 1e6:.1f} M params/s",
            "EPS updates": "deferred to end of backward (clipping / fp16 check)" if self.eps.defer else "eager",
        }
        return {
            "stash": "cpu" if self.stash_on_host else "device",
            "max_resident_blocks": self.relay.capacity,
            "peak_resident_blocks": self.relay.peak_resident,
            "deferred_updates": self.eps.defer,
            "phase_times_s": phases,
            "eps": eps,
            "loss_scale": self.scaler.scale,
            "summary": summary,
        }

    def close(self) -> None:
        self.eps.close()


def _next_stash_key(index: int, u: int, num_microbatches: int) -> tuple[int, int] | None:
    """The stash entry the backward reads after (index, u): micro-batches in order, blocks in reverse."""
    if u + 1 < num_microbatches:
        return index, u + 1
    return (index - 1, 0) if index > 1 else None


def _stash_on_host(s) -> bool:
    if s.name == "l2l_stash_cpu" and s.stash != "cpu":
        raise ConfigError(f"strategy=l2l_stash_cpu keeps the stash on the host; drop strategy.stash={s.stash}")
    return s.stash == "cpu"
