"""Sampling on the device from a policy held on the host (L2L's masters), where it fits there.

L2L keeps the model on the host and streams blocks through the device; decoding token by token
from the host copy would run on the host's cores. So, where the whole policy and a micro-batch's
KV cache fit in the device's free memory, each rollout batch copies the policy's weights into a
device copy of the model, samples there, and frees the copy (L2L's training keeps its small
device footprint between batches). The copy's skeleton is made once on the meta device, sharing
no storage with the policy (a deep copy whose tensors are meta stand-ins), so making it costs no
host memory; its floating tensors take `dtype` (a cross-precision run's half dtype: the weights
as its blocks compute with them on the device).

Where the whole policy does not fit but a block does, `RelayCopy` decodes as L2L trains: the
embeddings, final norm and head stay on the device for the batch, and each block is filled from
the host as the forward reaches it and freed when it leaves, the next one uploading on a side
stream meanwhile (at most two blocks on the device). Every decoded token streams the blocks
through the device once, for all of the micro-batch's sequences together; their KV cache stays
on the device where it fits, else on the host, each layer's brought back as its block runs
(Hugging Face's offloaded cache). Scoring the finished rows (`each_logits`) goes the other way
round, as L2L trains: each block, once on the device, visits every micro-batch of the batch before
it leaves, so a scoring pass streams the model once, not once a micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from relaytrain.cost.rollout import cache_bytes
from relaytrain.models.family import LatentAttention
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.utils.units import GiB

Layered = Callable[[nn.Module], LayeredModel]  # a Hugging Face model seen as the run's layered model


class DeviceCopy:
    """A copy of `policy` made on `device` for the duration of `on_device()`, its weights the policy's."""

    # Where its sampling keeps the KV cache: on the device (False), or on the host, each layer's
    # brought to the device as its block runs (`RelayCopy` where the cache does not fit).
    cache_on_host = False

    def __init__(self, policy: nn.Module, device: torch.device, dtype: torch.dtype | None = None):
        self.policy, self.device = policy, device
        stand_ins = {id(t): _meta_like(t, dtype) for t in [*policy.parameters(), *policy.buffers()]}
        self.model = copy.deepcopy(policy, memo=stand_ins).requires_grad_(False)

    @property
    def bytes(self) -> int:
        """What the copy holds on the device."""
        return _bytes(self.model)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        """The copy on the device with the policy's current weights; freed on leaving."""
        self.model.to_empty(device=self.device)
        try:
            theirs = _tensors(self.policy)
            with torch.no_grad():
                for name, ours in _tensors(self.model).items():
                    ours.copy_(theirs[name], non_blocking=True)
            yield self.model
        finally:
            self.model.to_empty(device="meta")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


