"""Adapters as peft builds them: modules_to_save, LoRA on the embeddings and the head, DoRA and
lora_bias, continued under a strategy equal to a plain peft loop; merging through peft's own
merge on the exact base; and what is refused in one line (tests/models/test_lora.py: plain LoRA).

Each adapter is made for a tiny random Llama by peft itself (`get_peft_model`), every trained
tensor randomised (a continued fine-tune), and saved by peft. The reference is
`PeftModel.from_pretrained(base, DIR, is_trainable=True)` trained by torch's AdamW over its
trainable parameters (decay on matrices, as relaytrain's rule), on relaytrain's minibatches.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder
from tests.models.test_lora import DELAYED, gpt2_checkpoint, lora_cfg
from tests.test_decoders import reference_loop

BLOCK_TARGETS = ["q_proj", "v_proj", "down_proj"]
# feature -> the LoraConfig keys that make it (every one on the Llama layout, untied embeddings).
FEATURES = {
    "modules_to_save": {"target_modules": BLOCK_TARGETS, "modules_to_save": ["lm_head"]},
    "lora_on_head_and_embeddings": {"target_modules": [*BLOCK_TARGETS, "lm_head", "embed_tokens"]},
    "dora": {"target_modules": [*BLOCK_TARGETS, "lm_head"], "use_dora": True},
    "lora_bias": {"target_modules": BLOCK_TARGETS, "lora_bias": True},
    # all but lora_bias at once (DoRA has no LoRA bias): the default suite's representative
    "together": {"target_modules": [*BLOCK_TARGETS, "embed_tokens"], "use_dora": True, "modules_to_save": ["lm_head"]},
}
FAST = {("together", "baseline"), ("together", "l2l")}
# The other strategies' code paths, with every extra at once (slow).
EVERY_OTHER = ("pipe_2bw", "fsdp", "l2l_replicas", "pipe_flush_offload", "l2l_stash_cpu")


def is_trained(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


def peft_adapter(base: Path, directory: Path, **keys) -> Path:
    """A peft adapter for `base` with `keys`, every trained tensor random (non-zero), saved by peft."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **keys))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * (0.2 if "lora_" in name else 0.02))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("llama") / "base", "llama", layers=4)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    made: dict[str, Path] = {}

    def of(feature: str) -> Path:
        if feature not in made:
            made[feature] = peft_adapter(llama, tmp_path_factory.mktemp(feature) / "adapter", **FEATURES[feature])
        return made[feature]

    return of


def trained_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if is_trained(name)}


def peft_loop(base: Path, adapter: Path, cfg, delay: int = 0):
    o = cfg.optim
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter,
                                      is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return model, reference_loop(model, optimizer, cfg, delay)


def load_saved(base: Path, directory: Path) -> torch.nn.Module:
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), directory)


def cells() -> list:
    return [pytest.param(feature, variant, id=f"{feature}-{variant}",
                         marks=() if (feature, variant) in FAST else pytest.mark.slow)
            for feature in FEATURES for variant in ("baseline", "l2l", "pipe_flush", *EVERY_OTHER)
            if variant not in EVERY_OTHER or feature == "together"]


