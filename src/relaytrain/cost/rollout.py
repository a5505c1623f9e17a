"""What sampling an online objective's completions holds (`objective=grpo`), in closed form.

The rollout stage decodes a micro-batch's prompts with all their completions together (b prompts x
G completions, `Objective.rows_per_item`), one token at a time, every block keeping the keys and
values of every token so far: the KV cache. At its longest a sequence is data.seq_len tokens (the
prompt and max_completion_length), so the cache's bytes are bounded by

    2 (keys and values) x blocks x key/value heads x head width x sequences x data.seq_len x bytes,

the bytes being the weights' where they compute (the cache takes the activations' dtype); a
latent attention (DeepSeek-V3's) caches its shared latent and rotary key, kv rank + rope wide,
once for every head, in place of the 2 x key/value heads x head width. The
planner reports it beside a plan's figures: the memory sampling needs where the policy samples,
on top of the weights there.

Sampling's time (`sampling_cost`) joins a plan's step: decoding is a forward of one position per
sequence per token, bound by reading the weights (from device memory, or over the host link when
L2L relays a policy that does not fit) more than by its FLOPs at the batch sizes GRPO samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.profile import DecodeTimes
from relaytrain.models.family import LatentAttention


def kv_cache_bytes(facts: ModelFacts, sequences: int, tokens: int) -> int:
    """Every block's keys and values for `sequences` sequences of `tokens` tokens each (a latent
    attention's shared latent and rotary key, as Hugging Face's DeepSeek-V3 caches them)."""
    s = facts.shape
    return cache_bytes(facts.num_layers, s.num_kv_heads, s.head_dim, s.latent, sequences, tokens,
                       facts.activation_bytes)


def cache_bytes(layers: int, kv_heads: int, head_dim: int, latent: LatentAttention | None, sequences: int,
                tokens: int, value_bytes: int) -> int:
    """The closed form above, from the widths themselves: a token's keys and values in one block,
    2 x key/value heads x head width, or a latent attention's latent and rotary key."""
    width = latent.kv_rank + latent.rope if latent else 2 * kv_heads * head_dim
    return layers * width * sequences * tokens * value_bytes


# -------------------------------------------------------------------------------- time

# Where a policy samples, as the run chooses it (`rollout.on_device`): on the device that holds it
# (a whole-model strategy; any run on a CPU, whose device is the host), a whole copy uploaded to
# the GPU for the batch, or a relay of its blocks once per decoded token (L2L's host-held policy).
WHERE = ("device", "copy", "relay")
COPY_MARGIN = 1.2  # the room `rollout.on_device.choose` wants beside a copy and its cache


@dataclass(frozen=True)
class SamplingCost:
    """A rollout batch's predicted seconds and where they go: every micro-batch's prompt pass
    (prefill), its decoded tokens, and the scoring passes over the finished rows (the sampling
    policy's log-probs for num_iterations > 1, the reference's for beta > 0); a copy's upload."""

    batch_s: float
    where: str
    parts: dict[str, float]

    def per_step(self, num_iterations: int) -> float:
        """A step's share: a rollout batch serves num_iterations steps."""
        return self.batch_s / num_iterations


def weight_bytes(facts: ModelFacts) -> int:
    """What decoding a token reads of the weights, as the device holds them (or a relay uploads
    them): what trains in the compute dtype, a frozen base as kept (a 4-bit one as stored)."""
    return facts.whole(facts.upload_bytes)


def placement(host_held: bool, device_type: str, weights: int, cache: int, free: int | None) -> str:
    """Where the run's policy samples (`WHERE`): a host-held policy beside a GPU is copied where
    it and the cache fit in `free` bytes, else relayed; everything else samples where it is."""
    if not host_held or device_type == "cpu":
        return "device"
    return "copy" if free is not None and (weights + cache) * COPY_MARGIN <= free else "relay"


def sampling_cost(facts: ModelFacts, block_forward_s: float, head_forward_s: float, memory_rate: float,
                  upload_rate: float | None, *, rows: int, microbatches: int, completion_tokens: int,
                  scoring_passes: int, where: str, decode_at: Callable[[int], DecodeTimes | None] | None = None
                  ) -> SamplingCost:
    """One rollout batch of `microbatches` micro-batches of `rows` sequences, each decoding up to
    `completion_tokens` after a prompt of the rest of data.seq_len (the bounds the run holds).

    `block_forward_s` and `head_forward_s`: the profile's forward of one block and of the head
    over `rows` sequences of data.seq_len tokens. A decoded token runs every block and the head
    on one position of each sequence decoding together: the larger of that compute and reading
    the weights once (from device memory at `memory_rate`, a micro-batch at a time; a relay
    streams them from the host at `upload_rate` once for the whole batch), plus reading the cache
    (half full on average). The compute is the profile's decoded token (`decode_at(sequences)`:
    each block's call and the rest of the step, timed with its cache or from the spec, launches
    included, which a forward over data.seq_len pays once and a decoded token every time); a
    profile without one gives a position's share of the forward. The prompt pass and the scoring passes
    are forwards over their tokens; a relay scores the whole batch in one stream of the model a
    pass (`RelayCopy.each_logits`)."""
    seq = facts.seq_len
    prompt = max(seq - completion_tokens, 1)
    forward = facts.num_layers * block_forward_s + head_forward_s  # every block and the head, rows x seq tokens
    weights = weight_bytes(facts)
    relay = where == "relay" and bool(upload_rate)
    streamed = weights / upload_rate if relay else weights / memory_rate
    # A relay decodes the whole batch together (each token streams the model once for all of it);
    # a model on the device, a micro-batch at a time.
    together = microbatches if relay else 1
    groups = microbatches // together
    cache_read = kv_cache_bytes(facts, together * rows, prompt + completion_tokens // 2) / memory_rate
    decoded = decode_at(together * rows) if decode_at is not None else None
    compute = together * forward / seq if decoded is None else facts.num_layers * decoded.block_s + decoded.rest_s
    token = max(compute, streamed) + (0.0 if decoded is not None and decoded.reads_cache else cache_read)
    scoring = scoring_passes * (microbatches * forward + (streamed if relay else 0.0))
    parts = {"prefill": groups * max(together * forward * prompt / seq, streamed),
             "decode": groups * completion_tokens * token, "scoring": scoring}
    if where == "copy" and upload_rate:
        parts["upload"] = weights / upload_rate
    return SamplingCost(sum(parts.values()), where, parts)