class RelayCopy(DeviceCopy):
    """`policy` on `device` a block at a time for the duration of `on_device()`: the parts
    outside `block_names` (its decoder layers, by module name) held there, each block filled from
    the policy as the forward reaches it and freed as it leaves."""

    def __init__(self, policy: nn.Module, device: torch.device, block_names: list[str],
                 dtype: torch.dtype | None = None, cache_on_host: bool = False, layered: Layered | None = None):
        super().__init__(policy, device, dtype)
        self.cache_on_host = cache_on_host
        self.block_names = block_names
        self.blocks = [self.model.get_submodule(name) for name in block_names]
        self.sources: list[dict[str, torch.Tensor]] = []  # each block's tensors in the policy, while on_device
        inside = {id(m) for block in self.blocks for m in block.modules()}
        self.resident = [m for m in self.model.modules() if id(m) not in inside]
        self.visits = 0  # blocks filled so far (the tests count a relay's uploads)
        self._ready: dict[int, torch.cuda.Event | None] = {}  # blocks filled or filling: their upload's end
        self._stream: torch.cuda.Stream | None = None  # the uploads' own stream on a GPU (made on first use)
        self._held: int | None = None  # the block `holding` keeps on the device across its calls
        self._layered = layered  # how the run's family sees a model as embed -> blocks -> head (`scores_together`)
        self._view: LayeredModel | None = None  # the copy seen so (made on first use)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self._enter(i) if self._held != i else None)
            block.register_forward_hook(lambda module, args, out, i=i: self._free(i) if self._held != i else None)
        RELAYS[id(self.model)] = self

    @property
    def bytes(self) -> int:
        """What the relay holds on the device at most: the resident parts and two blocks."""
        return self.resident_bytes + 2 * self.block_bytes

    @property
    def resident_bytes(self) -> int:
        return sum(_bytes(m, recurse=False) for m in self.resident)

    @property
    def block_bytes(self) -> int:
        return max(_bytes(block) for block in self.blocks)

    @property
    def streamed_bytes(self) -> int:
        """What one decoded token uploads: every block once."""
        return sum(_bytes(block) for block in self.blocks)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        """The resident parts on the device with the policy's current weights, the blocks
        relayed as the model runs; everything freed on leaving."""
        theirs = _tensors(self.policy)
        self.sources = [_tensors(self.policy.get_submodule(name)) for name in self.block_names]
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        try:
            for m in self.resident:
                m.to_empty(device=self.device, recurse=False)
            with torch.no_grad():
                for name, ours in _tensors(self.model).items():
                    if ours.device.type != "meta":
                        ours.copy_(theirs[name], non_blocking=True)
            yield self.model
        finally:
            if self._stream is not None:
                self._stream.synchronize()  # an upload of a block no token will read may still be under way
            for i in list(self._ready):
                self._free(i)
            self.sources = []
            self.model.to_empty(device="meta")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def each_logits(self, batches: list[MicroBatch]) -> Iterator[torch.Tensor]:
        """Each of `batches`' logits (micro-batches on the device), the blocks visiting them in
        L2L's order: every block, once filled, runs every micro-batch of a group before it leaves.
        A group is as many micro-batches as their hidden states fit in half the device's free
        memory (`score_groups`): the whole batch, streaming the model once, where they fit."""
        model = self.layered()
        for group in score_groups(batches, model.hf_config.hidden_size, free_bytes(self.device)):
            hidden = [model.embed_input(mb.input_ids) for mb in group]
            contexts = [model.context(mb, h) for mb, h in zip(group, hidden, strict=True)]
            for i, block in enumerate(model.blocks):
                with self.holding(i):
                    hidden = [block(h, ctx) for h, ctx in zip(hidden, contexts, strict=True)]
            for h in hidden:
                yield model.head(h)

    @property
    def scores_together(self) -> bool:
        """Whether its scoring passes run every micro-batch through each block at once
        (`each_logits`): it was given the run's family's layered view (`layered`)."""
        return self._layered is not None

    def layered(self) -> LayeredModel:
        """The copy as the run's family's layered model (embed -> blocks -> head, the blocks the
        relay's own), made once; with no router tally, for scoring needs the logits alone."""
        if self._view is None:
            self._view = self._layered(self.model)
            self._view.routing = None
        return self._view

    @contextlib.contextmanager
    def holding(self, i: int) -> Iterator[None]:
        """Block `i` on the device for every call inside (its hooks fill and free it once, not
        each call), the next one uploading meanwhile; freed on leaving."""
        self._enter(i)
        self._held = i
        try:
            yield
        finally:
            self._held = None
            self._free(i)

    def _enter(self, i: int) -> None:
        """Block `i` on the device before it runs (waiting for its upload where one is under way),
        and the next block's upload started beside its compute."""
        if i not in self._ready:
            self._fill(i)
        done = self._ready[i]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        following = (i + 1) % len(self.blocks)  # the last block's next: the first, for the next token
        if following not in self._ready:
            self._fill(following)

    def _fill(self, i: int) -> None:
        """Upload block `i`'s current weights: on the side stream on a GPU (its storage allocated on
        the compute stream, which frees it after use), else in place."""
        block = self.blocks[i]
        block.to_empty(device=self.device)
        self.visits += 1
        with torch.no_grad():
            if self._stream is None:
                _fill_from(block, self.sources[i])
                self._ready[i] = None
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the allocation
            with torch.cuda.stream(self._stream):
                _fill_from(block, self.sources[i])
                self._ready[i] = torch.cuda.Event()
                self._ready[i].record(self._stream)

    def _free(self, i: int) -> None:
        self.blocks[i].to_empty(device="meta")
        self._ready.pop(i, None)


RELAYS: weakref.WeakValueDictionary[int, RelayCopy] = weakref.WeakValueDictionary()  # by their models' ids


def relay_of(model: nn.Module) -> RelayCopy | None:
    """The relay whose model `model` is, if any."""
    return RELAYS.get(id(model))