@pytest.mark.parametrize(("feature", "variant"), cells())
def test_a_peft_adapter_with_extras_continues_as_a_plain_peft_loop(feature, variant, llama, adapters, tmp_path):
    adapter = adapters(feature)
    cfg = lora_cfg(llama, adapter, variant)
    results = run(cfg, tmp_path / "run", table=False)
    ours = load_saved(llama, tmp_path / "run" / "model")  # peft loads what was saved
    reference, losses = peft_loop(llama, adapter, cfg, delay=1 if variant in DELAYED else 0)
    start = trained_of(load_saved(llama, adapter))
    mine, theirs = trained_of(ours), trained_of(reference)
    assert mine.keys() == theirs.keys() == start.keys() and mine
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
        assert (p - start[key]).abs().max() > 1e-4, f"{key} did not train"
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(("feature", "precision"), [
    ("together", "fp32"),
    pytest.param("lora_on_head_and_embeddings", "cmp_bf16", marks=pytest.mark.slow),
])
def test_merging_is_peft_merge_and_unload_on_the_exact_base(feature, precision, llama, adapters, tmp_path):
    """Under l2l (its relay casts the base for the device): the merged model is peft's own merge of
    the saved adapter on the base as loaded, to float32 rounding."""
    common = ("strategy=l2l", f"precision={precision}", "train.save_dtype=float32")
    run(lora_cfg(llama, adapters(feature), "l2l", *common, "adapter.merge_on_save=true"), tmp_path / "m", table=False)
    run(lora_cfg(llama, adapters(feature), "l2l", *common), tmp_path / "a", table=False)
    folded = load_saved(llama, tmp_path / "a" / "model").merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m" / "model", dtype=torch.float32).state_dict()
    assert merged.keys() == folded.keys()
    for name, t in merged.items():
        torch.testing.assert_close(t, folded[name], atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_half_precision_relay_leaves_the_fp32_base_bit_for_bit(llama, adapters):
    """precision=cmp_bf16 under l2l: the device computes with a bf16 copy; the base on the host is the loaded one."""
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve
    from relaytrain.placement.world import World
    from relaytrain.strategies import strategy_class
    from tests.test_decoders import minibatches

    cfg = resolve(lora_cfg(llama, adapters("together"), "l2l", "precision=cmp_bf16"))
    model = build_model(cfg.model, adapter=cfg.adapter)
    before = {name: p.detach().clone() for name, p in model.hf_model.named_parameters() if not p.requires_grad}
    strategy = strategy_class("l2l")(model, cfg, World())
    try:
        strategy.start(0)
        strategy.step(minibatches(cfg)[0], lr=1e-3)
    finally:
        strategy.close()
    after = {name: p.detach() for name, p in model.hf_model.named_parameters() if not p.requires_grad}
    assert after.keys() == before.keys()
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in before)


def test_a_run_dropout_is_honoured_when_continuing_and_said_in_one_line(llama, adapters, tmp_path, capsys):
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve

    cfg = resolve(lora_cfg(llama, adapters("modules_to_save"), "baseline", "adapter.dropout=0.25"))
    model = build_model(cfg.model, adapter=cfg.adapter)
    lines = [line for line in capsys.readouterr().out.splitlines() if "lora_dropout" in line]
    assert len(lines) == 1 and "adapter.dropout=0.25" in lines[0]
    assert model.adapter.lora_dropout == 0.25
    assert model.hf_model.model.layers[0].self_attn.q_proj.lora_dropout["default"].p == 0.25


def one_line_refusal(args: list[str], tmp_path, capsys) -> str:
    from relaytrain.commands.cli import main

    capsys.readouterr()
    assert main(["train", *args, "train.steps=1", f"hydra.run.dir={tmp_path}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("args", "message"), [
    (["adapter.r=64"], "adapter.r=64 set, but adapter=none trains every weight in full"),
    (["adapter=lora", "adapter.use_dora=true", "adapter.lora_bias=true"], "DoRA has no LoRA bias"),
    (["adapter=lora", "adapter.lora_bias=true", "adapter.merge_on_save=true"], "has no bias to merge it into"),
])
def test_adapter_keys_that_cannot_be_kept_are_refused_in_one_line(args, message, llama, tmp_path, capsys):
    assert message in one_line_refusal([f"model.pretrained={llama}", *args], tmp_path, capsys)


@pytest.mark.parametrize("override", ["adapter.r=16", "adapter.target_modules=[q_proj]", "adapter.use_dora=true"])
def test_keys_contradicting_a_continued_adapter_are_refused(override, llama, adapters, tmp_path, capsys):
    line = one_line_refusal([f"model.pretrained={llama}", "adapter=lora", f"adapter.pretrained={adapters('lora_bias')}",
                             override], tmp_path, capsys)
    assert f"{override.split('=')[0]}=" in line and "contradicts adapter.pretrained" in line


