"""Model families: the registry, the decoder family's equality with Hugging Face's own models, and
the checkpoints it refuses in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from relaytrain.commands.cli import main
from relaytrain.models import MicroBatch, build_model, count_parameters, families, family_spec
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import ARCHITECTURES, tiny_decoder
from tests.conformance.references import assert_same_weights, hf_reference, hf_saved
from tests.models.equality import assert_layered_equals_hf, padded_batch
from tests.test_decoders import decoder_cfg


def pretrained_cfg(directory, *overrides: str):
    """What `relaytrain train model.pretrained=DIR` runs with: the checkpoint decides the model."""
    given = [f"model.pretrained={directory}", "data.seq_len=16", *overrides]
    return resolve(compose_config(given), given)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    return request.param, tiny_decoder(tmp_path_factory.mktemp(request.param), request.param)


def test_every_family_is_registered_with_what_the_runtime_asks_of_it():
    assert {"bert", "gpt2", "decoder"} <= set(families())
    for spec in families().values():
        assert spec.tasks and spec.tokenizer in ("wordpiece", "byte_bpe") and spec.description


def test_an_unknown_family_is_one_line_naming_the_families(capsys):
    assert main(["train", "model.family=llama"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model.family=llama is not a model family" in line and "decoder" in line


def test_a_checkpoint_alone_decides_the_decoder(checkpoint):
    arch, directory = checkpoint
    m = pretrained_cfg(directory).model
    hf = AutoConfig.from_pretrained(directory)
    assert (m.family, m.model_type, m.task) == ("decoder", arch, "causal_lm")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (3, 32, 4, hf.num_key_value_heads)
    assert m.tie_embeddings == (arch == "gemma2") and m.checkpoint_dtype == "float32"


def test_layered_loss_and_gradients_equal_hugging_face(checkpoint):
    """With padding, and a sequence longer than Mistral's and Gemma 2's sliding window."""
    arch, directory = checkpoint
    model = build_model(pretrained_cfg(directory).model)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation=model.hf_config._attn_implementation)
    assert_layered_equals_hf(model, reference, *padded_batch(), what=arch)


def test_mistral_and_gemma2_layers_slide_as_their_configs_say(tmp_path):
    mistral = build_model(pretrained_cfg(tiny_decoder(tmp_path / "m", "mistral")).model)
    gemma = build_model(pretrained_cfg(tiny_decoder(tmp_path / "g", "gemma2")).model)
    assert [b.layer_type for b in mistral.blocks] == ["sliding_attention"] * 3
    assert [b.layer_type for b in gemma.blocks] == ["sliding_attention", "full_attention", "sliding_attention"]


def trains_what_hugging_face_computes(directory):
    """The layered model of a checkpoint, checked against the checkpoint's own model."""
    model = build_model(pretrained_cfg(directory).model)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation=model.hf_config._attn_implementation)
    assert_layered_equals_hf(model, reference, *padded_batch(), what=str(directory))
    return model


def test_a_llama_checkpoint_carrying_a_window_attends_fully_as_hugging_face_does(tmp_path):
    """Llama's forward ignores `sliding_window`: so do the blocks, and the model keys show none."""
    directory = tiny_decoder(tmp_path, "llama", sliding_window=4)
    assert json.loads((directory / "config.json").read_text())["sliding_window"] == 4
    model = trains_what_hugging_face_computes(directory)
    assert [b.layer_type for b in model.blocks] == ["full_attention"] * 3
    assert pretrained_cfg(directory).model.sliding_window is None


def test_qwen2_slides_the_layers_its_config_switches_on(tmp_path):
    directory = tiny_decoder(tmp_path, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = trains_what_hugging_face_computes(directory)
    assert [b.layer_type for b in model.blocks] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert pretrained_cfg(directory).model.sliding_window == 4


# Checkpoints whose forward is more than embed -> layers -> norm -> head, with their published
# scalars (IBM Granite 3.x; Cohere's Command-R), and a Llama whose config carries a window its
# forward ignores: what the issue found trained on another function than Hugging Face's.
BEYOND_THE_LAYOUT = {
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625},
    "cohere": {"logit_scale": 0.0625},  # and tied embeddings, Cohere's default
    "llama": {"sliding_window": 4},  # shorter than the 16-token rows
}