def score_groups(batches: list[MicroBatch], hidden_size: int, free: int) -> list[list[MicroBatch]]:
    """`batches` cut into consecutive groups whose hidden states (fp32, the largest a block
    returns) fit in half of `free` bytes; at least one micro-batch a group."""
    per = max(mb.input_ids.numel() for mb in batches) * hidden_size * 4
    size = max(1, min(len(batches), free // 2 // per))
    return [batches[i:i + size] for i in range(0, len(batches), size)]


def decoder_layer_names(model: nn.Module) -> list[str]:
    """The module names of a Hugging Face causal LM's decoder layers: the first list of modules
    (in the model's own order, so before any list inside a layer) as long as its config's layers."""
    layers = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            return [f"{name}.{i}" for i in range(layers)]
    raise ValueError(f"{type(model).__name__} has no list of its {layers} decoder layers")


def free_bytes(device: torch.device) -> int:
    """What the device has free now (a CPU: unbounded, for the host is where a CPU run samples anyway)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 62


def choose(policy: nn.Module, device: torch.device, block_names: list[str], dtype: torch.dtype | None,
           cache: int, free: int, microbatches: int = 1, margin: float = 1.2, layered: Layered | None = None
           ) -> tuple[DeviceCopy | None, str]:
    """Where a host-held policy samples, given a micro-batch's KV cache (`cache` bytes), the
    micro-batches of a rollout batch and the device's `free` bytes (each needed with `margin` to
    spare): a whole copy on the device, a micro-batch decoded at a time; else a relay of its blocks
    decoding the whole batch together (its cache `microbatches` times a micro-batch's) with the
    cache there, else with the cache on the host; else nowhere (None: on the host, from the
    policy itself). The sentence says which and what it costs ("" for a whole copy)."""
    whole = DeviceCopy(policy, device, dtype)
    if _fits(whole.bytes + cache, free, margin):
        return whole, ""
    said = (f"rollouts: the policy ({whole.bytes / GiB:.1f} GiB) and a micro-batch's KV cache ({cache / GiB:.1f} GiB) "
            f"do not fit in the device's free memory ({free / GiB:.1f} GiB): ")
    batch = cache * microbatches
    relay, where = relayed(policy, device, block_names, dtype, batch, free, margin, layered)
    if not _fits(relay.bytes + (2 * batch // len(block_names) if relay.cache_on_host else batch), free, margin):
        return None, said + "sampling on the host, from its copy there"
    return relay, said + where


def relayed(policy: nn.Module, device: torch.device, block_names: list[str], dtype: torch.dtype | None,
            cache: int, free: int, margin: float = 1.2, layered: Layered | None = None) -> tuple[RelayCopy, str]:
    """A relay of `policy`'s blocks through `device`, its KV cache (`cache`: the whole rollout
    batch's, decoded together) there where it fits beside the relay's parts, else on the host (a
    GPU's: a CPU's "device" is the host); and the sentence saying what it streams and holds."""
    relay = RelayCopy(policy, device, block_names, dtype, layered=layered)
    relay.cache_on_host = device.type == "cuda" and not _fits(relay.bytes + cache, free, margin)
    return relay, (f"relay decode of the whole rollout batch, the blocks streamed through the device once a decoded token "
                   f"({relay.streamed_bytes / GiB:.1f} GiB a token, at most {relay.bytes / GiB:.1f} GiB held), "
                   f"the KV cache on the {'host' if relay.cache_on_host else 'device'}")


def kv_cache_bytes(config, sequences: int, tokens: int, dtype: torch.dtype) -> int:
    """Every layer's keys and values for `sequences` sequences of `tokens` tokens (the cost
    model's closed form, `cost.rollout`, from a Hugging Face config)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return cache_bytes(config.num_hidden_layers, heads, width, LatentAttention.of(config.to_dict()), sequences, tokens,
                       dtype.itemsize)


def _fits(nbytes: int, free: int, margin: float) -> bool:
    """Whether `nbytes` fit in `free` bytes with `margin` to spare."""
    return nbytes * margin <= free


def _bytes(module: nn.Module, recurse: bool = True) -> int:
    return sum(t.numel() * t.element_size()
               for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])


def _fill_from(module: nn.Module, source: dict[str, torch.Tensor]) -> None:
    for name, ours in _tensors(module).items():
        ours.copy_(source[name], non_blocking=True)


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    chosen = dtype if dtype is not None and t.is_floating_point() else t.dtype
    meta = torch.empty_like(t, device="meta", dtype=chosen)
    return nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Its parameters and buffers by every name they have: `to_empty` gives a tied weight's
    modules a tensor each, so the copy fills each of them (equal, for sampling)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
