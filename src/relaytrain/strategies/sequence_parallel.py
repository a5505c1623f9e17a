"""Sequence parallelism (`strategy.sequence_parallel=S`, DeepSpeed-Ulysses): S workers share every
sequence, each holding 1/S of its tokens through the embeddings, every block and the head.

Everything but attention works token by token, so a worker computes it on its own tokens alone.
Attention needs every token: around it, an all-to-all over the S workers of a sequence turns
"my tokens, every head" into "every token, my heads" (each worker then holds whole sequences for
H/S query heads and K/S key/value heads), the attention kernel the model was built with runs on
the whole sequence with the whole sequence's mask, and a second all-to-all turns the result back.
It is plugged into the Hugging Face layer as an attention function registered with transformers'
`AttentionInterface` (`relaytrain_ulysses_sdpa`, `relaytrain_ulysses_eager`), with the inner
kernel's mask builder registered under the same name: the layer itself is not copied.

What is right across the cut, and why:
- positions: the rotary cos/sin and `position_ids` are the whole sequence's, sliced to the
  worker's tokens (`SequenceSplit.context`, the family's `token_context`); records packed into a
  row keep their own positions;
- masks: built for the whole sequence (causal, sliding window, padding, packed records) from a
  stand-in of the whole sequence's hidden states, which the builders read only for its shape,
  dtype and device; the attention function receives that mask and whole sequences;
- the loss: a causal LM predicts token t+1 from token t, so each worker's labels are the whole
  sequence's shifted labels for its tokens (the last token of a worker predicts the first of the
  next); each worker's summed loss is divided by the minibatch's item count over every worker,
  and the gradients are summed over all of them, as the replicas' are;
- dropout: a decoder's only dropout is attention's, drawn under the block's key
  (`models.layered.keyed_draws`), which every worker of a sequence shares; each draws the mask
  of all H heads over the whole sequence, as the unsplit run's dropout does, and keeps its own
  heads' slice (S times the memory of its own share of the mask, only while dropout is on). That
  is torch's dropout over the probabilities: sdpa's math path (the CPU's) and eager attention; a
  GPU's fused sdpa kernels draw theirs another way, so there the masks agree only statistically.

A sequence whose length S does not divide is padded at its end (after every real token, so causal
attention keeps it from them, and unlabelled); in a row of packed records the padding is no
attention mask, which would keep transformers from reading the records apart from their positions
(`models.decoder.attention_mask`), so every record still sees only itself. Which part of its
replica's sequences a worker holds, and who shares them, is its strategy's layout's `sequence`
dim (`placement.layout`: rank r of R x S is replica r // S, part r % S).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from relaytrain.cost.formulas import StepCost
from relaytrain.cost.links import all_to_all_s
from relaytrain.models import dry_attention
from relaytrain.models.family import families, family_spec
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.placement.layout import Layout
from relaytrain.schema.config import SequenceParallelConfig
from relaytrain.step.evaluation import IGNORE_INDEX
from relaytrain.utils.errors import ConfigError

# The attention kernels the decoder family runs (`decoder.attention_for`), and a dry run's.
KERNELS = ("sdpa", "eager", dry_attention.NAME)
PREFIX = "relaytrain_ulysses_"


def sequence_parallel(strategy) -> int:
    """S, from the `strategy` config node: workers per sequence (1: none cut; a strategy without
    the key cuts none)."""
    return int(getattr(strategy, "sequence_parallel", 1))


# --------------------------------------------------------------------------- config checks


def check_sequence_parallel(strategy, m, compiled: bool) -> None:
    """One line for each setting the cut cannot honour yet (`strategy` and `m`: the strategy and
    model config nodes; `compiled`: train.compile); nothing when S is 1. The strategies that cut
    sequences call it; the others have no such key (their schema refuses it in one line)."""
    size = sequence_parallel(strategy)
    if size < 1:
        raise ConfigError(f"strategy.sequence_parallel={size} must be at least 1")
    if size == 1:
        return
    if not family_spec(m.family).layered.cuts_sequences:
        able = ", ".join(name for name, family in families().items() if family.layered.cuts_sequences)
        raise ConfigError(f"strategy.sequence_parallel cuts the sequences of model.family={able} only so far, not "
                          f"model.family={m.family}")
    if compiled:
        raise ConfigError("strategy.sequence_parallel with train.compile=true is not supported yet; drop one")
    if getattr(m, "num_experts", 0):
        raise ConfigError("strategy.sequence_parallel does not take mixtures of experts yet (their balancing loss "
                          "counts every token of a micro-batch in one place)")
    if not m.pretrained:  # a checkpoint's own heads are checked when it is loaded (`install`)
        _check_heads(size, m.num_heads, m.num_kv_heads or m.num_heads)


def can_cut(m, compiled: bool, size: int) -> bool:
    """Whether a run of the model section `m` (`compiled`: train.compile) can cut its sequences
    over `size` workers: what `check_sequence_parallel` lets through, the heads of a checkpoint
    (its resolved sizes) included. The planner offers cut shapes only where this holds."""
    try:
        check_sequence_parallel(SequenceParallelConfig(sequence_parallel=size), m, compiled)
        _check_heads(size, m.num_heads, m.num_kv_heads or m.num_heads)
    except ConfigError:
        return False
    return True


class CutSequenceCost:
    """Put before a strategy's cost model (`class C(CutSequenceCost, BaselineCost)`) to price runs
    that cut sequences. The model's own closed forms count its workers as the strategy does
    (`processes`: R x S, so the gradient sums, shards and peers are all of them) and are asked with
    the facts of one worker (`ModelFacts.cut`: its 1/S of every sequence's tokens computed, kept
    and stashed; attention over whole sequences for 1/S of the heads, the same work); this adds
    attention's all-to-alls (`attention_exchanges_s`), which nothing overlaps, and offers the cut
    sizes to the planner (`degrees`, as every placement does: `CostModel.placed_shapes` makes the shapes)."""

    def degrees(self, cfg, workers: int, family) -> dict[str, list[int]]:
        """Every S > 1 dividing `workers` that the model's sequences can be cut over (`can_cut`)."""
        sizes = [size for size in range(2, workers + 1)
                 if workers % size == 0 and can_cut(cfg.model, bool(cfg.train.compile), size)]
        return {**super().degrees(cfg, workers, family), "sequence_parallel": sizes}

    def step_cost(self, cfg, facts, profile):
        size = sequence_parallel(cfg.strategy)
        worker = facts.placed(cfg.strategy)  # its tokens (and, blocks split, its heads: what its all-to-alls carry)
        cost = super().step_cost(cfg, worker, profile)
        if size == 1:
            return cost
        exchanges = attention_exchanges_s(cfg, worker, profile, self.recomputes(cfg))
        return StepCost(cost.step_s + exchanges, {**cost.parts, "attention all-to-alls": exchanges}, cost.notes)

    def device_bytes(self, cfg, facts):
        return super().device_bytes(cfg, facts.cut(sequence_parallel(cfg.strategy)))

    def host_state_bytes(self, cfg, facts):
        return super().host_state_bytes(cfg, facts.cut(sequence_parallel(cfg.strategy)))


