"""Decoder-only models of the Llama layout as a layered model: Llama, Qwen2/3, Mistral, Gemma 2/3,
Phi-3 and whatever else Hugging Face builds the same way.

The family is recognised by structure, not by name: a causal LM whose body has token embeddings
(`embed_tokens`), a list of decoder layers that take rotary `position_embeddings`, a final norm
and a rotary embedding, under an `lm_head`:

    embed_tokens -> layers[0..N) -> norm -> lm_head (-> soft-capping, Gemma 2)

What Hugging Face's model forward computes once and hands to every layer is computed once per
micro-batch by `shared_context`, in the same way: the rotary cos/sin for the micro-batch's positions
(one pair per layer type where the rotary embedding is per type, as Gemma 3's), and the causal
mask of each layer type the model declares (`layer_types`: full or sliding-window attention;
a model without them slides every layer when it has a `sliding_window`, as Mistral and Phi-3
do). Each block then picks its own: `block(hidden, ctx)` stays the one call every strategy makes.

Grouped-query attention and gated MLPs are the layers' own business. Tied input and output
embeddings are one parameter, as GPT-2's are.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from relaytrain.errors import ConfigError
from relaytrain.models.family import BlockShape, Family, register_family
from relaytrain.models.layered import NO_CACHE, Block, LayeredModel, MicroBatch

FULL, SLIDING = "full_attention", "sliding_attention"
MASKS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
# Config attributes that count a mixture-of-experts layer's experts, in the families that have them.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class DecoderEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens  # Gemma's scales by sqrt(hidden) itself

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderHead(nn.Module):
    """Final norm and LM head, then the logits' soft-capping where the config has one (Gemma 2)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, softcap: float | None):
        super().__init__()
        self.norm, self.lm_head, self.softcap = norm, lm_head, softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class DecoderBlock(Block):
    """A decoder layer: it takes the mask and the rotary cos/sin of its own layer type (under the
    micro-batch's draw key, as every block: `Block.forward`)."""

    layer_type: str = FULL

    def run_layer(self, hidden: torch.Tensor, ctx: dict):
        return self.layer(hidden, attention_mask=ctx["masks"][self.layer_type],
                          position_embeddings=ctx["rope"][self.layer_type], position_ids=ctx["position_ids"])


class LayeredDecoder(LayeredModel):
    family = "decoder"
    block_class = DecoderBlock
    packs_records = True  # `context` hands packed position ids to the mask builder

    def __init__(self, hf_model: nn.Module, task: str):
        body, config = hf_model.model, hf_model.config
        head = DecoderHead(body.norm, hf_model.lm_head, getattr(config, "final_logit_softcapping", None))
        super().__init__(hf_model, DecoderEmbed(body.embed_tokens), list(body.layers), head, task)
        for block, layer_type in zip(self.blocks, layer_types(config), strict=True):
            block.layer_type = layer_type
        self.rotary = body.rotary_emb  # buffers only: no parameter, nothing to train or save
        # Decided while every part is here: a pipeline stage drops the parts it does not hold.
        self._tied = hf_model.lm_head.weight is body.embed_tokens.weight
        self._rope_per_type = "layer_type" in inspect.signature(body.rotary_emb.forward).parameters

    def shared_context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        # Positions 0..s-1 unless records are packed into a row; only then are they handed to the
        # mask, which reads them to keep packed records apart (a read a dry run could not make).
        positions = mb.position_ids
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        used = sorted({block.layer_type for block in self.blocks})
        masks = {kind: MASKS[kind](config=self.hf_config, inputs_embeds=hidden, attention_mask=mb.attention_mask,
                                   position_ids=mb.position_ids, **NO_CACHE) for kind in used}
        if self._rope_per_type:
            rope = {kind: self.rotary(hidden, positions, kind) for kind in used}
        else:
            shared = self.rotary(hidden, positions)
            rope = dict.fromkeys(used, shared)
        return {"masks": masks, "rope": rope, "position_ids": positions}

    # Tokens < n predict token n, as in Hugging Face's causal LM loss.
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)[:, :-1]

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[:, 1:]

    def tied_parameters(self) -> list[tuple[str, str]]:
        if self._tied:
            return [("embed.embed_tokens.weight", "head.lm_head.weight")]
        return []


