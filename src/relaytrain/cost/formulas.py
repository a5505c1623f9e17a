"""What every strategy's cost model is made of: the candidate (`Shape`, `cost.shape`'s), the
model's sizes (`ModelFacts`, a worker's share of them under a placement), the prediction (`StepCost`), and the formulas more than one strategy uses.

Each strategy composes its own step time and device memory from these pieces
(`Strategy.step_cost`, `Strategy.device_bytes`); nothing here knows a strategy by name. The
shared formulas:

- a flushed pipeline's bubble, (d - 1) / (m + d - 1) of stage time for equal stages;
- one optimizer step over some blocks and the model's ends, from the profiled per-part steps;
- what one block keeps for its backward (Korthikanti et al., 2022, widened to grouped-query
  attention, heads of any width and gated MLPs: `cost.work`'s, beside a block's FLOPs) and what
  an LM head's logits take;
- the work of each part (embeddings, a block, the head) that balanced pipeline stages are cut
  by (`part_costs`), a block's and the head's FLOPs as `cost.work` counts them;
- the host memory a run's workers hold where the device is the host (`cpu_activation_bytes`).

The links' formulas (transfers, messages, collectives) are `relaytrain.cost.links`'s. Every
figure made from them is a prediction. On a CPU (the device is the host) nothing
crosses a host<->device link, and work done "in the background" (an update on the host,
gradient sums over gloo) runs on the same cores as the compute, so it is added, not hidden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from relaytrain.cost.profile import PartTimes, Timings
from relaytrain.cost.quantized import QuantizedPart, quantized_parts
from relaytrain.cost.shape import LOOPS_ALWAYS as LOOPS_ALWAYS  # the cost models import these from here
from relaytrain.cost.shape import Shape as Shape
from relaytrain.cost.shape import powers_of_two_dividing as powers_of_two_dividing
from relaytrain.cost.work import (
    PartWork,
    attention_output_width,
    block_matrix_weights,
    block_shape,
    expert_weights,
    key_width,
    model_work,
    query_width,
    value_width,
)
from relaytrain.cost.work import block_activation_bytes as block_activation_bytes
from relaytrain.cost.work import block_activation_values as block_activation_values
from relaytrain.models import TrainedParts, part_parameters, trained_parts
from relaytrain.models import adapter as adapters
from relaytrain.models.family import BlockShape
from relaytrain.objectives import objective
from relaytrain.objectives.chunked import LOGIT_COPIES, Chunking
from relaytrain.step.metrics import sequences
from relaytrain.step.optim import state_words

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

FP32 = 4


@dataclass(frozen=True)
class ModelFacts:
    """What the cost models need of the configured model and run: sizes, bytes per value."""

    num_layers: int
    hidden: int
    num_heads: int
    seq_len: int
    embed_params: int
    block_params: int
    head_params: int
    weight_bytes: int  # bytes of a weight where it computes (fp32: 4; cross mixed precision: 2)
    activation_bytes: int  # bytes of an activation value (fp32: 4; amp, cmp: 2)
    state_words: float  # fp32 optimizer-state words per parameter (fractional for 8- and 4-bit moments)
    logits_per_sample: int  # values the head's logits hold per sample (an LM: seq x vocabulary)
    shape: BlockShape  # one block's widths: query and key/value heads, head width, MLP width and kind
    work: PartWork  # forward FLOPs of one sample through a block and through the head (`cost.work`)
    # Under adapters (adapter=lora): the (embeddings, block, head) parameters that train, and the
    # host bytes of a frozen base value where a param server keeps it (a bf16 checkpoint: 2).
    trained_parts: TrainedParts | None = None  # None: every parameter trains
    frozen_bytes: int = FP32
    fused_attention: bool = True  # the attention kernel keeps no s x s scores (sdpa); eager keeps them
    loss_chunks: Chunking | None = None  # how the head's loss is cut into chunks of tokens (None: never)
    # model.quantize=nf4: each part's weights held in 4 bits (`cost.quantized`); the part counts
    # above are dense values all the same
    quantized: tuple[QuantizedPart, QuantizedPart, QuantizedPart] | None = None
    sequence_parallel: int = 1  # S: a worker holds 1/S of every sequence's tokens (`cut`)
    tensor_parallel: int = 1  # T: a worker holds 1/T of every block's matrices and heads (`split`)
    expert_parallel: int = 1  # E: a worker holds 1/E of every block's experts (`share_experts`)
    rows_per_item: int = 1  # sequences an item of the data is (`Objective.rows_per_item`): 2 for a preference pair

    @classmethod
    def of(cls, cfg) -> ModelFacts:
        adapter = cfg.adapter if adapters.enabled(cfg.adapter) else None
        embed, block, head = part_parameters(cfg.model, adapter)
        precision, m, goal = str(cfg.precision.name), cfg.model, run_objective(cfg)
        trained = trained_parts(m, adapter) if adapter else None
        quantized = quantized_parts(m, adapter)
        if quantized is not None:  # part_parameters counts a 4-bit weight's storage bytes
            embed, block, head = (n - q.counted + q.values for n, q in zip((embed, block, head), quantized, strict=True))
        half_base = precision.startswith("cmp") or m.checkpoint_dtype in ("bfloat16", "float16")
        return cls(m.num_layers, m.hidden_size, m.num_heads, cfg.data.seq_len, embed, block, head,
                   2 if precision.startswith("cmp") else FP32, FP32 if precision == "fp32" else 2,
                   state_words(cfg.optim), logits_per_sample(goal, cfg.data.seq_len, m.vocab_size), block_shape(m),
                   model_work(m, cfg.data.seq_len), trained,
                   2 if adapter and half_base else FP32, fused_attention(m), loss_chunking(goal, m), quantized=quantized,
                   rows_per_item=goal.rows_per_item)

    def rows(self, b: int) -> int:
        """Sequences a micro-batch of b items runs through the model (`step.metrics.sequences`):
        what every figure below that takes b (its items, strategy.microbatch_size) is sized by."""
        return sequences(b, self.rows_per_item)

    def cut(self, size: int) -> ModelFacts:
        """These facts for a worker of a run that cuts every sequence over `size` workers: its
        tokens (1/S of each sequence, padded up to a share) are what it computes, keeps and
        stashes; attention still spans the whole sequence (for 1/S of the heads)."""
        return self if size == self.sequence_parallel else dataclasses.replace(self, sequence_parallel=size)

    def split(self, size: int) -> ModelFacts:
        """These facts for one of `size` tensor ranks sharing every block (Megatron's column/row
        split): 1/T of each block's matrices (their weights, gradients and optimizer state), of
        its heads and MLP width (so of the activations inside attention and the MLP) and of its
        work (`part_times`, `optimizer_s`); the block's input and output, its norms and biases,
        the embeddings and the head whole on every rank. From whole facts only."""
        if size == self.tensor_parallel:
            return self
        if self.tensor_parallel != 1:
            raise ValueError(f"facts split over {self.tensor_parallel} tensor ranks cannot be split over {size}")
        matrices = block_matrix_weights(self.shape)
        block = self.block_params - matrices + matrices // size
        trained = self.trained_parts
        if trained is not None:  # an adapter's share of the block, as before
            trained = trained._replace(block=trained.block * block // max(self.block_params, 1))
        s = self.shape
        shape = dataclasses.replace(s, num_heads=s.num_heads // size, num_kv_heads=s.num_kv_heads // size,
                                    intermediate=s.intermediate // size)
        return dataclasses.replace(self, block_params=block, trained_parts=trained, shape=shape, tensor_parallel=size)

    def share_experts(self, size: int) -> ModelFacts:
        """These facts for one of `size` workers sharing every block's experts: 1/E of their matrices and
        of what trains of LoRA on them; its work and activations as before (an even routing). From whole facts."""
        if size == self.expert_parallel or not self.shape.experts:
            return self
        experts, trained, quantized = expert_weights(self.shape), self.trained_parts, self.quantized
        if trained is not None:  # LoRA on the experts is cut with them
            cut = trained.block_experts - trained.block_experts // size
            trained = trained._replace(block=trained.block - cut, block_experts=trained.block_experts - cut)
        if quantized is not None and quantized[1].values >= experts:  # 4-bit experts: a share's storage
            quantized = (quantized[0], quantized[1].without(experts - experts // size), quantized[2])
        return dataclasses.replace(self, block_params=self.block_params - experts + experts // size,
                                   trained_parts=trained, quantized=quantized, expert_parallel=size)

    @property
    def kept_block_share(self) -> float:
        """The share of a block's parameters a worker keeps: 1, less the other workers' experts."""
        experts = expert_weights(self.shape)
        return self.block_params / max(self.block_params + experts - experts // self.expert_parallel, 1)

    def placed(self, strategy, share_experts: bool = True) -> ModelFacts:
        """These facts for one worker of a run placed as the `strategy` config node says: its share
        of every sequence (`cut`), of every block (`split`) and of its experts (`share_experts`;
        False: all, as FSDP's state counts them); a strategy without a key places nothing that way."""
        placed = self.cut(int(getattr(strategy, "sequence_parallel", 1))).split(int(getattr(strategy, "tensor_parallel", 1)))
        return placed.share_experts(int(getattr(strategy, "expert_parallel", 1))) if share_experts else placed

    @property
    def tokens(self) -> int:
        """Tokens of a sequence one worker holds: all of them, or its share under the cut."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def params(self) -> int:
        return self.embed_params + self.num_layers * self.block_params + self.head_params

    @property
    def trained_params(self) -> int:
        """Parameters that train: they alone have gradients, optimizer state and masters."""
        t = self.trained_parts
        return self.params if t is None else t.embed + self.num_layers * t.block + t.head

    def built_bytes(self, compact_base: bool) -> int:
        """The model as built on the host: fp32, but an adapter's frozen base in `frozen_bytes` a
        value where the strategy keeps it compact (`Strategy.compact_base`), and 4-bit weights in
        their storage's bytes."""
        return self.trained_params * FP32 + self.whole(
            lambda part: self.frozen_part_bytes(part, self.frozen_bytes if compact_base else FP32))

    def built_part_bytes(self, part: int) -> int:
        """A part as built where nothing keeps it compact (fp32, 4-bit weights as stored): what a
        pass that streams the model as built (`cost.reference`) moves and holds of it."""
        return self._part(part)[1] * FP32 + self.frozen_part_bytes(part, FP32)

    def build_peak_bytes(self, compact_base: bool) -> int:
        """The most the host holds while it builds the model: the model as built, but a 4-bit base
        under a strategy that does not keep its base compact is first read as fp32 masters (every
        value at 4 bytes, `models.build_model`) and quantized after, so its peak is the fp32 model."""
        return self.built_bytes(compact_base) if compact_base or self.quantized is None else self.params * FP32

    # ---- what each part weighs (embed, block, head: 0, 1, 2), 4-bit weights at their bytes

    def whole(self, of_part) -> int:
        """A per-part figure summed over the model: the embeddings, every block, the head."""
        return of_part(0) + self.num_layers * of_part(1) + of_part(2)

    def _part(self, part: int) -> tuple[int, int, QuantizedPart]:
        """(parameters, trained parameters, quantized weights) of part `part`."""
        params = (self.embed_params, self.block_params, self.head_params)[part]
        trained = params if self.trained_parts is None else self.trained_parts[part]
        return params, trained, QuantizedPart() if self.quantized is None else self.quantized[part]

    def frozen_part_bytes(self, part: int, value_bytes: int) -> int:
        """A part's frozen base: `value_bytes` a floating value, its 4-bit weights as stored."""
        params, trained, quantized = self._part(part)
        return (params - trained - quantized.values) * value_bytes + quantized.nbytes

    def upload_bytes(self, part: int) -> int:
        """What crosses to the device for a part: what trains in the compute dtype, the frozen base
        as the host keeps it (`frozen_bytes`; 4 bits as stored, dequantized on the device)."""
        return self.trained_part_bytes(part) + self.frozen_part_bytes(part, self.frozen_bytes)

    def trained_part_bytes(self, part: int) -> int:
        """What trains in a part, in the compute dtype (its weights on the device, or their gradients)."""
        return self._part(part)[1] * self.weight_bytes

    def device_part_bytes(self, part: int) -> int:
        """A part's weights on the device: every floating value in the compute dtype (a half-stored
        base is cast there), 4-bit weights as stored."""
        params, _, quantized = self._part(part)
        return (params - quantized.values) * self.weight_bytes + quantized.nbytes

    @property
    def frozen_host_bytes(self) -> int:
        """The whole frozen base as a param server keeps it on the host."""
        return self.whole(lambda part: self.frozen_part_bytes(part, self.frozen_bytes))

    @property
    def frozen_device_value_bytes(self) -> float:
        """Bytes a frozen value takes on a device that holds the base as built (fp32, 4-bit weights
        as stored): 4 but under model.quantize=nf4."""
        frozen = self.params - self.trained_params
        return self.whole(lambda part: self.frozen_part_bytes(part, FP32)) / frozen if frozen else float(FP32)

    @property
    def hidden_value_bytes(self) -> int:
        """A value of the hidden state between blocks: the weights' dtype (under amp_* autocast
        leaves the residual adds and norms in fp32; under cmp_* all is half)."""
        return self.weight_bytes

    def part_times(self, t: Timings, part: str, b: int) -> PartTimes:
        """The profiled times of `part` ("block", "embed", "head") on a micro-batch of `b` items
        (the profile times sequences: `rows(b)` of them). Under adapters its backward skips the
        frozen weights' gradients: about half of a backward is the weight gradients, kept in the
        share of the part that trains."""
        times = self._worker_part(t, part, self.rows(b))
        if self.trained_parts is None:
            return times
        total = {"embed": self.embed_params, "block": self.block_params, "head": self.head_params}[part]
        trained = self.trained_parts[("embed", "block", "head").index(part)]
        return PartTimes(times.forward_s, times.backward_s * (0.5 + 0.5 * trained / max(total, 1)))

    def _worker_part(self, t: Timings, part: str, b: int) -> PartTimes:
        """A part's profiled times for b sequences, or for a cut worker's 1/S of each: the work
        of b/S whole ones (as many tokens through its matmuls, and attention over whole sequences
        for 1/S of the heads), timed at that micro-batch. Less than one sequence's tokens (b < S)
        cost their share of one whole sequence's time: no profile times a fraction of one, and a
        device they fill less well would only be slower. A tensor rank's block is the same: 1/T
        of the block's FLOPs in matmuls 1/T as wide, timed as the whole block on b/T sequences
        (a device fills no better for the split; the norms it repeats are not counted)."""
        spread = self.sequence_parallel * (self.tensor_parallel if part == "block" else 1)
        whole = max(b // spread, 1)
        return t.part(part, whole).scaled(b / spread / whole)

    @property
    def trained_share(self) -> float:
        return self.trained_params / max(self.params, 1)

    def boundary_bytes(self, b: int) -> int:
        """A block's input (or output) for b items: what a stash entry holds and a stage sends."""
        return self.rows(b) * self.tokens * self.hidden * self.hidden_value_bytes

    def block_activation_bytes(self, b: int) -> int:
        """What one block keeps for its backward for b items (`block_activation_bytes`)."""
        return block_activation_bytes(self.rows(b), self.seq_len, self.shape, self.activation_bytes,
                                      self.fused_attention, self.tokens)

    def head_activation_bytes(self, b: int) -> int:
        """The head and its loss at their peak for b items: the whole sequence's logits, or one
        chunk's with the head's input and a second gradient of its trained weights."""
        vocab = self.logits_per_sample // self.seq_len
        trained_head = vocab * self.hidden if self.trained_parts is None else self.trained_parts[2]  # the LM head's weight
        # A cut worker scores its own tokens: one position more than them, as `SequenceSplit.scored` pads.
        positions = self.seq_len if self.sequence_parallel == 1 else self.tokens + 1
        return head_bytes(self.rows(b), positions, vocab * positions, self.loss_chunks,
                          trained_head, self.hidden * self.activation_bytes)

    def attention_exchange_bytes(self, b: int) -> int:
        """What a cut worker's attention all-to-alls carry for b items through one block, one
        way (forward; the backward carries their gradients): its tokens' queries, keys and values,
        then the attention output back, at the activations' bytes."""
        widths = query_width(self.shape) + key_width(self.shape) + value_width(self.shape) + \
            attention_output_width(self.shape)
        return self.rows(b) * self.tokens * widths * self.activation_bytes

    def stage_params(self, blocks: int, embed: bool, head: bool) -> int:
        """Parameters of a stage (or a whole model) holding `blocks` blocks and maybe the ends."""
        return blocks * self.block_params + (self.embed_params if embed else 0) + (self.head_params if head else 0)


@dataclass
class StepCost:
    """A predicted step, in seconds, with where the time goes (the parts may overlap: the
    step is what the model says, the parts explain it)."""

    step_s: float
    parts: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- memory


def fused_attention(m) -> bool:
    """Whether the model's blocks run a fused attention kernel: `model.attn_implementation` where
    the architecture has it (Gemma 2 has no sdpa kernel: eager, `Family.attention`)."""
    from relaytrain.models import hf_config

    return str(hf_config(m)._attn_implementation) != "eager"


def stage_bytes(facts: ModelFacts, b: int, blocks: int, params: int, last: bool, in_flight: int, versions: int,
                recompute: str, stashed_inputs: int | None = None) -> int:
    """MEMORY(.) of PipeDream-2BW §4.2.2 for one stage (the baseline is one stage): `versions`
    copies of its `params` weights, their gradients and optimizer state (under adapters: of the
    share that trains; the frozen base once), and the activations of `in_flight` micro-batches
    of b items (`ModelFacts.rows(b)` sequences): all of them without recompute; with block
    recompute each block's input (`stashed_inputs` of them where a host stash keeps the rest:
    those in transit) plus one block's activations while recomputing, or the head's at the turn;
    with stage recompute the stage's input plus one micro-batch's worth while recomputing."""
    head = facts.head_activation_bytes(b) if last else 0
    per_microbatch = blocks * facts.block_activation_bytes(b) + head
    if recompute == "none":
        activations = in_flight * per_microbatch
    elif recompute == "block":
        inputs = in_flight * blocks if stashed_inputs is None else stashed_inputs
        activations = inputs * facts.boundary_bytes(b) + max(facts.block_activation_bytes(b), head)
    else:
        activations = in_flight * facts.boundary_bytes(b) + per_microbatch
    trained = params * facts.trained_share  # versions, gradients and optimizer state; the frozen rest once
    frozen = (params - trained) * facts.frozen_device_value_bytes
    return int(frozen + trained * FP32 * (versions + 1 + facts.state_words) + activations)


def logits_per_sample(goal: Objective, seq_len: int, vocab_size: int) -> int:
    """Values the head's logits hold per sequence under the objective `goal`: none to speak of
    for classification, seq x vocabulary for a language model."""
    return 0 if goal.classifies else seq_len * vocab_size


def logits_bytes(b: int, values_per_sample: int) -> int:
    return b * values_per_sample * FP32 * LOGIT_COPIES  # logits, their softmax and gradient in fp32


def loss_chunking(goal: Objective, m) -> Chunking | None:
    """How a run of the objective `goal` and the `model` section `m` cuts its head's loss into
    chunks of tokens (`model.loss_chunk_tokens`); None where the objective never does (a
    classifier, masked LM, a per-sequence loss such as DPO's, a loss of the user's own)."""
    if not goal.cuts_head_into_chunks:
        return None
    return Chunking(m.loss_chunk_tokens, m.vocab_size)


def head_bytes(b: int, seq_len: int, logits_per_sample: int, chunking: Chunking | None, trained_head: int,
               input_bytes_per_token: int) -> int:
    """The head and its loss at their peak for b samples of seq_len tokens: the whole sequence's
    logits (three fp32 copies), or, where `chunking` cuts them (`Chunking.tokens`, the run's own
    rule), one chunk's, the head input's gradient (or the input itself, kept for a recompute) and
    a second fp32 gradient of the head's `trained_head` trained weights, the chunks' sum."""
    tokens = b * (seq_len - 1)
    chunk = chunking.tokens(tokens, trained_head) if chunking is not None and logits_per_sample else 0
    if not chunk:
        return logits_bytes(b, logits_per_sample)
    vocab = logits_per_sample // seq_len
    return LOGIT_COPIES * FP32 * chunk * vocab + FP32 * trained_head + tokens * input_bytes_per_token


# --------------------------------------------------------------------------- work per part

BYTE_FLOPS = 8  # FLOPs one byte of memory traffic is worth: roughly a CPU core's flops per byte of bandwidth


@dataclass(frozen=True)
class PartCosts:
    """Work of one micro-batch through each part, forward + backward (+ recompute), in
    FLOP-equivalents: what `strategy.layout=balanced` cuts the blocks by."""

    embed: float
    block: float
    head: float


def part_costs(facts: ModelFacts, b: int, recompute: str = "none") -> PartCosts:
    """Forward + backward work of the embeddings, one block and the head for a micro-batch of
    b samples (T = b x seq tokens), from the model's shapes:

    - a block and the head: their FLOPs as `cost.work` counts them (`facts.work`), forward;
      backward twice that; and an LM head's logits' memory traffic (logits, softmax, gradient:
      `logits_bytes`);
    - the embeddings: no matmul, but backward writes a dense gradient as big as the table
      (zeroed, scattered into, accumulated: three passes) besides the lookups' own traffic.

    Bytes count `BYTE_FLOPS` each. `recompute`: block adds each block's forward again; stage
    adds every part's forward again.

    Analytic, not profiled, on purpose: the split it decides must be the same on every process
    and again when a run resumes (an exact resume compares the checkpoint's blocks per stage),
    and timings differ from process to process and from run to run. b counts items: their
    sequences (`ModelFacts.rows`) are what every part computes."""
    rows = facts.rows(b)
    tokens = rows * facts.seq_len
    block, head = rows * facts.work.block, rows * facts.work.head
    head_bytes = logits_bytes(rows, facts.logits_per_sample)
    embed_bytes = FP32 * (3 * facts.embed_params + 3 * tokens * facts.hidden)
    forward = PartCosts(0.0, float(block), head + BYTE_FLOPS * head_bytes / 3)
    costs = PartCosts(BYTE_FLOPS * embed_bytes, 3.0 * block, 3.0 * head + BYTE_FLOPS * head_bytes)
    if recompute == "block":
        return PartCosts(costs.embed, costs.block + forward.block, costs.head)
    if recompute == "stage":
        return PartCosts(costs.embed, costs.block + forward.block, costs.head + forward.head)
    return costs


# --------------------------------------------------------------------------- time


def fill_and_drain_bubble(stages: int, m: int) -> float:
    """Idle share of a flushed pipeline with uniform stages: (d - 1) / (m + d - 1)."""
    return (stages - 1) / (m + stages - 1)


def both(p: PartTimes) -> float:
    return p.forward_s + p.backward_s


def optimizer_s(t: Timings, facts: ModelFacts, blocks: int, embed: bool, head: bool) -> float:
    """One optimizer step over `blocks` blocks and maybe the embeddings and the head, from the
    profiled steps (one block's, 1/T of it on a tensor rank; the ends' split between them by
    parameters); under adapters only what trains steps."""
    block = t.optimizer_block_s / facts.tensor_parallel * facts.kept_block_share
    if embed and head:
        return (blocks * block + t.optimizer_ends_s) * facts.trained_share
    share = (facts.embed_params if embed else 0) + (facts.head_params if head else 0)
    ends = t.optimizer_ends_s / max(facts.embed_params + facts.head_params, 1) * share
    return (blocks * block + ends) * facts.trained_share


# --------------------------------------------------------------------------- host memory


def worker_tokens(seq_len: int, strategy) -> int:
    """Tokens of a sequence of `seq_len` one worker holds: all of them, or its share (padded up)
    where `strategy.sequence_parallel=S` cuts every sequence over S workers."""
    return -(-seq_len // getattr(strategy, "sequence_parallel", 1))


def run_objective(cfg) -> Objective:
    """The objective a run of `cfg` trains: objective.name (model.task's own unless objective=
    names another, e.g. dpo), which decides the head's logits and the sequences of an item."""
    return objective(cfg.objective.name)


def microbatch_rows(cfg) -> int:
    """Sequences one of `cfg`'s micro-batches runs through the model: strategy.microbatch_size
    items of its objective's rows each (`step.metrics.sequences`), for an estimate made from the
    config alone (`ModelFacts.rows` where the facts are at hand)."""
    return sequences(cfg.strategy.microbatch_size, run_objective(cfg).rows_per_item)


def cpu_activation_bytes(cfg, device_type: str, live_blocks: int, stash_entries: int = 0) -> int:
    """Activations in host memory when the device *is* the host: `live_blocks` blocks' worth of
    one micro-batch, `stash_entries` block inputs, and the logits of an LM head (of a worker's
    tokens where sequences are cut: the head's at most a whole sequence's, an overestimate)."""
    if device_type != "cpu":
        return 0
    m, s, goal = cfg.model, cfg.data.seq_len, run_objective(cfg)
    rows = sequences(cfg.strategy.microbatch_size, goal.rows_per_item)
    tokens = worker_tokens(s, cfg.strategy)
    block = block_activation_bytes(rows, s, block_shape(m), FP32, fused_attention(m), tokens)
    head = head_bytes(rows, s, logits_per_sample(goal, s, m.vocab_size), loss_chunking(goal, m),
                      m.vocab_size * m.hidden_size, m.hidden_size * FP32)
    return block * live_blocks + stash_entries * rows * tokens * m.hidden_size * FP32 + head
