"""Decoder-only models of the Llama layout as a layered model: Llama, Qwen2/3, Mistral, Gemma 1/2/3,
Phi-3, Granite, Cohere, OLMo and the other model types proven to compute the same way.

A model type trains only when its whole causal-LM forward is what the layered model computes
(`PROVEN`, each type with its extra steps, proven by tests/models/test_type_survey.py):

    embed_tokens (-> * multiplier, Granite; -> norm, NanoChat) -> layers[0..N) -> norm -> lm_head
        (-> * or / a scalar, Cohere and Granite; -> soft-capping, Gemma 2)

Any other type is refused in one line before anything is built, whatever its shape. A sequence
classifier (a reward model) ends in transformers' `...ForSequenceClassification` head instead:
norm -> score, read at each row's last token before its padding (`decoder_heads.py`).

What Hugging Face's model forward computes once and hands to every layer is computed once per
micro-batch by `shared_context`, in the same way: the rotary cos/sin for the micro-batch's positions
(one pair per layer type where the rotary embedding is per type, as Gemma 3's), and the causal
mask of each layer type, as the model's own code decides it (`layer_types`: full or
sliding-window attention). Each block then picks its own: `block(hidden, ctx)` stays the one
call every strategy makes.

Grouped-query attention and gated MLPs are the layers' own business. Tied input and output
embeddings are one parameter, as GPT-2's are.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from relaytrain.models.decoder_heads import DecoderHead, DecoderScoreHead, scored_tokens
from relaytrain.models.family import BlockShape, Family, register_family, transformers_block_plan
from relaytrain.models.layered import NO_CACHE, Block, LayeredModel, MicroBatch
from relaytrain.models.moe import (
    PROVEN_MOE,
    ROUTER,
    Routing,
    Tallies,
    anchored,
    balanced,
    captured_router,
    expert_count,
    moe_facts,
    moe_sizes,
    router_path,
    run_settings,
    tally_key,
)
from relaytrain.objectives.base import LossTerms, Objective
from relaytrain.objectives.cross_entropy import CausalLM, Classification
from relaytrain.step.evaluation import EvalStats
from relaytrain.utils.errors import ConfigError, first_line

FULL, SLIDING = "full_attention", "sliding_attention"
MASKS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


class DecoderEmbed(nn.Module):
    """The token embeddings, then what the type's forward does to them before the first layer:
    a scalar multiplier (Granite) and a norm (NanoChat's, the final norm's module again)."""

    def __init__(self, embed_tokens: nn.Embedding, multiplier: float | None = None, norm: nn.Module | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens  # Gemma's scales by sqrt(hidden) itself
        self.multiplier, self.norm = multiplier, norm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        return hidden if self.norm is None else self.norm(hidden)


class DecoderBlock(Block):
    """A decoder layer: it takes the mask and the rotary cos/sin of its own layer type (under the
    micro-batch's draw key, as every block: `Block.forward`). A routed layer (mixture of experts)
    records its router's choices in the micro-batch's tally and carries its share of the
    balancing loss in its backward (`models/moe.py`)."""

    layer_type: str = FULL
    router_path: str | None = None  # a routed layer's router module, by name inside the layer

    def forward(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        tally = ctx.get(ROUTER)
        if self.router_path is None or tally is None:
            return super().forward(hidden, ctx)
        with captured_router(self.layer.get_submodule(self.router_path)) as seen:
            out = super().forward(hidden, ctx)
        tally.record(self.index, seen[-1])
        return balanced(out, seen[-1], tally)

    def run_layer(self, hidden: torch.Tensor, ctx: dict):
        return self.layer(hidden, attention_mask=ctx["masks"][self.layer_type],
                          position_embeddings=ctx["rope"][self.layer_type], position_ids=ctx["position_ids"])


def attention_mask(mb: MicroBatch) -> torch.Tensor | None:
    """The padding mask the attention masks are built from: none for packed rows. Transformers
    keeps records packed into a row apart only when it is given no padding mask (it reads the
    records from the positions alone), and a packed row's padding is only ever at its end (the
    row's unused tail, or the tokens sequence parallelism adds so that its workers share a row
    equally), where causal attention keeps every real token from it anyway; the mask still says
    which tokens count for the router's tally."""
    return None if mb.position_ids is not None else mb.attention_mask


