"""The work of one block and of the head: the one count of FLOPs that the spec-sheet profile
times (`profile.from_spec`), the pipelines' balanced layout cuts by (`formulas.part_costs`) and
a run reports its model FLOP/s with (`model_flops_per_token` below).

A part's forward FLOPs are its weight matmuls, 2 per weight per position they are applied to,
and in a block attention's scores and weighted sum. Biases, norms, activations and softmax are
not counted (the usual model-FLOPs convention); neither are the embeddings, a lookup (what
they cost is memory traffic: `formulas.part_costs`, `profile.embed_bytes`).

- a block (`block_forward_flops`), from its widths (`BlockShape`, as its family reports them):
  the query, key, value and output projections and the MLP's 2 or 3 matrices, and attention; a
  mixture of experts counts the experts a token is routed to (and a shared one) and its router,
  never the idle experts (the active parameters; memory and transfers count them all);
- the head (`head_weights`): the weights of every matrix it multiplies by, read off the model's
  own head, tied ones included. So BERT's MLM head counts its transform (h x h) and the
  vocabulary projection; GPT-2's and the decoders' LM heads only the projection (they have no
  transform); a classification head its pooler (BERT: h x h) and its classifier (h x labels).
  An LM head runs on every token, a classification head on one position a sample.

Backward costs twice the forward (the input's and the weights' gradients). What a block keeps
for its backward, from the same widths, is here too (`block_activation_bytes`; the cost models
read it through `cost.formulas`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import OmegaConf
from torch import nn

from relaytrain.models import build_model, family_spec
from relaytrain.models.family import BlockShape
from relaytrain.objectives import objective

BACKWARD_FACTOR = 2  # backward: the input's gradient and the weights', each a forward's worth


@dataclass(frozen=True)
class PartWork:
    """Forward FLOPs of one sample through one block and through the head."""

    block: int
    head: int

    def training_flops_per_token(self, num_layers: int, seq_len: int) -> float:
        """Forward and backward FLOPs of the model's math per token, without recompute: the
        usual "model FLOPs" (recomputation is work a strategy chose, not work the model needs)."""
        return (1 + BACKWARD_FACTOR) * (num_layers * self.block + self.head) / seq_len


def model_work(m, seq_len: int) -> PartWork:
    """The work of one sample of `seq_len` tokens through one block and the head of the model the
    `model` config describes."""
    positions = 1 if objective(m.task).classifies else seq_len
    return PartWork(seq_len * block_forward_flops(block_shape(m), seq_len), 2 * head_weights(m) * positions)


# --------------------------------------------------------------------------- a block


def block_shape(m) -> BlockShape:
    """One block's widths, as the model's family reports them for the `model` keys."""
    return family_spec(m.family).block_shape(m)


def query_width(shape: BlockShape) -> int:
    """Width of the queries: heads x head width (a latent attention's heads are nope + rope wide)."""
    latent = shape.latent
    return shape.num_heads * (latent.nope + latent.rope if latent else shape.head_dim)


def key_value_width(shape: BlockShape) -> int:
    """Width of the keys, and of the values: grouped-query attention has fewer heads for them (a
    latent attention: see `key_width` and `value_width`, which differ)."""
    return shape.num_kv_heads * shape.head_dim


def key_width(shape: BlockShape) -> int:
    """Width of the keys attention scores against: a latent attention expands every head's."""
    return query_width(shape) if shape.latent else key_value_width(shape)


def value_width(shape: BlockShape) -> int:
    """Width of the values, and of what the output projection takes: a latent attention's heads
    are `value` wide; otherwise the keys' heads (the output projection then takes q)."""
    return shape.num_heads * shape.latent.value if shape.latent else key_value_width(shape)


def attention_output_width(shape: BlockShape) -> int:
    """Width of the attention's output (the output projection's input): every query head's value."""
    return shape.num_heads * shape.latent.value if shape.latent else query_width(shape)


def mlp_projections(shape: BlockShape) -> int:
    """Weight matrices of the MLP: up and down, and a gate beside up in a gated MLP (SwiGLU, GeGLU)."""
    return 3 if shape.gated_mlp else 2


def attention_weights(shape: BlockShape) -> int:
    """Weights of one block's attention projections: h x q + 2 h x kv + q x h; a latent
    attention's: the queries' (through the rank-q bottleneck or directly), the shared latent and
    rotary key (h x (kv rank + rope)), its expansion to every head's key and value (kv rank x
    heads x (nope + value)) and the output projection (heads x value x h)."""
    h, latent = shape.hidden, shape.latent
    if latent is None:
        return h * query_width(shape) + 2 * h * key_value_width(shape) + query_width(shape) * h
    queries = (h * latent.q_rank + latent.q_rank * query_width(shape)) if latent.q_rank else h * query_width(shape)
    return (queries + h * (latent.kv_rank + latent.rope) + latent.kv_rank * shape.num_heads * (latent.nope + latent.value)
            + attention_output_width(shape) * h)


def block_matrix_weights(shape: BlockShape) -> int:
    """Weights of one block's attention and MLP matrices: the attention's projections
    (`attention_weights`) and the MLP's 2 or 3 matrices of h x i (what tensor parallelism
    splits; not the norms, biases or a router)."""
    return attention_weights(shape) + mlp_projections(shape) * shape.hidden * shape.intermediate


def expert_weights(shape: BlockShape) -> int:
    """A block's routed experts' matrix weights, all of them (0: a dense block)."""
    return shape.experts * mlp_projections(shape) * shape.hidden * shape.expert_width


def block_matmul_flops(shape: BlockShape) -> int:
    """Forward FLOPs of one block's weight matmuls per token: 2 x its matrices' weights
    (`block_matrix_weights`) and a router's: 24 h^2 for BERT's and GPT-2's (q = kv = h, i = 4 h)."""
    return 2 * (block_matrix_weights(shape) + shape.hidden * shape.router_outputs)


def attention_flops(shape: BlockShape, seq_len: int) -> int:
    """Forward FLOPs of one block's attention per token, scores and their weighted sum over the
    values: 2 s q + 2 s x (every query head's value width), 4 s q where heads are as wide for
    both (every query head scores all s positions, grouped or not; causal masking is not
    subtracted, as in the usual model-FLOPs count)."""
    return 2 * seq_len * (query_width(shape) + attention_output_width(shape))


def block_forward_flops(shape: BlockShape, seq_len: int) -> int:
    """Forward FLOPs of one block per token: its matmuls and its attention."""
    return block_matmul_flops(shape) + attention_flops(shape, seq_len)


def one_block_on_meta(m, **build):
    """The model the `model` section `m` describes with one block, built on the meta device
    (shapes only; no checkpoint read): what the cost models read a part's shapes off. `build`:
    more of `build_model`'s keywords (an adapter, the run's resolved family)."""
    with torch.device("meta"):
        return build_model(m, quiet=True, one_block=True, **build)


# --------------------------------------------------------------------------- the head

_head_weights: dict[str, int] = {}  # the planner asks for the same model many times


def head_weights(m) -> int:
    """Weights of the matrices the head multiplies by (every `nn.Linear` of the model's own head,
    a tied one included), from the model built with one block on the meta device."""
    key = OmegaConf.to_yaml(m) if OmegaConf.is_config(m) else repr(m)
    if key not in _head_weights:
        model = one_block_on_meta(m)
        _head_weights[key] = sum(layer.in_features * layer.out_features for layer in model.head.modules()
                                 if isinstance(layer, nn.Linear))
    return _head_weights[key]


def model_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token of the model the `model` config describes, without recompute:
    forward and backward through every block and the head, as this module counts a part's work
    (the one count the planner's profiles and layouts use too). An estimate from the model's
    shape, the usual "model FLOPs" convention: recomputation is work the strategy chose to do,
    not work the model needs."""
    return model_work(m, seq_len).training_flops_per_token(m.num_layers, seq_len)


# --------------------------------------------------------------------------- memory


def block_activation_values(seq_len: int, shape: BlockShape, fused: bool = False) -> float:
    """Values one block keeps for backward per token (Korthikanti et al., 2022, Table 2, whose
    34 sbh + 5 as^2b bytes at 2 bytes a value are 17 h + 2.5 a s values for q = kv = h, i = 4h):

    - attention: its input (the projections'), the queries (q), keys and values (kv each), the
      output projection's input (q) and a dropout mask (h / 2), and a latent attention's
      bottleneck outputs (its queries', its latent and rotary key); then by kernel: eager keeps the
      scores' softmax and its dropout, 2.5 a s (the s x s probabilities of every head); a fused
      kernel (`fused`: sdpa's flash or memory-efficient one) only its log-sum-exp, a values
      (its dropout mask is drawn again from a seed in the backward). A padding mask adds its
      s x s bias to the fused kernel's inputs; unpadded rows (synthetic data, packed records
      of equal length) have none;
    - the MLP: its input, and a dropout mask (h / 2); plain, the activation's input and output
      (2 i); gated, the gate's and up projection's outputs, the activation's output and its
      product with up, which feeds the down projection (4 i: each product's backward needs
      both factors, and the activation's backward its input);
    - the two norms' inputs (2 h)."""
    h, q, i = shape.hidden, query_width(shape), shape.intermediate
    k, v, out = key_width(shape), value_width(shape), attention_output_width(shape)
    scores = shape.num_heads if fused else 2.5 * shape.num_heads * seq_len
    latent = shape.latent  # its bottlenecks' outputs feed the expansions: kept too
    bottlenecks = latent.q_rank + latent.kv_rank + latent.rope if latent else 0
    attention = h + q + k + v + out + h / 2 + scores + bottlenecks
    mlp = h + (4 if shape.gated_mlp else 2) * i + h / 2
    return attention + mlp + 2 * h


def block_activation_bytes(b: int, seq_len: int, shape: BlockShape, dtype_bytes: int, fused: bool = False,
                           tokens: int | None = None) -> int:
    """Activations one block keeps for backward, for b samples (`block_activation_values`) of
    which a worker holds `tokens` each (None: all seq_len; under sequence parallelism its share,
    attention still spanning seq_len for 1/S of the heads: the same values per token)."""
    return int(dtype_bytes * b * (seq_len if tokens is None else tokens) * block_activation_values(seq_len, shape, fused))