@pytest.mark.parametrize("variant", ["l2l", pytest.param("pipe_flush", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_type", sorted(BEYOND_THE_LAYOUT))
def test_a_checkpoint_beyond_the_layout_trains_to_a_plain_hugging_face_loops_weights(model_type, variant, tmp_path):
    """The run's saved model equals the checkpoint trained by Hugging Face's own forward and loss
    (tests/conformance/references.py), and its config keeps the scalars that forward reads."""
    settings = BEYOND_THE_LAYOUT[model_type]
    pretrained = tiny_decoder(tmp_path / "checkpoint", model_type, layers=4, **settings)
    cfg = decoder_cfg(pretrained, variant)
    results = run(cfg, tmp_path / "run", table=False)
    reference, losses = hf_reference(pretrained, cfg)
    assert_same_weights(hf_saved(tmp_path / "run"), reference, f"{model_type} under {variant}")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    saved = AutoConfig.from_pretrained(tmp_path / "run" / "model")
    assert {key: getattr(saved, key) for key in settings} == settings


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_window_the_architecture_would_ignore_is_refused(capsys, model_type):
    """Llama never slides; Qwen2 slides only from layer max_window_layers (28) on, past these 4."""
    assert main(["train", "model=llama_tiny", f"model.model_type={model_type}", "model.sliding_window=4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model.sliding_window=4" in line and "drop it" in line


def test_an_unproven_model_type_is_refused_naming_the_proven(capsys):
    assert main(["train", "model=llama_tiny", "model.model_type=minicpm3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "minicpm3 is not among" in line and "llama" in line and "granite" in line


@pytest.mark.parametrize("name,theta,scaling,eps", [
    ("llama3_1b", 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, 1e-5),
    ("llama3_8b", 500000.0, None, 1e-5), ("llama3_70b", 500000.0, None, 1e-5), ("qwen3_8b", 1000000.0, None, 1e-6),
    ("mistral_7b", 10000.0, None, 1e-5), ("gemma2_9b", 10000.0, None, 1e-6)])
def test_a_published_config_builds_its_published_rotary_and_norm(name, theta, scaling, eps):
    from relaytrain.models import hf_config

    config = hf_config(compose_config([f"model={name}"]).model)
    rope = dict(config.rope_parameters)
    assert rope.pop("rope_theta") == theta and config.rms_norm_eps == eps
    assert rope == (scaling or {"rope_type": "default"})


def test_a_checkpoints_rotary_and_norm_settings_become_model_keys(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    directory = tiny_decoder(tmp_path, "llama", rope_theta=500000.0, rope_scaling=dict(scaling),
                             rms_norm_eps=1e-5)  # a copy: transformers adds rope_theta to the dict it is given
    m = pretrained_cfg(directory).model
    assert (m.rope_theta, dict(m.rope_scaling), m.norm_eps) == (500000.0, scaling, 1e-5)
    trains_what_hugging_face_computes(directory)


@pytest.mark.parametrize("override,says", [("model.rope_scaling=5", "must be a mapping with a rope_type"),
                                           ("model.rope_scaling={rope_type:llama3,factor:8.0}", "Missing required keys"),
                                           ("model.norm_eps=1e-5 model.model_type=olmo", "take no epsilon")])
def test_rotary_and_norm_keys_the_architecture_cannot_take_are_one_line(capsys, override, says):
    assert main(["train", "model=llama_tiny", *override.split()]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line


def test_rotary_embeddings_are_computed_once_per_micro_batch(tmp_path):
    model = build_model(pretrained_cfg(tiny_decoder(tmp_path, "llama")).model)
    calls = []
    model.rotary.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(4, 300, (2, 16))
    model(MicroBatch(ids, ids))
    assert len(calls) == 1


def test_tied_embeddings_are_one_parameter(tmp_path):
    model = build_model(pretrained_cfg(tiny_decoder(tmp_path, "gemma2")).model)
    (embed_name, head_name), = model.tied_parameters()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params[embed_name] is params[head_name]
    assert count_parameters(pretrained_cfg(tmp_path).model) == model.num_parameters()


def test_a_bf16_checkpoint_trains_with_fp32_masters(tmp_path):
    directory = tiny_decoder(tmp_path, "qwen3", dtype=torch.bfloat16)
    m = pretrained_cfg(directory).model
    assert m.checkpoint_dtype == "bfloat16"
    assert {p.dtype for p in build_model(m).parameters()} == {torch.float32}


def test_a_fresh_decoder_from_model_keys(tmp_path):
    cfg = compose_config(["model=llama_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                          "model.intermediate_size=64", "model.vocab_size=300", "data.seq_len=16"])
    model = build_model(cfg.model)
    assert model.hf_config.model_type == "llama" and model.hf_config.num_key_value_heads == 2
    assert count_parameters(cfg.model) == model.num_parameters()


# --------------------------------------------------------------------------- refusals


def refused(capsys, directory) -> str:
    capsys.readouterr()  # what making the checkpoint printed
    assert main(["train", f"model.pretrained={directory}", "train.steps=1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("relaytrain: error: ")
    return line


def test_an_encoder_decoder_checkpoint_is_refused_naming_it(tmp_path, capsys):
    config = AutoConfig.for_model("t5", vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(tmp_path)
    line = refused(capsys, tmp_path)
    assert "'t5'" in line and "encoder-decoder" in line and "Llama" in line


# Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GPT-OSS train (tests/models/test_moe.py), DeepSeek-V3, GLM-4.5 and
# dots.llm1 too (tests/models/test_moe_bias_balanced.py); the other mixtures are refused.
@pytest.mark.parametrize("model_type,experts", [("phimoe", {"num_local_experts": 4}),
                                                ("granitemoe", {"num_local_experts": 4})])
def test_a_mixture_of_experts_checkpoint_not_proven_is_refused_naming_it(tmp_path, capsys, model_type, experts):
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32, **experts)
    config.save_pretrained(tmp_path)  # the config alone decides; no weights are read before refusing
    line = refused(capsys, tmp_path)
    assert f"'{model_type}'" in line and "mixture-of-experts" in line and "qwen3_moe" in line


def test_a_checkpoint_with_its_own_code_is_refused_unless_trusted(tmp_path, capsys):
    tiny_decoder(tmp_path, "llama", tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = refused(capsys, tmp_path)
    assert "trust_remote_code" in line and "model.trust_remote_code=true" in line
    assert not (tmp_path / "modeling_mine.py").exists()


def test_the_decoder_family_takes_no_bert_checkpoint():
    from transformers import BertConfig

    assert family_spec("decoder").refuses(BertConfig()) is not None
    assert family_spec("bert").refuses(BertConfig()) is None


def test_a_decoder_dry_run_on_padded_chat_data(tmp_path):
    """Padded micro-batches carry a mask whose values the meta device has not: the dry run
    builds the mask a GPU would instead of asking whether every token is real."""
    from pathlib import Path

    examples = Path(__file__).parents[2] / "examples" / "chat.jsonl"
    assert main(["train", "model=llama_tiny", "model.num_layers=2", "data=chat", f"data.path={examples}",
                 "data.seq_len=64", "train.device=meta", "train.steps=2", "train.untimed_steps=0",
                 f"hydra.run.dir={tmp_path}"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    device = results["memory"]["device"]
    assert device["simulated"] and device["peak_allocated_bytes"] > 0
