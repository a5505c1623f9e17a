"""The cost models' block for the bias-balanced mixtures (DeepSeek-V3 with its latent attention,
GLM-4.5 with grouped-query attention and a partial rotary slice): the FLOPs `cost.work` counts
are what Hugging Face's own block computes, and the block it scales by the layer count is an
expert layer, not the dense first one.

torch's FlopCounterMode counts a forward's matrix products and attention exactly but not the
routed experts' grouped products, which are counted by hand: each token's top-k experts, three
matrices of h x the expert width each."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from relaytrain.cost.work import attention_flops, attention_weights, block_forward_flops, block_shape
from relaytrain.models import part_parameters
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from tests.checkpoints import tiny_bias_balanced

B, S = 2, 16


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def mixture(request, tmp_path_factory):
    directory = tiny_bias_balanced(tmp_path_factory.mktemp(request.param) / "checkpoint", request.param)
    cfg = resolve(compose_config([f"model.pretrained={directory}", "model.dropout=0.0"]))
    # Eager attention: its products are the FLOPs counter's to count (it passes over sdpa's with grouped heads).
    return cfg.model, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")


def measured_flops(reference, c) -> dict[str, int]:
    """FlopCounterMode's count of one forward of B x S tokens, per module of the last (expert) layer."""
    with FlopCounterMode(display=False) as counter:
        reference(torch.randint(0, c.vocab_size, (B, S)))
    prefix = f"{type(reference).__name__}.model.layers.{c.num_hidden_layers - 1}"
    return {part: sum(counter.get_flop_counts().get(f"{prefix}{part}", {}).values()) for part in ("", ".self_attn")}


def test_the_attention_s_flops_are_hugging_faces(mixture):
    m, reference = mixture
    shape, tokens = block_shape(m), B * S
    assert (shape.latent is not None) == (m.model_type == "deepseek_v3")
    measured = measured_flops(reference, reference.config)
    assert measured[".self_attn"] == tokens * (2 * attention_weights(shape) + attention_flops(shape, S))


def test_the_block_s_flops_are_hugging_faces_with_the_routed_experts_by_hand(mixture):
    m, reference = mixture
    c = reference.config
    shape, tokens = block_shape(m), B * S
    routed = tokens * c.num_experts_per_tok * 2 * 3 * c.hidden_size * c.moe_intermediate_size
    assert measured_flops(reference, c)[""] + routed == tokens * block_forward_flops(shape, S)


def test_the_block_the_cost_models_scale_is_an_expert_layer(mixture):
    m, reference = mixture
    layers = reference.model.layers
    assert reference.config.first_k_dense_replace == 1  # the first layer is dense
    expert_layer = sum(p.numel() for p in layers[-1].parameters())
    assert expert_layer > sum(p.numel() for p in layers[0].parameters())
    assert part_parameters(m)[1] == expert_layer
