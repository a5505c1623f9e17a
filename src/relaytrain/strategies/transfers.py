"""Host <-> device transfers, ordered by CUDA streams and events: the L2L relay's weights and
stash, and a pipeline stage's weights from its host-resident masters.

On CUDA, uploads (weights, stash coming back) run on a copy stream and downloads
(gradients, stash going out) on an offload stream, both from/to pinned host memory so the
copies are asynchronous DMA that overlaps with compute. Every transfer returns a
`Transfer` whose event its consumer waits on before reading: the compute stream for
uploads, the EPS worker or a later upload for downloads. Tensors created on one stream and
used on another are `record_stream`-ed so the caching allocator never recycles memory a
stream still reads.

On the CPU the device *is* the host: an upload is a detached alias of the host tensor and a
download hands the tensor over as it is, with no events; the code that uses them is the same.

In a dry run (the meta device) host and device tensors are both shapes on the meta device:
an upload is then a copy (device memory the dry run counts), a download a copy declared as
host memory (`memory.on_host`), so the simulated device memory is the CUDA run's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from relaytrain.dryrun.memory import on_host


@dataclass
class Transfer:
    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None = None  # None: already complete (CPU)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device slice, staged copy)


@dataclass
class UploadCounts:
    """The weight bytes the relay sent to the device since they were cleared (the measured steps')."""

    parts: int = 0  # tensors sent whole: the parts' wires and the frozen tensors that travel whole
    experts: int = 0  # experts streamed by need: the bytes that crossed
    experts_whole: int = 0  # and what those tensors would have been whole

    @property
    def total(self) -> int:
        return self.parts + self.experts

    def clear(self) -> None:
        self.parts = self.experts = self.experts_whole = 0


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.dry = device.type == "meta"
        self.upload_stream = torch.cuda.Stream(device) if self.cuda else None
        self.offload_stream = torch.cuda.Stream(device) if self.cuda else None
        self.wait_s = 0.0  # host time blocked on uploads the compute needed and did not have yet

    def upload(self, host: list[torch.Tensor], after: torch.cuda.Event | None = None) -> Transfer:
        """Copy host tensors to the device on the copy stream (after `after`, e.g. an offload)."""
        if self.dry:
            return Transfer([t.detach().clone() for t in host])
        if not self.cuda:
            return Transfer([t.detach() for t in host])
        with torch.cuda.stream(self.upload_stream):
            if after is not None:
                self.upload_stream.wait_event(after)
            out = [t.to(self.device, non_blocking=True) for t in host]
            return Transfer(out, _record(self.upload_stream))

    def zeros(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor on the device, made on the copy stream (uploads into it follow it there)."""
        if not self.cuda:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(self.upload_stream):
            return torch.zeros(shape, dtype=dtype, device=self.device)

    def upload_into(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], held: list[torch.Tensor] = ()) -> Transfer:
        """Copy host slices into device slices, each pair (device slice, host slice), on the copy
        stream: what crosses is the host's bytes; a slice of another dtype lands in a staging copy
        on the device and is cast into its place once the compute stream acquires the transfer.
        `held`: device tensors made on the copy stream (`zeros`) that the compute stream will read."""
        if not self.cuda:
            for device, host in pairs:
                device.copy_(host)
            return Transfer([])
        casts = []
        with torch.cuda.stream(self.upload_stream):
            for device, host in pairs:
                if device.dtype == host.dtype:
                    device.copy_(host, non_blocking=True)
                else:
                    casts.append((device, host.to(self.device, non_blocking=True)))
            tensors = [*held, *(d for d, _ in pairs), *(staged for _, staged in casts)]
            return Transfer(tensors, _record(self.upload_stream), casts)

    def offload(self, device_tensors: list[torch.Tensor], host_out: list[torch.Tensor] | None = None) -> Transfer:
        """Copy device tensors to (pinned) host memory on the offload stream, after the compute so far."""
        if self.dry:
            with on_host():
                return Transfer([t.detach().clone() for t in device_tensors])
        if not self.cuda:
            return Transfer([t.detach() for t in device_tensors])
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            if host_out is None:
                host_out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_tensors]
            for h, t in zip(host_out, device_tensors, strict=True):
                h.copy_(t, non_blocking=True)
                t.record_stream(self.offload_stream)
            return Transfer(host_out, _record(self.offload_stream))

    def collective(self, start, tensor: torch.Tensor):
        """Start a collective over `tensor` after the compute so far. On CUDA it runs on the offload
        stream, which waits for it, so an `offload` queued next copies its result; the host
        needs nothing more (None). On the CPU the caller gets the work to wait on."""
        if not self.cuda:
            return start()
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            tensor.record_stream(self.offload_stream)
            start().wait()  # a stream wait (NCCL), not a host one
        return None

    def acquire(self, transfer: Transfer) -> list[torch.Tensor]:
        """The uploaded tensors, safe to compute on from the current stream."""
        if transfer.done is not None:
            if not transfer.done.query():
                start = time.perf_counter()
                transfer.done.synchronize()
                self.wait_s += time.perf_counter() - start
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(transfer.done)
            for t in transfer.tensors:
                t.record_stream(stream)
            transfer.done = None
        for device, staged in transfer.casts:  # on the compute stream, after the upload
            device.copy_(staged)
        transfer.casts = []
        return transfer.tensors


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
