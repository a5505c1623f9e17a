"""The closed form of sampling's KV cache (`cost.rollout`) against the cache a decoder fills."""

from __future__ import annotations

import torch

from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.rollout import kv_cache_bytes
from relaytrain.models import build_model
from relaytrain.run.compose import compose_config


def test_the_kv_cache_of_a_micro_batchs_sequences_is_the_closed_form():
    """A tiny Llama (grouped-query attention) prefilled with 6 sequences of data.seq_len tokens
    holds exactly the closed form's bytes of keys and values."""
    cfg = compose_config(["model=llama_tiny", "model.num_kv_heads=2", "data.seq_len=16"])
    model = build_model(cfg.model, 0, quiet=True).hf_model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.zeros((6, 16), dtype=torch.long), use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(ModelFacts.of(cfg), sequences=6, tokens=16)