def layer_types(config) -> list[str]:
    """Each layer's attention, as the model's own forward decides it: the config's `layer_types`,
    else a sliding window on every layer when the config has one (Mistral, Phi-3), else full."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared)[: config.num_hidden_layers]
    sliding = getattr(config, "sliding_window", None) is not None
    return [SLIDING if sliding else FULL] * config.num_hidden_layers


# --------------------------------------------------------------------------- the family spec


def _hf_config(m):
    """A fresh config of `model.model_type` (llama, qwen3, gemma2, ...) with the `model` keys' sizes."""
    sizes = {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "head_dim": m.head_dim or m.hidden_size // m.num_heads, "intermediate_size": m.intermediate_size,
        "max_position_embeddings": m.max_seq_len, "attn_implementation": m.attn_implementation,
    }
    if m.tie_embeddings is not None:
        sizes["tie_word_embeddings"] = m.tie_embeddings
    if m.sliding_window is not None:
        sizes["sliding_window"] = m.sliding_window
    try:
        config = AutoConfig.for_model(str(m.model_type), **sizes)
    except ValueError as err:
        raise ConfigError(f"model.model_type={m.model_type} is not a Hugging Face architecture this transformers "
                          f"knows; use e.g. llama, qwen2, qwen3, mistral, gemma2 or phi3") from err
    # A fresh config keeps its architecture's default special ids (Phi-3's pad id is 32000),
    # which a smaller vocabulary lacks: the embedding's padding row must be one of its rows.
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= m.vocab_size:
            setattr(config, key, None)
    SPEC.set_dropout(config, m.dropout)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # an architecture's default ids (Phi-3 pads
        token = getattr(config, key, None)                        # with 32000) may lie past a small vocabulary
        if isinstance(token, int) and token >= m.vocab_size:
            setattr(config, key, None)
    return config


def attention_for(config, wanted: str) -> str:
    """`wanted`, or eager where the architecture has no sdpa kernel (Gemma 2 soft-caps its
    attention scores, which sdpa cannot): the same attention, computed without the fused kernel."""
    if wanted != "sdpa":
        return wanted
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def _facts(c) -> dict:
    return {
        "model_type": c.model_type, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "intermediate_size": c.intermediate_size, "max_seq_len": c.max_position_embeddings,
        "dropout": float(getattr(c, "attention_dropout", 0.0) or 0.0),
        "tie_embeddings": bool(c.tie_word_embeddings), "sliding_window": getattr(c, "sliding_window", None),
    }


def _block_shape(m) -> BlockShape:
    return BlockShape(m.hidden_size, m.num_heads, m.num_kv_heads or m.num_heads,
                      m.head_dim or m.hidden_size // m.num_heads, m.intermediate_size, gated_mlp=True)


def _refuses(c) -> str | None:
    """Why a checkpoint's config is not of the Llama layout (None: it is)."""
    if getattr(c, "is_encoder_decoder", False):
        return "an encoder-decoder model; decoders of the Llama layout are trained"
    experts = next((getattr(c, key) for key in EXPERT_KEYS if getattr(c, key, 0)), 0)
    if experts:
        return f"a mixture-of-experts model ({experts} experts a layer), which the blocks cannot carry yet"
    unknown = sorted(set(getattr(c, "layer_types", None) or []) - set(MASKS))
    if unknown:
        return f"layers of type {', '.join(unknown)}; the blocks take {FULL} and {SLIDING}"
    if getattr(c, "use_bidirectional_attention", False):
        return "bidirectional attention; the blocks are causal"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "not a causal LM"
    return None if _is_llama_layout(model) else "not the Llama layout"


def _is_llama_layout(model: nn.Module) -> bool:
    body = getattr(model, "model", None)
    if body is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return False
    if not all(isinstance(getattr(body, part, None), nn.Module) for part in ("embed_tokens", "norm", "rotary_emb")):
        return False
    layers = getattr(body, "layers", None)
    return (isinstance(layers, nn.ModuleList) and len(layers) > 0
            and "position_embeddings" in inspect.signature(layers[0].forward).parameters)


SPEC = register_family(Family(
    name="decoder", layered=LayeredDecoder, tasks=("causal_lm",), tokenizer="byte_bpe",
    hf_config=_hf_config, facts=_facts, block_shape=_block_shape, refuses=_refuses, attention=attention_for,
    dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"),
    description="decoders of the Llama layout (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3; causal LM)",
))
