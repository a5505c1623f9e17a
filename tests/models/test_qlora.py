"""QLoRA (model.quantize=nf4, adapter=qlora): LoRA over a base whose blocks' linear weights are NF4.

The reference is the plain peft loop of `test_lora` over a checkpoint whose blocks' linear
weights were replaced by their NF4 round trip, made by bitsandbytes itself (quantize_4bit, then
dequantize_4bit): nothing of relaytrain's quantization is on its path. A continued adapter
trained by a strategy over the 4-bit base must equal it to float noise.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from relaytrain.compose import compose_config
from relaytrain.errors import ConfigError
from relaytrain.models.quantize import Layout, NF4Linear, bitsandbytes
from relaytrain.train import run
from tests.checkpoints import tiny_decoder
from tests.models.test_lora import RUN_KEYS, adapters_of, peft_adapter, peft_reference

VARIANTS = {
    "baseline": ["strategy=baseline"],
    "l2l": ["strategy=l2l"],
    "pipe_flush": ["strategy=pipe_flush"],
    "fsdp_replicas": ["strategy=fsdp", "strategy.replicas=2"],
}
FAST = {"baseline", "l2l"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(base checkpoint, a peft adapter made for it, the base with its blocks' linear weights rounded through NF4)."""
    root = tmp_path_factory.mktemp("qlora")
    base = tiny_decoder(root / "base", "llama", layers=4)
    return base, peft_adapter(base, root / "adapter"), nf4_round_trip(base, root / "rounded")


def nf4_round_trip(base: Path, directory: Path, double: bool = False) -> Path:
    """`base` with every linear weight of its blocks replaced by bitsandbytes' NF4 round trip."""
    bnb = bitsandbytes()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." in name and isinstance(module, torch.nn.Linear):
                codes, state = bnb.functional.quantize_4bit(module.weight, blocksize=64, quant_type="nf4",
                                                            compress_statistics=double)
                module.weight.copy_(bnb.functional.dequantize_4bit(codes, state))
    model.save_pretrained(directory)
    return directory


def qlora_cfg(base: Path, adapter: Path, variant: str, *overrides: str):
    return compose_config([f"model.pretrained={base}", f"adapter.pretrained={adapter}", *RUN_KEYS,
                           *VARIANTS[variant], "model.quantize=nf4", *overrides])


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST else pytest.mark.slow) for v in VARIANTS])
def test_a_continued_adapter_over_nf4_equals_a_plain_peft_loop_over_the_round_trip(variant, llama, tmp_path):
    base, adapter, rounded = llama
    cfg = qlora_cfg(base, adapter, variant)
    results = run(cfg, tmp_path / "run", table=False)
    saved = tmp_path / "run" / "model"
    ours = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), saved))
    reference, losses = peft_reference(rounded, adapter, cfg, delay=0)
    theirs = adapters_of(reference)
    assert ours.keys() == theirs.keys() and ours
    for key, p in ours.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{variant} {key}: {m}")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)


def test_the_adapter_loads_over_the_original_base_and_merging_uses_the_original_weights(llama, tmp_path, capsys):
    base, adapter, _ = llama
    keys = ("strategy=l2l", "train.steps=1")
    run(qlora_cfg(base, adapter, "l2l", *keys), tmp_path / "adapter_run", table=False)
    run(qlora_cfg(base, adapter, "l2l", *keys, "adapter.merge_on_save=true"), tmp_path / "merged_run", table=False)
    assert "original" in capsys.readouterr().out  # the merge says which base it merged into
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    folded = PeftModel.from_pretrained(copy.deepcopy(original), tmp_path / "adapter_run" / "model").merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged_run" / "model", dtype=torch.float32)
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(t, folded.state_dict()[name], atol=1e-6, rtol=1e-6)
    norm = next(n for n in original.state_dict() if n.endswith("layers.0.input_layernorm.weight"))
    assert torch.equal(merged.state_dict()[norm], original.state_dict()[norm])


