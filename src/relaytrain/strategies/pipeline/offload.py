"""`strategy.offload=host`: a stage's fp32 masters and optimizer state live in host memory (AxoNN's
memory optimization), served by the eager param server; the device keeps only the working
weights (one buffer, two under 2BW) and the gradients.

An update (`HostVersions.apply`) runs in buckets, one per part of the stage (the embeddings,
each block, the head: the L2L server's parts, about AxoNN's 16 M parameters for BERT-Large's
blocks), and returns at once. For each part, in forward order:

    device grads --(offload stream)--> pinned host --(EPS worker: optimizer step on the master)
    --> (upload stream) --> the device buffer of the new version

so while the worker steps part j, part j+1's gradients are still coming down and part j-1's
new weights are going up. The worker keeps one upload in flight (the next step of a master
must not overwrite it mid-copy) and signals the version *landed* after its last upload; the
stage waits for that only before its first forward on the new version (`await_version`):
under flush and GPipe right away, under 2BW a whole batch later, so 2BW hides the update
entirely behind the next batch's work.

2BW: the host master is the newest version W(b); the update W(b+1) = W(b) - lr * grad f(W(b-1))
is made on it and uploaded into the device buffer that held W(b-1), which batch b, its only
user, has finished with. One master, one optimizer state, two device versions.

On the CPU the "device" is the host: the same structure runs (the downloads hand the tensors
over, the uploads are copies), with the masters as an extra host copy. In a dry run on the
meta device the masters, the optimizer state (made on the EPS worker's thread) and the
downloaded gradients (`memory.on_host`) are host memory, so the simulated device memory is a
GPU run's.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from relaytrain.records.optimizer_state import load_optimizer_state, optimizer_state
from relaytrain.step.precision import LossScaler
from relaytrain.step.rounding import Bf16Masters, bf16_masters
from relaytrain.strategies.base import optimizer_tensors
from relaytrain.strategies.eps import EagerParamServer, Shipment
from relaytrain.strategies.pipeline.stage import StageModule
from relaytrain.strategies.pipeline.weights import VersionBuffers, version_copies
from relaytrain.strategies.transfers import Transfers

FAILURE_POLL_S = 0.05  # how often a stage waiting for an update checks that the EPS worker has not failed


def stage_parts(stage: StageModule) -> list[tuple[str, nn.Module]]:
    """The stage's parts in forward order: the buckets its update runs in."""
    m = stage.model
    parts = [("embed", m.embed)] if m.embed is not None else []
    parts += [(f"block.{index}", block) for index, block in zip(stage.block_indices, m.blocks, strict=True)]
    return parts + ([("head", m.head)] if m.head is not None else [])


class Landing:
    """One update's arrival in its device buffer, part by part (the EPS worker reports)."""

    def __init__(self, parts: int, after_compute: torch.cuda.Event | None):
        self.left = parts
        self.after_compute = after_compute  # CUDA: the buffer's last reader on the compute stream
        self.last_upload: torch.cuda.Event | None = None
        self.done = threading.Event()

    def uploaded(self, event: torch.cuda.Event | None) -> None:
        """One more part on its way up. The previous one must have arrived before the worker
        steps another master: at most one upload in flight, overlapping the next part's step."""
        if self.last_upload is not None:
            self.last_upload.synchronize()
        self.last_upload = event

    def part_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            if self.last_upload is not None:
                self.last_upload.synchronize()
            self.done.set()


