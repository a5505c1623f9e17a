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

from relaytrain.cost.formulas import ModelFacts
from relaytrain.models import build_model, hf_config
from relaytrain.models.pretrained import resolve
from relaytrain.models.quantize import Layout, NF4Linear, bitsandbytes, dequantize
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.plan import CHECKPOINT, make_plan
from relaytrain.run.compose import compose, compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.strategies.whole_model_cost import GATHERED_BLOCKS, gathered_bytes
from relaytrain.utils.errors import ConfigError
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
    return qlora_checkpoints(tmp_path_factory.mktemp("qlora"))


def qlora_checkpoints(root: Path) -> tuple[Path, Path, Path]:
    """(base checkpoint, a peft adapter made for it, the base with its blocks' linear weights rounded through NF4)."""
    base = tiny_decoder(root / "base", "llama", layers=4)
    return base, peft_adapter(base, root / "adapter"), nf4_round_trip(base, root / "rounded")


def nf4_round_trip(base: Path, directory: Path, double: bool = False) -> Path:
    """`base` with every linear weight of its blocks, and each expert's matrix of a mixture's fused
    experts, replaced by bitsandbytes' NF4 round trip."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." not in name:
                continue
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(nf4_round_trip_of(module.weight, double))
            for p in module.parameters(recurse=False):
                if p.ndim == 3:  # experts: one matrix at a time
                    p.copy_(torch.stack([nf4_round_trip_of(matrix, double) for matrix in p]))
    model.save_pretrained(directory)
    return directory


def nf4_round_trip_of(matrix: torch.Tensor, double: bool = False) -> torch.Tensor:
    """bitsandbytes' NF4 round trip of `matrix` (quantize_4bit, then dequantize_4bit), made of its
    values in a row: bitsandbytes' CPU kernel misreads a 2-D shape whose rows are not whole blocks
    of 64, as the tiny models' are (`test_an_nf4_weight_decodes_by_the_nf4_table`)."""
    bnb = bitsandbytes()
    codes, state = bnb.functional.quantize_4bit(matrix.detach().reshape(-1).contiguous(), blocksize=64,
                                                quant_type="nf4", compress_statistics=double)
    return bnb.functional.dequantize_4bit(codes, state).view(matrix.shape)


def qlora_cfg(base: Path, adapter: Path, variant: str, *overrides: str):
    return compose_config([f"model.pretrained={base}", f"adapter.pretrained={adapter}", *RUN_KEYS,
                           *VARIANTS[variant], "model.quantize=nf4", *overrides])


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST else pytest.mark.slow) for v in VARIANTS])
def test_a_continued_adapter_over_nf4_equals_a_plain_peft_loop_over_the_round_trip(variant, llama, tmp_path):
    results, losses = continues_the_round_trip(llama, variant, tmp_path / "run")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)


def continues_the_round_trip(checkpoints: tuple[Path, Path, Path], variant: str, run_dir: Path,
                             *overrides: str) -> tuple[dict, list[float]]:
    """The adapter continued over the NF4 base under `variant` (`qlora_checkpoints`' three) equals
    the plain peft loop's over the round trip, to float noise. Returns the results and the loop's losses."""
    base, adapter, rounded = checkpoints
    cfg = qlora_cfg(base, adapter, variant, *overrides)
    results = run(cfg, run_dir, table=False)
    ours = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "model"))
    reference, losses = peft_reference(rounded, adapter, cfg, delay=0)
    theirs = adapters_of(reference)
    assert ours.keys() == theirs.keys() and ours
    for key, p in ours.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{variant} {key}: {m}")
    return results, losses


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
    from relaytrain.records import checkpoint

    base, adapter, _ = llama
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0", "train.steps=2", "model.quantize_double=true")
    results = run(qlora_cfg(base, adapter, "l2l", *keys), tmp_path / "run", table=False)
    first = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 1)
    resumed = run(qlora_cfg(base, adapter, "l2l", *keys, f"train.resume={first}"), tmp_path / "resumed", table=False)
    assert resumed["loss"] == results["loss"]


@pytest.mark.parametrize("double", [False, True])
def test_an_nf4_layer_computes_with_bitsandbytes_round_trip(double):
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)  # 960 weights: the last block of 64 is partial, a nested block too
    quantized = NF4Linear.of(layer, double)
    rounded = nf4_round_trip_of(layer.weight, double)
    x = torch.randn(3, 40)
    assert torch.equal(quantized.weight, rounded)
    assert torch.equal(quantized(x), torch.nn.functional.linear(x, rounded, layer.bias))
    assert quantized.nf4.dtype == torch.uint8 and not quantized.nf4.requires_grad
    assert quantized.nf4.numel() == Layout((24, 40), double).nbytes