def test_resume_over_an_nf4_base_is_exact(llama, tmp_path):
    from relaytrain import checkpoint

    base, adapter, _ = llama
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0", "train.steps=2", "model.quantize_double=true")
    results = run(qlora_cfg(base, adapter, "l2l", *keys), tmp_path / "run", table=False)
    first = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 1)
    resumed = run(qlora_cfg(base, adapter, "l2l", *keys, f"train.resume={first}"), tmp_path / "resumed", table=False)
    assert resumed["loss"] == results["loss"]


@pytest.mark.parametrize("double", [False, True])
def test_an_nf4_layer_computes_with_bitsandbytes_round_trip(double):
    bnb = bitsandbytes()
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)  # 960 weights: the last block of 64 is partial, a nested block too
    quantized = NF4Linear.of(layer, double)
    codes, state = bnb.functional.quantize_4bit(layer.weight.detach(), blocksize=64, quant_type="nf4",
                                                compress_statistics=double)
    rounded = bnb.functional.dequantize_4bit(codes, state)
    x = torch.randn(3, 40)
    assert torch.equal(quantized.weight, rounded)
    assert torch.equal(quantized(x), torch.nn.functional.linear(x, rounded, layer.bias))
    assert quantized.nf4.dtype == torch.uint8 and not quantized.nf4.requires_grad
    assert quantized.nf4.numel() == Layout((24, 40), double).nbytes


@pytest.mark.parametrize(("keys", "message"), [
    (["adapter=none", "model.quantize=nf4"], "a full fine-tune cannot train nf4 weights"),
    (["adapter=lora", "model.quantize_double=true"], "model.quantize=none"),
])
def test_what_a_quantized_base_cannot_do_is_one_line(keys, message, llama, tmp_path):
    base, _, _ = llama
    cfg = compose_config([f"model.pretrained={base}", *RUN_KEYS[:-2], "train.save_model=false", *keys])
    with pytest.raises(ConfigError, match=message) as err:
        run(cfg, tmp_path / "run", table=False)
    assert "\n" not in str(err.value)


def test_a_fresh_model_is_not_quantized(tmp_path):
    cfg = compose_config(["model=llama_tiny", "adapter=qlora", "train.steps=1"])
    with pytest.raises(ConfigError, match="quantizes the weights of model.pretrained"):
        run(cfg, tmp_path / "run", table=False)


def test_adapter_qlora_is_lora_over_nf4():
    cfg = compose_config(["adapter=qlora"])
    assert str(cfg.adapter.name) == "lora" and str(cfg.model.quantize) == "nf4" and not cfg.model.quantize_double


def test_a_checkpoint_saved_in_4_bits_trains_as_the_one_quantized_at_load(llama, tmp_path):
    """bitsandbytes' own 4-bit checkpoint (transformers' quantization_config): its bytes are used as stored."""
    from transformers import BitsAndBytesConfig

    base, adapter, _ = llama
    stored = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(base, quantization_config=stored).save_pretrained(tmp_path / "q4")
    keys = ("train.steps=2", "train.save_model=false")
    at_load = run(qlora_cfg(base, adapter, "baseline", *keys), tmp_path / "at_load", table=False)
    cfg = compose_config([f"model.pretrained={tmp_path / 'q4'}", f"adapter.pretrained={adapter}", *RUN_KEYS,
                          *VARIANTS["baseline"], *keys])  # model.quantize=nf4 comes from the checkpoint
    assert run(cfg, tmp_path / "saved_4bit", table=False)["loss"] == at_load["loss"]
    merging = compose_config([f"model.pretrained={tmp_path / 'q4'}", f"adapter.pretrained={adapter}", *RUN_KEYS,
                              "adapter.merge_on_save=true"])
    with pytest.raises(ConfigError, match="no original to merge into"):
        run(merging, tmp_path / "merged", table=False)