class LayeredDecoder(LayeredModel):
    family = "decoder"
    block_class = DecoderBlock
    packs_records = True  # `context` hands packed position ids to the mask builder
    cuts_sequences = True  # `token_context`: the rotary cos/sin and positions are per token

    def __init__(self, hf_model: nn.Module, objective: Objective):
        body, config = hf_model.model, hf_model.config
        steps = PROVEN[config.model_type]
        embed = DecoderEmbed(body.embed_tokens, steps.value(config, "embedding_multiplier"),
                             body.norm if steps.initial_norm else None)
        if objective.classifies:  # transformers' sequence classifier: no scalars on its scores
            head = DecoderScoreHead(body.norm, hf_model.score)
        else:
            head = DecoderHead(body.norm, hf_model.lm_head, steps.value(config, "logit_softcap"),
                               steps.value(config, "logit_multiplier"), steps.value(config, "logit_divisor"))
        super().__init__(hf_model, embed, list(body.layers), head, objective)
        for block, layer_type in zip(self.blocks, layer_types(config), strict=True):
            block.layer_type = layer_type
        # Mixture of experts: the routing the blocks record and the head's balancing term reads;
        # decided while every block is here (a pipeline stage drops some).
        self.routing = Routing.of(hf_model)
        if self.routing is not None and objective.classifies:  # transformers' classifier adds no router term
            self.routing = dataclasses.replace(self.routing, balances=False)
        self._tallies = Tallies()
        self._aux_sums = [0.0, 0]  # the head's aux terms (coef * aux) and micro-batches since `loss_term_sums`
        for block in self.blocks if self.routing is not None else ():
            block.router_path = router_path(block.layer, self.routing.router_class)
        self.rotary = body.rotary_emb  # buffers only: no parameter, nothing to train or save
        # Decided while every part is here: a pipeline stage drops the parts it does not hold.
        lm_head = getattr(hf_model, "lm_head", None)  # a sequence classifier has none
        self._tied = lm_head is not None and lm_head.weight is body.embed_tokens.weight
        self._rope_per_type = "layer_type" in inspect.signature(body.rotary_emb.forward).parameters

    def shared_context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        # Positions 0..s-1 unless records are packed into a row; only then are they handed to the
        # mask, which reads them to keep packed records apart (a read a dry run could not make).
        positions = mb.position_ids
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        used = sorted({block.layer_type for block in self.blocks})
        masks = {kind: MASKS[kind](config=self.hf_config, inputs_embeds=hidden, attention_mask=attention_mask(mb),
                                   position_ids=mb.position_ids, **NO_CACHE) for kind in used}
        if self._rope_per_type:
            rope = {kind: self.rotary(hidden, positions, kind) for kind in used}
        else:
            shared = self.rotary(hidden, positions)
            rope = dict.fromkeys(used, shared)
        ctx = {"masks": masks, "rope": rope, "position_ids": positions}
        if self.routing is not None and self.routing.balances:
            ctx[ROUTER] = self.routing.tally(self.objective.router_mask(mb))
            # Evaluated, where the head is here to take it (a pipeline's last stage holds the head).
            self._tallies.put(tally_key(mb), ctx[ROUTER], hold=not self.training and self.head is not None)
        return ctx

    def token_context(self, ctx: dict, tokens: slice) -> dict:
        rope = {kind: tuple(t[:, tokens] for t in pair) for kind, pair in ctx["rope"].items()}
        return {**ctx, "rope": rope, "position_ids": ctx["position_ids"][:, tokens]}

    def head_loss(self, hidden: torch.Tensor, mb: MicroBatch) -> LossTerms:
        """The objective's loss, plus, for a mixture of experts that balances its routers, the
        micro-batch's aux term `coef * aux` (Hugging Face's `router_aux_loss_coef * aux`), a term
        of the micro-batch as a whole: the minibatch's loss holds their mean (`models/moe.py`)."""
        terms = super().head_loss(self.head_input(hidden, mb), mb)
        tally = self._tallies.get(tally_key(mb)) if self.routing is not None and self.head.training else None
        if tally is None:
            return terms
        aux = anchored(hidden, tally)
        if hidden.device.type != "meta":  # a dry run: no values to report, the same tensors
            self._aux_sums[0] += aux.detach()  # a tensor: read once a step (loss_term_sums), not once a micro-batch
            self._aux_sums[1] += 1
        return dataclasses.replace(terms, per_microbatch=terms.per_microbatch + aux)

    def eval_stats(self, hidden: torch.Tensor, mb: MicroBatch) -> EvalStats:
        """The objective's evaluation sums, with a balancing mixture's router term of the
        micro-batch beside them (not in the loss: the cross-entropy keeps its perplexity)."""
        stats = super().eval_stats(self.head_input(hidden, mb), mb)
        tally = self._tallies.take(tally_key(mb)) if self.routing is not None else None
        if tally is None or hidden.device.type == "meta":
            return stats
        return stats.with_router_aux(float(self.routing.coef * tally.aux()))

    def head_input(self, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """What the head takes: the last block's output, for a sequence classifier only at each
        row's scored token, as transformers scores it (`decoder_heads.py`)."""
        if not self.objective.classifies:
            return hidden
        return scored_tokens(hidden, mb.input_ids, mb.attention_mask, self.hf_config.pad_token_id)

    def row_logps(self, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The rows' log-probs; a mixture's router tally of the micro-batch, held for an
        evaluation's sums, is let go (nothing here reports it)."""
        if self.routing is not None:
            self._tallies.take(tally_key(mb))
        return super().row_logps(hidden, mb)

    def loss_term_sums(self) -> dict[str, tuple[float, int]]:
        """The objective's figures and the router's term (`coef * aux` summed over the micro-batches
        this process ran, and their count)."""
        sums = super().loss_term_sums()
        if self.routing is None or not self.routing.balances:
            return sums
        (total, items), self._aux_sums = self._aux_sums, [0.0, 0]
        return {**sums, "router_aux": (float(total), items)}

    def tied_parameters(self) -> list[tuple[str, str]]:
        if self._tied:
            return [("embed.embed_tokens.weight", "head.lm_head.weight")]
        return []


def layer_types(config) -> list[str]:
    """Each layer's attention, as the model's own forward decides it. A model whose code builds no
    sliding-window mask attends fully whatever its config carries (Llama, Gemma 1, OLMo, Granite
    ignore `sliding_window`); one whose config class declares `layer_types` follows them (Qwen2/3
    derive them from `use_sliding_window` and `max_window_layers`, Gemma 2/3 alternate); the
    others slide every layer when the config has a window (Mistral, Phi-3, Starcoder2)."""
    count = config.num_hidden_layers
    if not _builds_sliding_masks(config):
        return [FULL] * count
    if _takes(config, "layer_types"):
        return list(getattr(config, "layer_types", None) or [FULL] * count)[:count]
    return [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * count


def _builds_sliding_masks(config) -> bool:
    """Whether the causal LM's modelling code has the sliding-window mask builder at all."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    module = sys.modules.get(getattr(model_class, "__module__", ""), None)
    return hasattr(module, create_sliding_window_causal_mask.__name__)


def _takes(config, key: str) -> bool:
    """Whether the config's class has `key` as an argument (not merely an attribute a saved
    config.json carried in)."""
    return key in inspect.signature(type(config).__init__).parameters


# --------------------------------------------------------------------------- the proven types


@dataclass(frozen=True)
class Steps:
    """What a model type's forward does beyond embed_tokens -> layers -> norm -> lm_head: each a
    scalar named by the config attribute that holds it (None: the type has no such step), or the
    final norm applied before the first layer too."""

    embedding_multiplier: str | None = None  # embeddings * scalar (Granite)
    logit_multiplier: str | None = None  # logits * scalar (Cohere's logit_scale)
    logit_divisor: str | None = None  # logits / scalar (Granite's logits_scaling)
    logit_softcap: str | None = None  # tanh(logits / scalar) * scalar (Gemma 2)
    initial_norm: bool = False  # NanoChat

    def value(self, config, step: str) -> float | None:
        attribute = getattr(self, step)
        return None if attribute is None else getattr(config, attribute, None)


LLAMA = Steps()
GEMMA2 = Steps(logit_softcap="final_logit_softcapping")
GRANITE = Steps(embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling")
COHERE = Steps(logit_multiplier="logit_scale")
# The model types whose whole causal-LM forward is what the layered model computes, with their
# extra steps: each is checked against Hugging Face's own loss and gradients, its scalars set
# to values that matter, by tests/models/test_type_survey.py. A type not listed is refused, so
# a transformers release cannot slip in an architecture that computes something else.
PROVEN: dict[str, Steps] = {
    "llama": LLAMA, "mistral": LLAMA, "ministral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "phi3": LLAMA,
    "starcoder2": LLAMA, "gemma": LLAMA, "gemma2": GEMMA2, "gemma3_text": GEMMA2, "vaultgemma": GEMMA2,
    "granite": GRANITE, "granite_swa": GRANITE, "cohere": COHERE, "cohere2": COHERE,
    "hyperclovax": Steps(embedding_multiplier="embedding_multiplier", logit_multiplier="logits_scaling"),
    "nanochat": Steps(logit_softcap="final_logit_softcapping", initial_norm=True),
    "olmo": LLAMA, "olmo2": LLAMA, "olmo3": LLAMA, "stablelm": LLAMA, "helium": LLAMA, "glm": LLAMA, "glm4": LLAMA,
    "seed_oss": LLAMA, "arcee": LLAMA, "apertus": LLAMA, "apertus1p5_text": LLAMA, "smollm3": LLAMA,
    "exaone4": LLAMA, "ernie4_5": LLAMA, "hunyuan_v1_dense": LLAMA, "bitnet": LLAMA, "diffllama": LLAMA,
    "cwm": LLAMA, "jais2": LLAMA, "iquestcoder": LLAMA, "internlm3": LLAMA, "exaone": LLAMA,
    "nemotron": LLAMA, "ministral3": LLAMA,
    **dict.fromkeys(PROVEN_MOE, LLAMA),  # mixtures of experts: Hugging Face's layers, the balancing term in moe.py
}


# --------------------------------------------------------------------------- the family spec


def _hf_config(m):
    """A fresh config of `model.model_type` (llama, qwen3, gemma2, ...) with the `model` keys' sizes."""
    sizes = {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "head_dim": m.head_dim or m.hidden_size // m.num_heads, "intermediate_size": m.intermediate_size,
        "max_position_embeddings": m.max_seq_len, "attn_implementation": m.attn_implementation,
        "num_labels": m.num_labels,  # a sequence classifier's outputs (a reward model's one)
    }
    if m.tie_embeddings is not None:
        sizes["tie_word_embeddings"] = m.tie_embeddings
    if str(m.model_type) not in PROVEN:
        raise ConfigError(f"model.model_type={m.model_type}: {_unproven(m.model_type)}")
    sizes.update(_special_ids_past(str(m.model_type), m.vocab_size))
    sizes.update(moe_sizes(m))
    config = AutoConfig.for_model(str(m.model_type), **sizes)
    config = _with_published_settings(config, m, sizes)
    SPEC.set_dropout(config, m.dropout)
    run_settings(config, m)
    return config


def _special_ids_past(model_type: str, vocab_size: int) -> dict:
    """The architecture's default special ids that a `vocab_size` vocabulary lacks (Phi-3's pad id
    is 32000, OLMo's eos 50279), as None: the embedding's padding row must be one of its rows, and
    transformers warns of an id past the vocabulary when the config is built."""
    defaults = AutoConfig.for_model(model_type)
    return {key: None for key in ("pad_token_id", "bos_token_id", "eos_token_id")
            if isinstance(getattr(defaults, key, None), int) and getattr(defaults, key) >= vocab_size}


def _with_published_settings(config, m, sizes: dict):
    """`config` made again with the window, rotary settings and norm epsilon the `model` keys give
    (None keeps the architecture's own), each refused in one line where the architecture has no
    such setting."""
    extra = {}
    if m.sliding_window is not None:
        extra["sliding_window"] = m.sliding_window
        if _takes(config, "use_sliding_window"):  # Qwen2/3 drop the window unless it is switched on
            extra["use_sliding_window"] = True
    if m.rope_theta is not None or m.rope_scaling is not None:
        extra["rope_parameters"] = _rope_parameters(config, m)
    if m.norm_eps is not None:
        extra[_norm_eps_key(config, m)] = m.norm_eps
    if not extra:
        return config
    try:
        config = AutoConfig.for_model(str(m.model_type), **sizes, **extra)
    except (KeyError, ValueError, TypeError) as err:  # transformers validates the rotary parameters
        raise ConfigError(f"model.rope_theta / model.rope_scaling / model.norm_eps: a {m.model_type} config refuses them "
                          f"({first_line(err)}); give them as the checkpoint's config.json does") from err
    if m.sliding_window is not None and SLIDING not in layer_types(config):
        raise ConfigError(f"model.sliding_window={m.sliding_window}: no layer of a {m.model_type} model with these keys "
                          f"slides (Hugging Face's {m.model_type} attends fully here, whatever the window); drop it")
    return config


def _rope_parameters(config, m) -> dict:
    """The architecture's rotary parameters with `model.rope_theta` and `model.rope_scaling` over them."""
    current = dict(_rope_of(config))
    if any(isinstance(value, dict) for value in current.values()):
        raise ConfigError(f"model.rope_theta / model.rope_scaling: a {m.model_type} model has a rotary embedding per "
                          f"layer type, which these keys do not describe; drop them")
    if m.rope_scaling is not None:
        current = {key: value for key, value in current.items() if key in ("rope_theta", "partial_rotary_factor")}
        current.update(dict(m.rope_scaling))
    if m.rope_theta is not None:
        current["rope_theta"] = float(m.rope_theta)
    return current


def _rope_of(config) -> dict:
    """The config's rotary parameters: `rope_parameters` (transformers 5), else the older
    `rope_theta` and `rope_scaling` attributes."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        return dict(parameters)
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    if getattr(config, "rope_theta", None) is not None:
        legacy["rope_theta"] = config.rope_theta
    return legacy


NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps")


def _norm_eps_key(config, m=None) -> str | None:
    """The config attribute that holds the norms' epsilon (None: the architecture fixes it)."""
    key = next((key for key in NORM_EPS_KEYS if _takes(config, key)), None)
    if key is None and m is not None:
        raise ConfigError(f"model.norm_eps={m.norm_eps}: a {m.model_type} model's norms take no epsilon from its "
                          f"config; drop it")
    return key


def attention_for(config, wanted: str) -> str:
    """`wanted`, or eager where the architecture has no sdpa kernel (Gemma 2 soft-caps its
    attention scores, which sdpa cannot): the same attention, computed without the fused kernel."""
    if wanted != "sdpa":
        return wanted
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def _facts(c) -> dict:
    rope = _rope_of(c)
    per_layer_type = any(isinstance(value, dict) for value in rope.values())  # Gemma 3: not one setting
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    norm_eps = _norm_eps_key(c)
    return {
        "model_type": c.model_type, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "intermediate_size": c.intermediate_size, "max_seq_len": c.max_position_embeddings,
        "dropout": float(getattr(c, "attention_dropout", 0.0) or 0.0),
        "tie_embeddings": bool(c.tie_word_embeddings),
        # The window only where a layer slides: a Llama config that carries one attends fully.
        "sliding_window": getattr(c, "sliding_window", None) if SLIDING in layer_types(c) else None,
        "rope_theta": None if per_layer_type else rope.get("rope_theta"),
        "rope_scaling": None if per_layer_type or scaling.get("rope_type", "default") == "default" else scaling,
        "norm_eps": None if norm_eps is None else getattr(c, norm_eps, None),
        **moe_facts(c),
    }


def _refuses(c) -> str | None:
    """Why a checkpoint's config is not one the layered decoder computes as Hugging Face does
    (None: it is). The model type decides, before anything is built (`PROVEN`); the checks after
    it catch a proven type's config that asks for what the blocks cannot carry."""
    model_type = _attribute(c, "model_type")
    if _attribute(c, "is_encoder_decoder"):
        return "an encoder-decoder model; decoders of the Llama layout are trained"
    experts = expert_count(c)
    if experts and model_type not in PROVEN_MOE:
        return (f"a mixture-of-experts model ({experts} experts a layer) of a type not proven to train as Hugging "
                f"Face computes it; the proven ones: {', '.join(PROVEN_MOE)}")
    if model_type not in PROVEN:
        return _unproven(model_type)
    unknown = sorted(set(layer_types(c)) - set(MASKS))
    if unknown:
        return f"layers of type {', '.join(unknown)}; the blocks take {FULL} and {SLIDING}"
    if getattr(c, "use_bidirectional_attention", False):
        return "bidirectional attention; the blocks are causal"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError):
        return "not a causal LM"
    return None if _is_llama_layout(model) else "not the Llama layout"


def _unproven(model_type) -> str:
    return (f"{model_type} is not among the model types whose forward the decoder family is proven to compute as "
            f"Hugging Face does: {', '.join(sorted(PROVEN))}")


def _attribute(config, key: str):
    """`config.key`, or None where the config has none or will not say (Gemma 4's per-layer
    attributes raise on a global read): refusing must never crash."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - any config's own error is "no such setting" here
        return None


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
    name="decoder", layered=LayeredDecoder, objectives=(CausalLM, Classification), tokenizer="byte_bpe",
    hf_config=_hf_config, facts=_facts, block_shape=BlockShape.decoder, refuses=_refuses, attention=attention_for,
    dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop", "residual_dropout"),
    run_settings=run_settings, rotary_positions=True, tp_plan=transformers_block_plan,
    description="decoders of the Llama layout of a proven model type (Llama, Qwen2/3, Mistral, Gemma, Phi-3, "
                "Granite, Cohere, OLMo, ...; mixtures of experts: Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3, "
                "GLM-4.5, dots.llm1; causal LM, "
                "sequence classification and reward models)",
))