def attention_exchanges_s(cfg, facts, profile, recomputes: bool) -> float:
    """A cut worker's attention all-to-alls in a step: per micro-batch and block, the forward's
    queries, keys and values out and the output back (four calls), the backward's gradients the
    same way, and the forward's again where the block is recomputed; each moves (S-1)/S of the
    worker's share at the collectives' rate (`all_to_all_s`). Attention waits for them: exposed."""
    s = cfg.strategy
    passes = s.num_microbatches * facts.num_layers * (3 if recomputes else 2)
    return passes * all_to_all_s(facts.attention_exchange_bytes(s.microbatch_size), sequence_parallel(s), profile,
                                 messages=4)


def _check_heads(size: int, heads: int, kv_heads: int) -> None:
    if heads % size or kv_heads % size:
        raise ConfigError(f"strategy.sequence_parallel={size} must divide the attention heads ({heads}) and the "
                          f"key/value heads ({kv_heads}): each worker attends with a whole share of both")


# --------------------------------------------------------------------------- the workers of a sequence


@dataclass(frozen=True)
class SequenceCut:
    """This worker's place among the `size` workers of its sequences, and their process group
    (None: nothing moves between them, in a dry run or with one worker)."""

    size: int = 1
    part: int = 0
    group: object = None

    def tokens(self, length: int) -> slice:
        """This worker's tokens of a sequence `length` long (a multiple of `size`)."""
        share = length // self.size
        return slice(self.part * share, (self.part + 1) * share)


def sequence_cut(world, layout: Layout) -> SequenceCut:
    """This process's cut: its part along the layout's `sequence` dim, and the group of the
    workers sharing its sequences. Every process makes every sequence group (torch requires
    each group be made by all, in one order)."""
    size = layout.sequence
    if size == 1:
        return SequenceCut()
    part = layout.coordinates(world.rank).sequence
    if not world.distributed or world.simulated:
        return SequenceCut(size, part)
    mine = None
    for ranks in layout.groups("sequence"):
        group = dist.new_group(ranks, timeout=world.timeout)
        if world.rank in ranks:
            mine = group
    return SequenceCut(size, part, mine)


# --------------------------------------------------------------------------- the all-to-all


