"""Every causal-LM type this transformers lists, asked of relaytrain's families: a type the decoder
family takes trains what Hugging Face computes (loss and every gradient, its extra scalars set to
values that matter and a sliding window shorter than the sequence wherever the type has one);
any other is refused in one line, never by a crash.

The decision for every type is checked by default (a config and, where the type is proven, a
model on the meta device: cheap). The equality runs a representative slice by default, the rest
of the proven types under `slow`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from relaytrain.models import family_of, family_spec
from relaytrain.models.decoder import PROVEN
from relaytrain.models.moe import BIAS_BALANCED
from relaytrain.objectives import objective
from relaytrain.utils.errors import ConfigError
from tests.models.equality import assert_layered_equals_hf, padded_batch

CAUSAL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
DECODER = family_spec("decoder")
VOCAB = 128
# Sizes every tiny config takes where its class has the attribute: a few layers, 32 wide, small
# mixture-of-experts tables.
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, max_position_embeddings=64, num_experts=4, num_local_experts=4,
            n_routed_experts=4, moe_intermediate_size=16, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
            # mixtures routed by a bias (DeepSeek-V3, GLM-4.5, dots.llm1): groups, a shared expert, a dense
            # first layer; DeepSeek-V3's latent attention, its rotary slice the head width
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
# What one type needs beside TINY: DeepSeek-V3's latent attention has a key and value per query head.
PER_TYPE = {"deepseek_v3": {"num_key_value_heads": 4}}
# The extra steps' scalars at values far from the identity, and a window of 4 tokens switched on
# from the second layer (Qwen2/3: `use_sliding_window`, `max_window_layers`).
EXTRA = dict(embedding_multiplier=12.0, logits_scaling=8.0, logit_scale=0.0625, final_logit_softcapping=3.0,
             sliding_window=4, use_sliding_window=True, max_window_layers=1,
             output_router_logits=True, router_aux_loss_coef=0.5)  # a mixture's balancing loss, a third of its loss
# Types whose heads are not hidden / heads wide cannot take head_dim.
NO_HEAD_DIM = {"phi3"}
# A slice of the proven types covering every kind of step: plain, the window on every layer
# (Mistral), by layer type (Qwen2, Gemma 2/3), each extra scalar and NanoChat's initial norm; a
# mixture of experts with its balancing loss (Qwen3-MoE; Mixtral with a window).
DEFAULT_SLICE = {"llama", "mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "granite", "cohere", "cohere2",
                 "nanochat", "hyperclovax", "stablelm", "qwen3_moe", "mixtral"}
PROVEN_HERE = sorted(set(PROVEN) & set(CONFIG_MAPPING))


def tiny_config(model_type: str):
    """A tiny config of `model_type`, with `EXTRA` where the type has those settings; the type's
    default config where its class refuses one of the tiny sizes (a composite or hybrid config:
    Gemma 4, Mamba 2, Zamba 2, ... whose sizes are per sub-config or per layer)."""
    default = CONFIG_MAPPING[model_type]()
    wanted = {key: value for key, value in {**TINY, **EXTRA}.items() if _has(default, key)}
    if model_type in NO_HEAD_DIM:
        wanted.pop("head_dim", None)
    wanted.update(PER_TYPE.get(model_type, {}))
    try:
        return AutoConfig.for_model(model_type, **wanted)
    except Exception:  # noqa: BLE001 - any of a foreign config's validations
        return default


def _has(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - Gemma 4's per-layer attributes raise on a global read
        return False


@pytest.mark.parametrize("model_type", CAUSAL_TYPES)
def test_every_causal_lm_type_is_taken_or_refused_in_one_line(model_type):
    try:
        config = tiny_config(model_type)
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"{model_type}: even its default config fails its own validation ({type(err).__name__})")
    why = DECODER.refuses(config)
    if model_type in PROVEN:
        assert why is None, f"{model_type} is proven, yet refused: {why}"
        return
    assert isinstance(why, str) and why and "\n" not in why
    try:
        family = family_of(config)
    except ConfigError as err:
        assert "\n" not in str(err) and f"'{model_type}'" in str(err)
    else:  # GPT-2's and BERT's own families take theirs
        assert family.name != DECODER.name and family.refuses(config) is None


def test_the_unproven_refusal_names_what_is_supported():
    config = tiny_config("minicpm3") if "minicpm3" in CONFIG_MAPPING else AutoConfig.for_model("gpt_neox")
    why = DECODER.refuses(config)
    assert "proven" in why and "llama" in why and "granite" in why


def test_every_proven_type_is_a_causal_lm_of_this_transformers_or_absent():
    assert set(PROVEN_HERE) <= set(CAUSAL_TYPES)
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"} <= set(PROVEN_HERE)


def _equality_params():
    for model_type in PROVEN_HERE:
        marks = () if model_type in DEFAULT_SLICE else (pytest.mark.slow,)
        yield pytest.param(model_type, marks=marks, id=model_type)


@pytest.mark.parametrize("model_type", _equality_params())
def test_a_proven_type_trains_what_hugging_face_computes(model_type):
    config = tiny_config(model_type)
    _assert_extra_scalars_set(model_type, config)
    DECODER.set_dropout(config, 0.0)  # a dropout model.dropout does not govern would show here
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=DECODER.attention(config, "sdpa"))
    reference.train()
    model = DECODER.layered(reference, objective("causal_lm"))
    if model_type in BIAS_BALANCED:  # routed by a bias: no loss term, whatever the config carries
        assert not model.routing.balances and model.routing.coef == 0.0, model_type
    else:
        assert model.routing is None or (model.routing.balances and model.routing.coef == 0.5), model_type
    ids, mask, labels = padded_batch(rows=2, length=12, vocab=VOCAB)
    assert_layered_equals_hf(model, reference, ids, mask, labels, what=model_type)


def _assert_extra_scalars_set(model_type: str, config) -> None:
    """Each extra step of the type reads a scalar the survey set away from the identity."""
    steps = PROVEN[model_type]
    for step in ("embedding_multiplier", "logit_multiplier", "logit_divisor", "logit_softcap"):
        attribute = getattr(steps, step)
        if attribute is not None:
            assert getattr(config, attribute) == EXTRA[attribute], f"{model_type}: {attribute} not set"