@pytest.mark.parametrize("width", [40, 128])
def test_an_nf4_weight_decodes_by_the_nf4_table(width):
    """Each value is its 4-bit code's NF4 value times its block's absmax, blocks of 64 consecutive
    values whatever the width: bitsandbytes' own CPU dequantize of a (24, 40) shape, whose rows are
    not whole blocks, gets blocks after the first wrong (0.50.2), so relaytrain reads the codes in
    rows of one block."""
    bnb = bitsandbytes()
    torch.manual_seed(0)
    weight = torch.randn(24, width)
    codes, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    packed = codes.reshape(-1)
    nibbles = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:weight.numel()].long()
    decoded = state.code[nibbles] * state.absmax.repeat_interleave(64)[:weight.numel()]
    layer = torch.nn.Linear(width, 24)
    with torch.no_grad():
        layer.weight.copy_(weight)
    assert torch.equal(NF4Linear.of(layer, double=False).weight, decoded.view(24, width))


@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16"])
def test_an_nf4_layer_s_gradients_are_f_linear_s_over_its_dequantized_weight_bit_for_bit(precision):
    """What the layer computed before it dequantized again in backward: F.linear over the weight
    dequantized in the input's dtype, autograd's gradients, autocast's casts included."""
    torch.manual_seed(0)
    layer = NF4Linear.of(torch.nn.Linear(40, 24), double=False)
    layer.bias.requires_grad_(True)  # a trained bias (peft's bias="all")
    x = torch.randn(2, 3, 40, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")

    def gradients(forward):
        with autocast:
            y = forward(x)
        (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads = (y.detach(), x.grad.clone(), layer.bias.grad.clone())
        x.grad, layer.bias.grad = None, None
        return grads

    plain = gradients(lambda x: torch.nn.functional.linear(x, dequantize(layer.nf4, layer.layout, x.dtype), layer.bias))
    ours = gradients(layer)
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1])
    torch.testing.assert_close(ours[2], plain[2])  # a sum over the tokens, maybe in another order


def saved_for_backward_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes a forward saves for backward in storages of its own: not the model's parameters."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in parameters:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=input_ids).logits
    del logits
    return sum(saved.values())


def test_backward_keeps_the_4_bit_bytes_not_a_dense_weight_per_layer(llama):
    """The NF4 model's forward saves exactly the activations the same LoRA over the dense base
    saves: the weights it dequantized are gone (each would add its out x in x values)."""

    base, adapter, _ = llama
    input_ids = torch.randint(0, 100, (1, 16))
    saved = {}
    for quantize in ("none", "nf4"):
        given = [f"model.pretrained={base}", f"adapter.pretrained={adapter}", *RUN_KEYS, f"model.quantize={quantize}"]
        cfg = resolve(compose_config(given), given)
        model = build_model(cfg.model, adapter=cfg.adapter, quiet=True)
        assert any(isinstance(m, NF4Linear) for m in model.hf_model.modules()) == (quantize == "nf4")
        saved[quantize] = saved_for_backward_bytes(model.hf_model, input_ids)
    assert saved["nf4"] == saved["none"] > 0


TINY_PLAN = ["+exp=tiny_baseline", "model.dropout=0.0", "model=llama_tiny", "data.seq_len=64", "model.num_layers=2"]


def test_the_dry_run_keeps_the_activations_of_a_lora_over_the_dense_base(tmp_path):
    """What the planner simulates: a QLoRA baseline's device holds the 4-bit base and the very
    activations LoRA over the fp32 base holds (which saves its weights themselves, no copy);
    a dense copy per layer (F.linear over the dequantized weight) would add every block's."""

    hf_config(compose_config(TINY_PLAN).model).save_pretrained(tmp_path)  # planning reads a checkpoint's config only
    kept = {}
    for adapter in ("lora", "qlora"):
        given = [*TINY_PLAN, f"model.pretrained={tmp_path}", f"adapter={adapter}", "precision=fp32"]
        (process,) = simulate(resolve(compose_config(given), given)).per_process
        kept[adapter] = process.by_kind
    assert kept["qlora"]["activations and temporaries"] == kept["lora"]["activations and temporaries"]
    assert kept["qlora"]["weights"] < kept["lora"]["weights"]


