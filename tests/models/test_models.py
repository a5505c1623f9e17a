"""The layered model computes the Hugging Face model's own loss, and keeps its names and ties."""

import pytest
import torch

from relaytrain.models import MicroBatch, build_model, count_parameters
from tests.conftest import tiny_cfg


@pytest.mark.parametrize(
    "family,task", [("bert", "classification"), ("bert", "masked_lm"), ("gpt2", "causal_lm")]
)
def test_layered_loss_and_gradients_equal_hugging_face(family, task):
    cfg = tiny_cfg(family, f"model.task={task}")
    model = build_model(cfg.model, seed=0)
    ids = torch.randint(5, 300, (4, 16))
    labels = torch.randint(0, 2, (4,)) if task == "classification" else ids.clone()
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # padding exercises the attention-mask path
    if task != "classification":
        labels[mask == 0] = -100

    ours = model(MicroBatch(ids, labels, mask))
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.hf_model.named_parameters()}
    model.hf_model.zero_grad()
    theirs = model.hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    theirs.backward()

    torch.testing.assert_close(ours, theirs)
    for name, p in model.hf_model.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, msg=name)


def test_gpt2_keeps_its_embedding_tied_to_the_lm_head():
    model = build_model(tiny_cfg("gpt2").model)
    (embed_name, head_name), = model.tied_parameters()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params[embed_name] is params[head_name]
    assert model.hf_model.lm_head.weight is model.hf_model.transformer.wte.weight


def test_parameters_are_shared_with_the_hugging_face_model_not_copied():
    model = build_model(tiny_cfg("bert").model)
    ours = {id(p) for p in model.parameters()}
    theirs = {id(p) for p in model.hf_model.parameters()}
    assert ours == theirs
    assert model.num_blocks == 3


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_parameter_count_from_config_matches_the_built_model(family):
    cfg = tiny_cfg(family)
    assert count_parameters(cfg.model) == build_model(cfg.model).num_parameters()


def test_bert_large_preset_is_the_l2l_papers_table_1():
    from relaytrain.run.compose import compose_config

    m = compose_config(["model=bert_large"]).model
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads, m.max_seq_len) == (24, 1024, 4096, 16, 512)