class HostVersions(VersionBuffers):
    """Working weights on the device, masters and optimizer state on the host, updated by the EPS.

    `stage` is the stage as the model was built, on the host (on the meta device in a dry run):
    its parameters become the masters, and the device buffers are copies of it.
    """

    def __init__(self, stage: StageModule, versions: int, optim_cfg, device: torch.device, seed: int = 0):
        super().__init__(version_copies(copy.deepcopy(stage).to(device), versions), stage)
        self.cuda = device.type == "cuda"
        masters = dict(stage.named_parameters())
        self.masters = [masters[n] for n in self.names]  # aligned with every buffer's params
        self._name = dict(zip(map(id, self.masters), self.hf_names, strict=True))
        bf16 = Bf16Masters(seed, lambda p: self._name[id(p)], optim_cfg.host_loops) if bf16_masters(optim_cfg) else None
        self.eps = EagerParamServer(stage_parts(stage), optim_cfg, LossScaler(False), pin=self.cuda, bf16=bf16,
                                    device=device)
        if bf16 is not None:  # the buffers compute with the masters as the EPS keeps them: rounded to bf16
            for version in range(len(self.buffers)):
                self._load(version, dict(zip(self.hf_names, self.masters, strict=True)))
        position = {id(p): i for i, p in enumerate(self.masters)}
        self.grad_positions = [[position[id(p)] for p in part.masters] for part in self.eps.parts]
        self.owned_positions = [[position[id(p)] for p in part.owned] for part in self.eps.parts]
        self.transfers = Transfers(device)
        self.upload_stream = torch.cuda.Stream(device) if self.cuda else None
        self.landings: dict[int, Landing] = {}  # version -> its update, until the stage first waits for it

    # -- the update ------------------------------------------------------------------------------
    def apply(self, grads: list[torch.Tensor | None], lr: float) -> None:
        """Start the update that makes version `updates + 1` (see the module's docstring)."""
        version = self.updates + 1
        target = self.params[version % len(self.buffers)]
        landing = Landing(len(self.eps.parts), _compute_done() if self.cuda else None)
        self.landings[version] = landing
        for index, positions in enumerate(self.grad_positions):
            present = [j for j, i in enumerate(positions) if grads[i] is not None]
            transfer = self.transfers.offload([grads[positions[j]] for j in present])
            host: list[torch.Tensor | None] = [None] * len(positions)
            for j, tensor in zip(present, transfer.tensors, strict=True):
                host[j] = tensor
            uploads = [(target[i], self.masters[i]) for i in self.owned_positions[index]]
            then = _Upload(uploads, landing, self.upload_stream)
            self.eps.submit(index, Shipment(host, transfer.done, lr=lr, then=then))
        self.updates = version

    def await_version(self, version: int) -> None:
        landing = self.landings.pop(version, None)
        if landing is None:
            return
        while not landing.done.wait(FAILURE_POLL_S):
            self.eps.raise_if_failed()

    def settle(self) -> None:
        self.eps.settle()
        self.landings.clear()  # every update has landed

    # -- state -----------------------------------------------------------------------------------
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self.eps.parts if part.optimizer is not None]

    def state(self) -> tuple[dict, dict, dict | None]:
        """The host master is the newest version; (2BW) the previous one is on the device."""
        self.settle()
        newest = {n: p.detach().cpu().clone() for n, p in zip(self.hf_names, self.masters, strict=True)}
        optimizer = optimizer_state(self.optimizers(), self._optimizer_name)
        previous = self._by_name(self.updates - 1) if len(self.buffers) == 2 else None
        return newest, optimizer, previous

    def load_state(self, updates: int, weights: dict, optimizer: dict, previous: dict | None) -> None:
        self.settle()
        self.updates = updates
        with torch.no_grad():
            for n, p in zip(self.hf_names, self.masters, strict=True):
                p.copy_(weights[n])
        self._load(updates, weights)
        if len(self.buffers) == 2:
            self._load(updates - 1, previous if previous else weights)
        load_optimizer_state(self.optimizers(), self._optimizer_name, optimizer)

    def _optimizer_name(self, p: torch.Tensor) -> str:
        """The name of a parameter an EPS optimizer steps: its master's (a bf16 master's stand-in too)."""
        return self._name[id(self.eps.master(p))]

    def host_bytes(self) -> dict[str, int]:
        return {"master weights": sum(_nbytes(p) for p in self.masters),
                "optimizer state": sum(_nbytes(t) for t in optimizer_tensors(self.optimizers()))}

    def report(self) -> dict:
        return self.eps.stats.as_dict()

    def close(self) -> None:
        self.eps.close()


class _Upload:
    """The continuation the EPS worker runs after stepping one part: copy its new masters into
    the device buffer of the new version (on CUDA: on the upload stream, from pinned memory,
    after the compute stream's last use of that buffer)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], landing: Landing,
                 stream: torch.cuda.Stream | None):
        self.pairs, self.landing, self.stream = pairs, landing, stream

    @torch.no_grad()
    def __call__(self) -> None:
        targets, masters = [t for t, _ in self.pairs], [m for _, m in self.pairs]
        if self.stream is None:
            if targets:
                torch._foreach_copy_(targets, masters)
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.landing.after_compute)
                for target, master in self.pairs:
                    target.copy_(master, non_blocking=True)
                self.landing.uploaded(_record(self.stream))
        self.landing.part_done()


def _compute_done() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