def test_fsdp_s_dry_run_shards_and_gathers_a_4_bit_base_at_its_bytes_as_its_closed_form_does(tmp_path):
    """The dry run runs FSDP unsharded and counts its state as FSDP holds it: every weight's 1/R
    (the frozen 4-bit base's too) and the gathered units at their bytes, as the closed form does."""

    hf_config(compose_config(TINY_PLAN).model).save_pretrained(tmp_path)
    given = [*TINY_PLAN, f"model.pretrained={tmp_path}", "adapter=qlora", "strategy=fsdp", "strategy.replicas=2"]
    cfg = resolve(compose_config(given), given)
    process, facts = simulate(cfg).per_process[0], ModelFacts.of(cfg)
    assert process.by_kind["parameters gathered"] == gathered_bytes(cfg, facts)
    assert process.by_kind["weights"] == facts.built_bytes(compact_base=False) // 2  # the frozen base's shard too


@pytest.mark.parametrize("offload", ["none", "host"])
def test_fsdp_s_closed_form_shards_and_gathers_a_4_bit_base_at_its_bytes(offload):
    """FSDP builds the base in fp32 and shards it: each block's linear weights weigh their NF4
    storage in the 1/R shard a worker keeps (on the host with offload) and in the blocks it gathers."""

    keys = ["model=llama_tiny", "model.num_layers=4", "data.seq_len=64", "model.checkpoint_dtype=bfloat16",
            "adapter=lora", "strategy=fsdp", "strategy.replicas=2", f"strategy.offload={offload}"]
    bf16_cfg, nf4_cfg = compose(keys), compose([*keys, "model.quantize=nf4"])
    bf16, nf4 = ModelFacts.of(bf16_cfg), ModelFacts.of(nf4_cfg)
    block = nf4.quantized[1]
    saved = 4 * block.values - block.nbytes  # a block's linear weights: fp32 values against their NF4 bytes
    fsdp = strategy_class("fsdp").cost_model
    shards = nf4.num_layers * saved // 2
    gathered = GATHERED_BLOCKS * saved
    assert fsdp.device_bytes(bf16_cfg, bf16) - fsdp.device_bytes(nf4_cfg, nf4) == \
        gathered + (shards if offload == "none" else 0)
    assert fsdp.host_state_bytes(bf16_cfg, bf16) - fsdp.host_state_bytes(nf4_cfg, nf4) == \
        (shards if offload == "host" else 0)


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


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_named_shape_over_nf4_is_planned_as_its_checkpoint_and_the_command_asks_for_it(tmp_path):
    """`relaytrain plan model=llama3_70b adapter=qlora ...` (no checkpoint): model.quantize
    quantizes a checkpoint, which planning never reads, so the plan is that of a bf16 checkpoint
    of the named shape, and its command names model.pretrained for the user's copy."""

    request = ["model=llama_tiny", "adapter=qlora", "plan.workers=1", "plan.device=rtx4090_24gb", "plan.batch_size=4",
               "plan.strategies=[l2l]"]
    config = hf_config(compose_config(request).model)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    named, given = make_plan(request, max_simulations=1), make_plan([*request, f"model.pretrained={tmp_path}"],
                                                                    max_simulations=1)
    assert named.best.fits and named.best.memory_bytes == given.best.memory_bytes
    assert named.command(named.best) == given.command(given.best).replace(str(tmp_path), CHECKPOINT)


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_qlora_chat_fine_tune_saves_merges_and_generates(tmp_path, capsys):
    """As a new user (the issue's last check): their bf16 checkpoint, the example chat file,
    adapter=qlora under L2L; the adapter over the original base and the merge into it give the
    same greedy answer, and `relaytrain generate` answers from the adapter directory."""
    from relaytrain.commands.cli import main
    from relaytrain.commands.generate import load, new_token_ids, parse_request

    base = tiny_decoder(tmp_path / "base", "llama", dtype=torch.bfloat16)
    common = [f"model.pretrained={base}", "adapter=qlora", "data=chat", "data.path=examples/chat.jsonl",
              "data.seq_len=64", "strategy=l2l", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
              "train.steps=2", "train.untimed_steps=0", "train.save_model=true", "optim.lr=1e-2"]
    assert main(["train", *common, f"hydra.run.dir={tmp_path / 'adapter'}"]) == 0
    assert main(["train", *common, "adapter.merge_on_save=true", f"hydra.run.dir={tmp_path / 'merged'}"]) == 0
    answers = []
    for directory in (tmp_path / "adapter" / "model", tmp_path / "merged" / "model"):
        request = parse_request([f"model.pretrained={directory}", "prompt=What is 2+2?", "max_new_tokens=6"])
        model, tokenizer = load(str(directory))
        answers.append(new_token_ids(request, model, tokenizer).tolist())
    assert answers[0] == answers[1] and len(answers[0]) > 0
    capsys.readouterr()
    assert main(["generate", f"model.pretrained={tmp_path / 'adapter' / 'model'}", "prompt=What is 2+2?",
                 "max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.strip() != ""
