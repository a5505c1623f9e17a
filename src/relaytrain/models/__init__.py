"""Build a layered model from the `model` config: a fresh one, or `model.pretrained`'s weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
)

from relaytrain.errors import ConfigError
from relaytrain.models.bert import LayeredBert
from relaytrain.models.gpt2 import LayeredGPT2
from relaytrain.models.layered import Block, LayeredModel, MicroBatch

__all__ = ["Block", "LayeredModel", "MicroBatch", "build_model", "hf_config", "count_parameters"]

_AUTO_CLASS = {
    "classification": AutoModelForSequenceClassification,
    "masked_lm": AutoModelForMaskedLM,
    "causal_lm": AutoModelForCausalLM,
}
_LAYERED = {"bert": LayeredBert, "gpt2": LayeredGPT2}


def hf_config(m) -> BertConfig | GPT2Config:
    """The Hugging Face config that the `model` keys describe (no weights)."""
    if m.family == "bert":
        return BertConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_seq_len,
            hidden_dropout_prob=m.dropout,
            attention_probs_dropout_prob=m.dropout,
            num_labels=m.num_labels,
            attn_implementation=m.attn_implementation,
        )
    return GPT2Config(
        vocab_size=m.vocab_size,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_inner=m.intermediate_size,
        n_positions=m.max_seq_len,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        # GPT-2's <|endoftext|> is id 50256; a smaller vocabulary keeps it as its last id.
        bos_token_id=m.vocab_size - 1,
        eos_token_id=m.vocab_size - 1,
        attn_implementation=m.attn_implementation,
    )


def build_model(m, seed: int = 0) -> LayeredModel:
    """A layered model on the CPU in fp32; strategies move what they need to the device."""
    torch.manual_seed(seed)
    auto = _AUTO_CLASS[m.task]
    if m.pretrained:
        hf_model = _load_pretrained(m, auto)
        family = hf_model.config.model_type
        if family not in _LAYERED:
            raise ConfigError(
                f"model.pretrained={m.pretrained} is a {family!r} model; relaytrain has adapters for "
                f"{', '.join(_LAYERED)}"
            )
    else:
        hf_model = auto.from_config(hf_config(m), attn_implementation=m.attn_implementation)
        family = m.family
    hf_model.train()
    return _LAYERED[family](hf_model, m.task)


def _load_pretrained(m, auto):
    local = Path(m.pretrained).expanduser()
    source = str(local) if local.exists() else m.pretrained
    overrides = {"num_labels": m.num_labels} if m.task == "classification" else {}
    try:
        config = AutoConfig.from_pretrained(source, **overrides)
        return auto.from_pretrained(source, config=config, attn_implementation=m.attn_implementation)
    except OSError as err:
        raise ConfigError(
            f"model.pretrained={m.pretrained} could not be loaded ({str(err).splitlines()[0]}); "
            f"give a local Hugging Face model directory, or a hub id while online"
        ) from err


def count_parameters(m) -> int:
    """Parameters of the model the config describes, computed on the meta device (no memory)."""
    with torch.device("meta"):
        hf_model = _AUTO_CLASS[m.task].from_config(hf_config(m))
    unique = {id(p): p.numel() for p in hf_model.parameters()}
    return sum(unique.values())
