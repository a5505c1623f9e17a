"""The built-in rollout engine: completions sampled from a causal LM with a KV cache, keyed.

Every token is drawn by inverting the cumulative distribution at one uniform number, and each
completion's numbers come from a generator seeded by its key (the run's seed, the rollout batch,
the prompt's place in the batch, the generation's index): torch's global stream is never read.
So the same config draws the same completions whichever strategy holds the weights, in whatever
order or batch the sequences are decoded, as keyed dropout does for masks (docs/design.md). The
distribution is walked in token-id order, not sorted by probability: two strategies' logits
differ by float noise, and in id order that moves each token's interval by noise alone, where a
sort could swap two near-equal tokens and every interval after them.

The logits are processed as Hugging Face's `generate` does for sampling (temperature, then
top-k, then top-p, each keeping at least one token). Sequences are left-padded into one batch
(positions counted from each prompt's first token, as `generate` does) and decoded together,
one forward of the model per token with its cache, until every one has ended or
`max_new_tokens` are drawn.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_MASK64 = (1 << 64) - 1
_SALT = 0x5D588B656C078965  # keeps sampling's keys apart from keyed dropout's under one run seed


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose every output bit depends on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_key(seed: int, batch: int, prompt: int, generation: int) -> int:
    """The seed of one completion's uniform numbers (63 bits: torch's generators take a signed int64)."""
    z = (seed * 0x9E3779B97F4A7C15 + _SALT) & _MASK64
    for value in (batch, prompt, generation):
        z = _mix((z + value * 0x9E3779B97F4A7C15 + 1) & _MASK64)
    return z >> 1


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from the logits (Hugging Face's names)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: no nucleus cut

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from [rows, vocab] (fp32), after temperature, top-k and top-p."""
        x = logits.float() / self.temperature
        if 0 < self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = x.softmax(-1)
        if self.top_p < 1:
            ordered, order = probs.sort(-1, descending=True)
            before = ordered.cumsum(-1) - ordered  # what the likelier tokens already cover
            cut = before >= self.top_p
            cut[..., 0] = False  # at least one token stays
            probs = probs.masked_fill(cut.scatter(-1, order, cut), 0.0)
        return probs

    def draw(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token a row [rows]: the first token, in id order, whose cumulative probability
        exceeds the row's `uniform` share of the total."""
        probs = self.probabilities(logits).double()
        cumulative = probs.cumsum(-1)
        target = (uniform.double() * cumulative[:, -1]).unsqueeze(-1)
        token = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
        return token.clamp(max=probs.shape[-1] - 1)


def uniforms(keys: list[int], length: int) -> torch.Tensor:
    """Each completion's numbers [rows, length] in [0, 1), from its own generator."""
    rows = []
    for key in keys:
        generator = torch.Generator().manual_seed(key)
        rows.append(torch.rand(length, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts as one batch: ids and attention mask left-padded, and each token's position
    in its own prompt (what `generate` passes a decoder for a padded batch)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


@torch.no_grad()
def sample(model: nn.Module, prompts: list[list[int]], keys: list[int], sampling: Sampling, max_new_tokens: int,
           end_ids: set[int], pad_id: int, device: torch.device, autocast=None,
           on_token: Callable[[int], None] | None = None, cache_on_host: bool = False) -> list[list[int]]:
    """Each prompt's completion: the tokens drawn up to and including the first end token, or
    `max_new_tokens` of them (truncated). `keys`: one per prompt (`sample_key`); `autocast`: the
    run's precision context, entered around every forward (None: the weights' own dtype);
    `on_token(t)`: told after each token drawn (progress); `cache_on_host`: the KV cache kept on
    the host, each layer's brought to the GPU as it runs (Hugging Face's offloaded cache; CUDA)."""
    from transformers import DynamicCache

    ids, mask, positions = left_padded(prompts, pad_id, device)
    numbers = uniforms(keys, max_new_tokens)
    cache = DynamicCache(config=getattr(model, "config", None), offloading=cache_on_host)
    ends = torch.tensor(sorted(end_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    drawn: list[torch.Tensor] = []
    step_ids = ids
    cache_key = _cache_argument(model)
    extra = quiet_router(model)
    for t in range(max_new_tokens):
        with autocast if autocast is not None else contextlib.nullcontext():
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{cache_key: cache}, **extra)
        token = sampling.draw(out.logits[:, -1], numbers[:, t].to(device))
        token = torch.where(done, torch.full_like(token, pad_id), token)
        drawn.append(token)
        done |= torch.isin(token, ends)
        if on_token is not None:
            on_token(t + 1)
        if bool(done.all()):
            break
        step_ids = token.unsqueeze(1)
        mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
        positions = positions[:, -1:] + 1
    tokens = torch.stack(drawn, dim=1).cpu()
    return [_up_to_end(row.tolist(), end_ids) for row in tokens]


def _up_to_end(tokens: list[int], end_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[: i + 1]
    return tokens


def quiet_router(model: nn.Module) -> dict:
    """What a mixture's forward is told not to compute: its balancing loss (sampling and scoring
    need the logits alone, and Hugging Face's loss over a cached decode's mask would not fit)."""
    return {"output_router_logits": False} if "output_router_logits" in _forward_parameters(model) else {}


def _forward_parameters(model: nn.Module):
    return inspect.signature(type(model).forward).parameters


def _cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its KV cache by (transformers 5.24 renamed
    `past_key_values` to `cache`, keeping the old name with a warning)."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"