class _AllToAll(torch.autograd.Function):
    """Chunk w of dim 0 goes to worker w; chunk w of the result came from worker w. Its own
    adjoint: the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _all_to_all(x: torch.Tensor, cut: SequenceCut) -> torch.Tensor:
    """Equal chunks change hands, so shapes stay: a dry run (no group) only reshapes."""
    return x if cut.group is None else _AllToAll.apply(x, cut.group)


def whole_sequence(x: torch.Tensor, cut: SequenceCut) -> torch.Tensor:
    """[batch, heads, my tokens, dim] -> [batch, my heads, every token, dim]."""
    batch, heads, tokens, dim = x.shape
    chunks = x.reshape(batch, cut.size, heads // cut.size, tokens, dim).transpose(0, 1)  # chunk w: worker w's heads
    got = _all_to_all(chunks, cut)  # chunk w: worker w's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // cut.size, cut.size * tokens, dim)


def own_tokens(x: torch.Tensor, cut: SequenceCut) -> torch.Tensor:
    """The attention output back: [batch, every token, my heads, dim] -> [batch, my tokens, heads, dim]."""
    batch, tokens, heads, dim = x.shape
    share = tokens // cut.size
    chunks = x.reshape(batch, cut.size, share, heads, dim).transpose(0, 1)  # chunk w: worker w's tokens
    got = _all_to_all(chunks, cut)  # chunk w: my tokens of worker w's heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, share, cut.size * heads, dim)


# --------------------------------------------------------------------------- the attention function

# Each model's cut and inner kernel, by the identity of its Hugging Face config: the attention
# function is handed the attention module, whose `config` is the model's (a config compares by
# value and has no hash, so it cannot key a dict itself).
_CUTS: dict[int, tuple[SequenceCut, str]] = {}


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Hugging Face's attention-function contract on this worker's tokens: the inner kernel on
    whole sequences for this worker's heads, between two all-to-alls."""
    cut, kernel = _CUTS[id(module.config)]
    kwargs.pop("position_ids", None)  # this worker's slice; the inner kernels read the mask instead
    query, key, value = (whole_sequence(t, cut) for t in (query, key, value))
    if dropout > 0.0:
        out = _with_unsplit_dropout(module, query, key, value, attention_mask, dropout, scaling, cut, kwargs)
    else:
        out, _ = ALL_ATTENTION_FUNCTIONS[kernel](module, query, key, value, attention_mask, dropout=0.0,
                                                 scaling=scaling, **kwargs)
    return own_tokens(out, cut), None


