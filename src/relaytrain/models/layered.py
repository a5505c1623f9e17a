"""The layered model: `embed -> blocks[0..N) -> head(loss)` over a Hugging Face model.

Every strategy works on this abstraction. The parts share their parameters with the wrapped
Hugging Face model (nothing is copied), so the math is the model's own and
`hf_model.save_pretrained` writes the trained weights under their usual names.

Losses are returned as *sums* together with the number of items they sum over: a strategy
divides by the item count of the whole minibatch, which makes micro-batched accumulation
exactly the full batch's mean loss even when micro-batches hold different numbers of
tokens.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABCMeta, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from relaytrain.objectives.base import Divisor, LossTerms, Objective
from relaytrain.objectives.chunked import Chunking
from relaytrain.schema.row import row_values, with_row_fields
from relaytrain.step.evaluation import EvalStats
from relaytrain.utils.errors import ConfigError

# The mask builders' "no KV cache" argument: `cache=None` from transformers 5.24 on, where
# `past_key_values` is deprecated; `past_key_values=None` before (the GPU images carry 5.17).
NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}


@dataclass(frozen=True)
class Draw:
    """Which micro-batch of the run a training micro-batch is: with the part that runs it, the key
    of its random draws (`draw_seed`). `seed` is train.seed, `step` the minibatch's position in
    the data stream, `index` the micro-batch's place in the minibatch, `replica` the data-parallel
    worker whose rows these are (0 where one worker holds them all)."""

    seed: int
    step: int
    index: int
    replica: int = 0


@with_row_fields
class MicroBatch:
    """A micro-batch's rows: every field of a row (`relaytrain.schema.row.FIELDS`: input_ids,
    labels, attention_mask, position_ids, ...) as [batch, ...] tensors, then its draw key."""

    # The key of its dropout masks, set by the loader for every training micro-batch. None (a
    # micro-batch made by hand, an evaluation batch): the parts draw from torch's global stream.
    draw: Draw | None = None

    def _map(self, fn) -> MicroBatch:
        """`fn` of every tensor; the draw key carried along."""
        tensors = {name: None if t is None else fn(t) for name, t in row_values(self).items()}
        return dataclasses.replace(self, **tensors)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def rows(self, index: slice | torch.Tensor, replica: int | None = None) -> MicroBatch:
        """These rows of every tensor (a replica's share of a micro-batch): `replica` names whose
        they are, so that each replica draws its own masks for its own rows."""
        share = self._map(lambda t: t[index])
        if replica is not None and share.draw is not None:
            share.draw = dataclasses.replace(share.draw, replica=replica)
        return share

    def pin_memory(self) -> MicroBatch:
        return self._map(lambda t: t.pin_memory())

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel() if self.attention_mask is None else int(self.attention_mask.sum())


# --------------------------------------------------------------------------- keyed draws
# Every random draw inside a part's forward (dropout) comes from a generator seeded by the key
# (run seed, step, micro-batch index, replica, part), set where the part runs: in `Block.forward`
# and in `LayeredModel.embed_input` / `head_loss`, which every strategy calls. So a sample gets
# the same masks in the same part whichever strategy runs it, in whatever order, on whichever
# process, and a recomputed part draws what its first forward drew.

EMBED_PART = 0  # part codes: the embeddings 0, block i 1 + i, the head the largest code
_PART_BITS, _REPLICA_BITS, _INDEX_BITS, _STEP_BITS = 12, 12, 14, 26  # 64 bits in all
HEAD_PART = (1 << _PART_BITS) - 1
_LIMITS = (("step", _STEP_BITS, "train.steps"), ("index", _INDEX_BITS, "strategy.num_microbatches"),
           ("replica", _REPLICA_BITS, "strategy.replicas"))
_MASK64 = (1 << 64) - 1


def block_part(index: int) -> int:
    """The part code of block `index`."""
    if not 0 <= index < HEAD_PART - 1:
        raise ConfigError(f"model.num_layers: keyed dropout draws tell {HEAD_PART - 1} blocks apart, and this "
                          f"model has block {index}; use fewer layers")
    return 1 + index


def draw_seed(draw: Draw, part: int) -> int:
    """The 64-bit generator seed of `part`'s draws for the micro-batch `draw`.

    step (26 bits: 67 M steps), index (14 bits: 16384 micro-batches a minibatch), replica (12
    bits: 4096) and part (12 bits: the embeddings, 4094 blocks, the head) are packed into one
    64-bit integer, distinct for distinct keys in those ranges (beyond them: ConfigError; a block
    past them is refused by `block_part`). The run seed times an odd constant
    is added and SplitMix64's finalizer applied: both are bijections of 64-bit integers, so two
    draws of one run never get one seed, and every output bit depends on every input bit (nearby
    keys give unrelated streams). CUDA's Philox generator takes all 64 bits; torch's CPU
    generator (mt19937) keeps the low 32, so on the CPU two draws of a long run may share masks
    by chance (about one pair in 2**32), which biases nothing.
    """
    packed = 0
    for name, bits, key in _LIMITS:
        value = getattr(draw, name)
        if not 0 <= value < 1 << bits:
            raise ConfigError(f"{key}: keyed dropout draws tell {1 << bits} values of the {name} apart, and this run "
                              f"reaches {value}; lower {key}")
        packed = packed << bits | value
    z = ((packed << _PART_BITS | part) + draw.seed * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@contextmanager
def keyed_draws(draw: Draw | None, part: int, device: torch.device, active: bool = True):
    """Run a part with torch's generators (the CPU's, and `device`'s where it is a GPU) seeded by
    `draw_seed(draw, part)`; afterwards they continue where they were, as if the part drew
    nothing. Without a key, or not `active` (evaluation: dropout draws nothing), no change."""
    if draw is None or not active:
        yield
        return
    seed = draw_seed(draw, part)
    cuda = None
    if device.type == "cuda":
        cuda = torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    saved = torch.default_generator.get_state(), None if cuda is None else cuda.get_state()
    torch.default_generator.manual_seed(seed)
    if cuda is not None:
        cuda.manual_seed(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        if cuda is not None:
            cuda.set_state(saved[1])


DRAW = "draw"  # the ctx entry holding the micro-batch's draw key


class Block(nn.Module):
    """One transformer layer with a uniform call: `block(hidden, ctx) -> hidden`.

    `ctx` holds what every block of a micro-batch shares (the attention mask), computed once
    per micro-batch by `LayeredModel.context`, and the micro-batch's draw key (`ctx[DRAW]`): the
    layer runs under the key of (that micro-batch, this block), so its dropout masks are the
    same whichever strategy calls it, and a recompute draws them again. `index` is the block's
    place in the whole model, kept when a pipeline stage holds only some blocks. A family whose
    blocks differ in what they take from `ctx` (a decoder's sliding-window and full-attention
    layers) brings its own subclass (`LayeredModel.block_class`) overriding `run_layer`.
    """

    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.layer = layer
        self.index = index

    # train.compile=true: `relaytrain.models.compile.run_compiled`, `run_layer` compiled once for every
    # block (a plain attribute: the copies strategies make keep it); None runs it eagerly.
    compiled = None

    def forward(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        with keyed_draws(ctx.get(DRAW), block_part(self.index), hidden.device, self.training):
            out = self.run_layer(hidden, ctx) if self.compiled is None else self.compiled(self, hidden, ctx)
        return out[0] if isinstance(out, tuple) else out

    def run_layer(self, hidden: torch.Tensor, ctx: dict):
        """The Hugging Face layer on `ctx`'s shared inputs (its output as the layer returns it)."""
        return self.layer(hidden, **{key: value for key, value in ctx.items() if key != DRAW})


class LayeredModel(nn.Module, metaclass=ABCMeta):
    """A Hugging Face model seen as embed -> blocks -> head.

    Subclasses (one per model family) provide the parts and `shared_context` (per-micro-batch
    inputs of the blocks); the head computes token by token (`head(hidden)`: the logits). The
    loss, its item count and the evaluation sums are the objective's (`model.task`:
    `relaytrain.objectives`), from the head, the last block's output and the micro-batch: a
    causal LM's cuts the head's work into chunks of tokens (`loss_chunks`).

    Strategies run the parts through `embed_input`, `context` (which adds the draw key),
    `blocks[i]` and `head_loss`: each part's random draws are keyed by its micro-batch there.
    """

    family: str = ""
    block_class: type[Block] = Block
    # Whether `context` keeps records packed into one row apart by `MicroBatch.position_ids`.
    packs_records: bool = False
    # Whether a worker holding some tokens of a sequence can run the blocks on them with the whole
    # sequence's context (`token_context`): sequence parallelism, strategies/sequence_parallel.py.
    cuts_sequences: bool = False

    def __init__(self, hf_model: nn.Module, embed: nn.Module, blocks: list[nn.Module], head: nn.Module,
                 objective: Objective):
        super().__init__()
        # Kept outside the module tree: its parameters are reachable through the parts,
        # and registering it too would list every parameter under two names.
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "hf_config", hf_model.config)
        self.rename_parameters()
        self.embed = embed
        self.blocks = nn.ModuleList(self.block_class(layer, index) for index, layer in enumerate(blocks))
        self.head = head
        self.objective = objective  # the run's (`model.task`, resolved): the loss, its items and the evaluation sums
        # How a causal LM's head and loss are cut into chunks of tokens (model.loss_chunk_tokens,
        # set by `build_model`; auto where it saves memory).
        self.loss_chunks = Chunking(vocab=getattr(self.hf_config, "vocab_size", 0) or 0)

    def rename_parameters(self) -> None:
        """Every parameter's Hugging Face name, fixed before any strategy splits the model (tied
        weights: the first name); again after adapters are injected (they rename what they wrap)."""
        object.__setattr__(self, "_hf_names", {id(p): n for n, p in self.hf_model.named_parameters()})

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    # -- per-family hooks -------------------------------------------------------------
    @abstractmethod
    def shared_context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        """What every block of this micro-batch shares (the attention mask)."""

    def token_context(self, ctx: dict, tokens: slice) -> dict:
        """A whole sequence's `context` as the worker holding `tokens` of it uses it: per-token
        inputs sliced, masks whole (its attention sees every token). Families that cut sequences."""
        raise NotImplementedError(f"the {self.family} family does not cut sequences")

    # -- the parts as strategies run them: draws keyed by the micro-batch -----------------------
    def embed_input(self, input_ids: torch.Tensor, draw: Draw | None = None) -> torch.Tensor:
        """The embeddings' output, their dropout drawn under `draw` (the micro-batch's key)."""
        with keyed_draws(draw, EMBED_PART, input_ids.device, self.embed.training):
            return self.embed(input_ids)

    def context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        """What every block of this micro-batch takes: the family's shared inputs and the
        micro-batch's draw key (`DRAW`)."""
        return {**self.shared_context(mb, hidden), DRAW: mb.draw}

    def head_loss(self, hidden: torch.Tensor, mb: MicroBatch) -> LossTerms:
        """The objective's loss terms for the micro-batch (sums, fp32; `LossTerms.over` divides by
        the minibatch's items); the head's dropout (BERT's classifier has one) drawn under the
        micro-batch's key."""
        with keyed_draws(mb.draw, HEAD_PART, hidden.device, self.head.training):
            terms = self.objective.head_loss(self.head, hidden, mb, self.loss_chunks)
        if terms.figures and self.head.training and hidden.device.type != "meta":
            self._add_figures(terms.figures)
        return terms

    def _add_figures(self, figures: dict[str, tuple[torch.Tensor, torch.Tensor | int]]) -> None:
        """The objective's figures of a training micro-batch, summed until `loss_term_sums` reads
        them (sums and counts may be device tensors: read once a step, not once a micro-batch)."""
        held = self.__dict__.setdefault("_figure_sums", {})
        for name, (total, count) in figures.items():
            before = held.get(name, (0.0, 0))
            held[name] = (before[0] + total, before[1] + count)

    def eval_stats(self, hidden: torch.Tensor, mb: MicroBatch) -> EvalStats:
        """The evaluation sums of one micro-batch (loss, items, correct, confusion)."""
        return self.objective.head_eval_stats(self.head, hidden, mb, self.loss_chunks)

    def row_logps(self, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Each row's log-prob of its labelled tokens [rows] (a preference objective's reference
        pass, `relaytrain.run.reference`), from the last block's `hidden`."""
        return self.objective.row_logps(self.head(hidden), mb.labels)

    def loss_items(self, mb: MicroBatch) -> int:
        """How many items `head_loss` sums over."""
        return self.objective.items(mb)

    @property
    def num_labels(self) -> int | None:
        """Classes of a classifier head; None for language models."""
        return self.hf_config.num_labels if self.objective.classifies else None

    def hf_name(self, param: torch.Tensor) -> str:
        return self._hf_names[id(param)]

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Pairs of (embed parameter name, head parameter name) that are one tensor."""
        return []

    def loss_term_sums(self) -> dict[str, tuple[float, int]]:
        """The terms this process's training micro-batches added to the objective's loss since the
        last call (a mixture's router term: `router_aux`), each as (its sum, the count it is a mean
        over: items, or micro-batches for a term of the micro-batch as a whole). The same names on
        every process of a run, counts 0 included, so that `Strategy.loss_terms` can sum them over
        the replicas; reported beside the loss each step. Here: the objective's figures (a
        preference objective's rewards), each its sum over the items and their count."""
        held, self.__dict__["_figure_sums"] = self.__dict__.get("_figure_sums", {}), {}
        return {name: (float(held[name][0]), int(held[name][1])) if name in held else (0.0, 0)
                for name in self.objective.figures}

    # -- whole-model helpers ------------------------------------------------------------
    def forward(self, mb: MicroBatch, divisor: Divisor | None = None) -> torch.Tensor:
        """Loss of one micro-batch divided by `divisor` (default: its own item count, one
        micro-batch), with the masks every strategy draws for it."""
        hidden = self.embed_input(mb.input_ids, mb.draw)
        ctx = self.context(mb, hidden)
        for block in self.blocks:
            hidden = block(hidden, ctx)
        return self.head_loss(hidden, mb).over(divisor or Divisor(self.loss_items(mb)))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@contextmanager
def eval_mode(module: nn.Module):
    """Dropout off while evaluating; the module's training flag restored afterwards."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)