@pytest.mark.parametrize("keys", [{"modules_to_save": ["lm_head"]}, {"target_modules": ["c_attn", "lm_head"]}])
def test_an_adapter_on_a_tied_head_is_refused(keys, tmp_path, capsys):
    """GPT-2's head is its embedding table: training a copy of it, or adapting it, would untie them."""
    base = gpt2_checkpoint(tmp_path / "gpt2")
    adapter = peft_adapter(base, tmp_path / "adapter", fan_in_fan_out=True, **{"target_modules": ["c_attn"], **keys})
    with pytest.raises(ConfigError, match="tied embeddings"):
        run(lora_cfg(base, adapter, "baseline"), tmp_path / "run", table=False)


def test_the_fingerprint_sees_a_one_row_edit_and_reads_old_checkpoints(llama, adapters, tmp_path):
    from relaytrain.models import build_model
    from relaytrain.models.adapter import same_base
    from relaytrain.models.adapter.fingerprint import sampled_fingerprint
    from relaytrain.models.pretrained import resolve

    edited = tmp_path / "edited"
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    table = model.model.embed_tokens.weight
    sampled_rows = set((torch.arange(64) * (table.numel() - 1) // 63 // table.shape[1]).tolist())
    row = min(set(range(table.shape[0])) - sampled_rows)  # a row none of the older format's 64 values is in
    with torch.no_grad():
        table[row] += 1e-3
    model.save_pretrained(edited)

    def built(base):
        cfg = resolve(lora_cfg(base, adapters("lora_bias"), "baseline"))
        return build_model(cfg.model, adapter=cfg.adapter, quiet=True)

    original, changed = built(llama), built(edited)
    assert original.base_fingerprint != changed.base_fingerprint
    assert sampled_fingerprint(original) == sampled_fingerprint(changed)  # what the older format missed
    assert same_base(sampled_fingerprint(original), original.base_fingerprint)  # an older checkpoint still resumes
    assert not same_base(original.base_fingerprint, changed.base_fingerprint)


def test_an_adapter_over_a_fresh_model_saves_its_base_beside_it(tmp_path, capsys):
    from relaytrain.commands.cli import main

    assert main(["train", "model=llama_tiny", "adapter=lora", "data=chat", "data.path=examples/chat.jsonl",
                 "data.seq_len=32", "train.steps=1", "train.untimed_steps=0", "train.save_model=true",
                 f"hydra.run.dir={tmp_path}"]) == 0
    saved = tmp_path / "model"
    base = AutoModelForCausalLM.from_pretrained(saved / "base", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(copy.deepcopy(base), saved)
    assert any("lora_" in name for name, _ in adapted.named_parameters())
    capsys.readouterr()
    assert main(["generate", f"model.pretrained={saved}", "prompt=Hi", "max_new_tokens=2"]) == 0
    moved = saved.rename(tmp_path / "moved")  # the adapter names its base where it was saved
    assert main(["generate", f"model.pretrained={moved}", "prompt=Hi", "max_new_tokens=2"]) == 0
    shutil.rmtree(moved / "base")
    capsys.readouterr()
    assert main(["generate", f"model.pretrained={moved}", "prompt=Hi"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"whose base {saved / 'base'} does not exist" in line


def test_classification_trains_its_head_in_full_beside_the_adapters_as_peft_seq_cls(tmp_path):
    """model.task=classification with adapter=lora: the classifier in modules_to_save (peft's
    SEQ_CLS), the saved adapter loaded by peft over the base saved beside it, its head trained."""
    from transformers import AutoModelForSequenceClassification

    from relaytrain.run.compose import compose_config

    cfg = compose_config(["model=bert_tiny", "model.task=classification", "adapter=lora", "train.steps=2",
                          "train.untimed_steps=0", "train.save_model=true", "data.seq_len=16", "data.num_samples=64",
                          "strategy.microbatch_size=4", "strategy.num_microbatches=2", "optim.lr=0.01"])
    run(cfg, tmp_path / "run", table=False)
    saved = tmp_path / "run" / "model"
    base = AutoModelForSequenceClassification.from_pretrained(saved / "base", dtype=torch.float32)
    before = base.classifier.weight.detach().clone()
    adapted = PeftModel.from_pretrained(base, saved)
    assert adapted.peft_config["default"].task_type == "SEQ_CLS"
    trained_head = adapted.base_model.model.classifier.modules_to_save["default"].weight
    assert (trained_head - before).abs().max() > 1e-4