def _with_unsplit_dropout(module, query, key, value, mask, p: float, scaling, cut: SequenceCut, kwargs) -> torch.Tensor:
    """Attention probabilities as eager attention computes them, times this worker's heads of the
    dropout mask the unsplit run draws: torch's dropout fills a tensor of all heads' probabilities
    with Bernoulli draws in memory order (sdpa's math path and eager alike), so drawing that
    tensor and slicing it gives each token and head the unsplit run's mask."""
    key, value = (repeat_kv(t, query.shape[1] // key.shape[1]) for t in (key, value))
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + _additive(mask, scores)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    batch, heads, tokens, _ = probs.shape
    draws = torch.empty((batch, heads * cut.size, tokens, tokens), dtype=probs.dtype, device=probs.device)
    keep = draws.bernoulli_(1 - p)[:, cut.part * heads:(cut.part + 1) * heads]
    out = torch.matmul(probs * (keep / (1 - p)), value)
    return out.transpose(1, 2).contiguous()


def _additive(mask: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    """The mask as a bias on the scores: sdpa's boolean mask (None: causal) or eager's float one."""
    if mask is not None and mask.dtype != torch.bool:
        return mask[..., :scores.shape[-1]]
    if mask is None:
        tokens = scores.shape[-1]
        mask = torch.ones(tokens, tokens, dtype=torch.bool, device=scores.device).tril()
    return torch.zeros((), dtype=scores.dtype, device=scores.device).masked_fill(~mask, torch.finfo(scores.dtype).min)


for _kernel in KERNELS:
    AttentionInterface.register(PREFIX + _kernel, ulysses_attention)
    AttentionMaskInterface.register(PREFIX + _kernel, ALL_MASK_ATTENTION_FUNCTIONS[_kernel])


def install(model: LayeredModel, cut: SequenceCut) -> None:
    """Route the model's attention through the cut (nothing to do for one worker a sequence)."""
    if cut.size == 1:
        return
    config = model.hf_config
    _check_heads(cut.size, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                 or config.num_attention_heads)
    kernel = config._attn_implementation
    if kernel not in KERNELS:
        raise ConfigError(f"strategy.sequence_parallel runs attention with {' or '.join(KERNELS[:2])}, not "
                          f"{kernel}; set model.attn_implementation=sdpa")
    if getattr(model, "routing", None) is not None:
        raise ConfigError("strategy.sequence_parallel does not take mixtures of experts yet")
    _check_dropout(config)
    _CUTS[id(config)] = cut, kernel
    config._attn_implementation = PREFIX + kernel  # a private field: save_pretrained does not write it


def uninstall(model: LayeredModel) -> None:
    """The model's own attention again."""
    config = model.hf_config
    found = _CUTS.pop(id(config), None)
    if found is not None:
        config._attn_implementation = found[1]


def _check_dropout(config) -> None:
    """Only attention's dropout is drawn as the unsplit run draws it: a type with dropout on the
    residual stream or the embeddings (Phi-3's resid_pdrop, StableLM's hidden_dropout) is refused while that is on."""
    for key in ("resid_pdrop", "embd_pdrop", "residual_dropout", "hidden_dropout"):
        if float(getattr(config, key, 0.0) or 0.0) > 0.0:
            raise ConfigError(f"strategy.sequence_parallel draws attention's dropout as the unsplit run does, not "
                              f"{config.model_type}'s {key}; set model.dropout=0")


# --------------------------------------------------------------------------- a worker's share of a micro-batch


class WholeSequence:
    """One worker a sequence: the micro-batch as it is (what `SequenceSplit` does for S of them)."""

    def whole(self, mb: MicroBatch) -> MicroBatch:
        return mb

    def input_ids(self, mb: MicroBatch) -> torch.Tensor:
        return mb.input_ids

    def context(self, model: LayeredModel, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        return model.context(mb, hidden)

    def scored(self, hidden: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, MicroBatch]:
        return hidden, mb


class SequenceSplit(WholeSequence):
    """This worker's share of a micro-batch under the cut: its tokens, the whole sequence's masks
    and its slice of the positions, and labels that make the objective score exactly its tokens."""

    def __init__(self, cut: SequenceCut):
        self.cut = cut

    def whole(self, mb: MicroBatch) -> MicroBatch:
        """`mb` padded at its end to a length the workers share equally."""
        length = mb.input_ids.shape[1]
        extra = -length % self.cut.size
        return mb if extra == 0 else _padded(mb, extra)

    def input_ids(self, mb: MicroBatch) -> torch.Tensor:
        return mb.input_ids[:, self.cut.tokens(mb.input_ids.shape[1])]

    def context(self, model: LayeredModel, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        """The context of the whole sequence (its masks), per-token inputs sliced to these tokens."""
        batch, share, width = hidden.shape
        stand_in = hidden[:, :1].expand(batch, share * self.cut.size, width)  # no copy: only its shape is read
        return model.token_context(model.context(mb, stand_in), self.cut.tokens(share * self.cut.size))

    def scored(self, hidden: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, MicroBatch]:
        """The causal LM's objective drops the last position's prediction and the first label; one
        zero position after these tokens and one ignored label before theirs make it score every
        token of this worker against the whole sequence's next token."""
        following = torch.cat([mb.labels[:, 1:], torch.full_like(mb.labels[:, :1], IGNORE_INDEX)], dim=1)
        mine = following[:, self.cut.tokens(mb.labels.shape[1])]
        labels = torch.cat([torch.full_like(mine[:, :1], IGNORE_INDEX), mine], dim=1)
        hidden = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], 1, hidden.shape[2])], dim=1)
        return hidden, dataclasses.replace(mb, labels=labels)


def split_for(cut: SequenceCut) -> WholeSequence:
    return WholeSequence() if cut.size == 1 else SequenceSplit(cut)


def cut_sequences(model: LayeredModel, world, layout: Layout) -> WholeSequence:
    """What a strategy that cuts sequences does when it starts (`layout`: its run's): this
    process's sequence group made (by every process, before any other group), the model's
    attention routed through it, and the split its micro-batches pass through (`uninstall` at
    its end). One worker a sequence: the model as it is, and every sequence whole."""
    cut = sequence_cut(world, layout)
    install(model, cut)
    return split_for(cut)


def _padded(mb: MicroBatch, extra: int) -> MicroBatch:
    """`extra` padding tokens at the end of every row: masked out, unlabelled, positions going on."""
    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)], dim=1)

    mask = mb.attention_mask if mb.attention_mask is not None else torch.ones_like(mb.input_ids)
    positions = mb.position_ids
    if positions is not None:
        steps = torch.arange(1, extra + 1, dtype=positions.dtype, device=positions.device)
        positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    return dataclasses.replace(mb, input_ids=pad(mb.input_ids, 0), labels=pad(mb.labels, IGNORE_INDEX),
                               attention_mask=pad(mask, 0), position_ids=positions)
