"""What sampling an online objective's completions holds (`objective=grpo`), in closed form.

The rollout stage decodes a micro-batch's prompts with all their completions together (b prompts x
G completions, `Objective.rows_per_item`), one token at a time, every block keeping the keys and
values of every token so far: the KV cache. At its longest a sequence is data.seq_len tokens (the
prompt and max_completion_length), so the cache's bytes are bounded by

    2 (keys and values) x blocks x key/value heads x head width x sequences x data.seq_len x bytes,

the bytes being the weights' where they compute (the cache takes the activations' dtype). The
planner reports it beside a plan's figures: the memory sampling needs where the policy samples,
on top of the weights there (a whole-model strategy's device; L2L's host in this version). The
step time and the fit do not count sampling yet (the planner says so).
"""

from __future__ import annotations

from relaytrain.cost.formulas import ModelFacts


def kv_cache_bytes(facts: ModelFacts, sequences: int, tokens: int) -> int:
    """Every block's keys and values for `sequences` sequences of `tokens` tokens each."""
    s = facts.shape
    return cache_bytes(facts.num_layers, s.num_kv_heads, s.head_dim, sequences, tokens, facts.activation_bytes)


def cache_bytes(layers: int, kv_heads: int, head_dim: int, sequences: int, tokens: int, value_bytes: int) -> int:
    """The closed form above, from the widths themselves (keys and values: 2)."""
    return 2 * layers * kv_heads * head_dim * sequences * tokens * value_bytes
