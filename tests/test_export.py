"""`relaytrain export`, and what a run says about the model it saved.

An adapter exported is peft's own `merge_and_unload` of it on its base: the reference is
`PeftModel.from_pretrained(base, adapter).merge_and_unload()`, run here, with nothing of
relaytrain on its path; their logits must be equal. A checkpoint exported is the model the run
itself saved (`train.save_model=true`) from the same weights: every tensor equal. Runs go through
`relaytrain train` (the command), since a checkpoint's model is read from the run's recorded
config (RUN_DIR/.hydra).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relaytrain.commands.cli import main
from relaytrain.models.pretrained import resolve
from relaytrain.records import checkpoint
from relaytrain.records.display import print_results_table
from relaytrain.run.compose import compose_config
from relaytrain.run.resolve import describe_run
from relaytrain.run.results import adapter_facts
from relaytrain.run.train import run
from tests.checkpoints import tiny_bias_balanced, tiny_decoder, tiny_moe
from tests.conformance.references import peft_adapter

STEPS = 2
TRAIN_KEYS = ["data.seq_len=16", "data.num_samples=64", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
              f"train.steps={STEPS}", "train.untimed_steps=0", "train.save_model=true", "optim.lr=1e-2",
              "model.dropout=0.0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("export") / "base", "llama")


def train(run_dir: Path, *overrides: str) -> Path:
    """`relaytrain train ...` as a user types it, into run_dir."""
    assert main(["train", *TRAIN_KEYS, *overrides, f"hydra.run.dir={run_dir}"]) == 0
    return run_dir


def export(capsys, *args: str) -> str:
    """`relaytrain export ARGS` succeeded; its one line."""
    capsys.readouterr()
    assert main(["export", *args]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    return line


def logits(model_dir_or_model, ids: torch.Tensor) -> torch.Tensor:
    model = (AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
             if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model)
    with torch.no_grad():
        return model.eval()(ids).logits


def peft_merged(base: Path, adapter: Path):
    """The reference: peft's own merge of `adapter` on `base` in fp32."""
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     str(adapter)).merge_and_unload()


def same_tensors(a: Path, b: Path) -> None:
    ours, theirs = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


IDS = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- an adapter


def test_an_adapter_exported_gives_the_logits_of_peft_s_merge_and_unload(base, tmp_path, capsys):
    adapter = peft_adapter(base, tmp_path / "adapter")
    line = export(capsys, f"model.pretrained={adapter}", f"out={tmp_path / 'merged'}")
    assert f"merged into its base {base}" in line and "relaytrain generate" in line
    assert torch.equal(logits(tmp_path / "merged", IDS), logits(peft_merged(base, adapter), IDS))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert saved.dtype == torch.float32 and not any("lora" in name for name, _ in saved.named_parameters())
    assert (tmp_path / "merged" / "tokenizer.json").is_file()  # the base's: the adapter has none
    assert not list(tmp_path.glob(".*partial"))


def test_dtype_and_base_are_the_user_s(base, tmp_path, capsys):
    """dtype=bfloat16: peft's merge in fp32, then rounded; base=DIR: an adapter whose base moved."""
    adapter = peft_adapter(base, tmp_path / "adapter")
    moved = shutil.copytree(base, tmp_path / "moved")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/base"}))
    assert main(["export", f"model.pretrained={adapter}", f"out={tmp_path / 'x'}"]) == 2
    assert "base /gone/base does not exist" in capsys.readouterr().err
    export(capsys, f"model.pretrained={adapter}", f"base={moved}", "dtype=bfloat16", f"out={tmp_path / 'half'}")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "half")
    reference = peft_merged(moved, adapter).state_dict()
    assert half.dtype == torch.bfloat16
    for name, t in half.state_dict().items():
        assert torch.equal(t, reference[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_a_lora_run_s_adapter_exported_equals_peft_s_merge_and_answers_alike(base, tmp_path, capsys):
    """As a new user: a LoRA chat fine-tune saves its adapter; the run says where it went, and
    `relaytrain export` of it is peft's merge, which `relaytrain generate` answers with as with the adapter."""
    run_dir = train(tmp_path / "lora", f"model.pretrained={base}", "adapter=lora", "data=chat",
                    "data.path=examples/chat.jsonl", "data.seq_len=64")
    printed = capsys.readouterr().out
    assert f"model saved to {run_dir / 'model'}; try: relaytrain generate model.pretrained={run_dir / 'model'}" in printed
    line = export(capsys, f"model.pretrained={run_dir / 'model'}", f"out={tmp_path / 'merged'}")
    assert "peft's merge_and_unload" in line
    assert torch.equal(logits(tmp_path / "merged", IDS), logits(peft_merged(base, run_dir / "model"), IDS))
    answers = []
    for model in (run_dir / "model", tmp_path / "merged"):
        assert main(["generate", f"model.pretrained={model}", "prompt=What is 2+2?", "max_new_tokens=6"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_a_qlora_adapter_is_merged_into_the_original_weights_and_says_so(base, tmp_path, capsys):
    run_dir = train(tmp_path / "qlora", f"model.pretrained={base}", "adapter=qlora")
    line = export(capsys, f"model.pretrained={run_dir / 'model'}", f"out={tmp_path / 'merged'}")
    assert "original (unquantized) weights" in line and "nf4" in line
    assert torch.equal(logits(tmp_path / "merged", IDS), logits(peft_merged(base, run_dir / "model"), IDS))


# ----------------------------------------------------------------------------- a checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["strategy=baseline"], ["strategy=fsdp", "strategy.replicas=2"]],
                         ids=["baseline", "fsdp_2_workers"])
def test_a_checkpoint_exported_equals_the_model_the_run_saved(base, tmp_path, capsys, monkeypatch, strategy):
    """From another directory than the run's, with model.pretrained recorded relative to where it started."""
    monkeypatch.chdir(base.parent)
    run_dir = train(tmp_path / "run", f"model.pretrained={base.name}", *strategy, f"train.checkpoint_every={STEPS}")
    assert checkpoint.latest(run_dir).name == f"step-{STEPS:08d}"
    monkeypatch.chdir(tmp_path)
    line = export(capsys, "model.pretrained=run", "out=exported")
    assert line.startswith(f"exported step {STEPS} of ") and "a model directory (float32)" in line
    same_tensors(tmp_path / "exported", run_dir / "model")
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == sorted(p.name for p in (run_dir / "model").iterdir())


@pytest.mark.slow
def test_an_adapter_run_s_checkpoint_exports_its_adapter_or_merged(base, tmp_path, capsys):
    run_dir = train(tmp_path / "run", f"model.pretrained={base}", "adapter=lora", "strategy=l2l",
                    f"train.checkpoint_every={STEPS}")
    step = checkpoint.latest(run_dir)
    export(capsys, f"model.pretrained={step}", f"out={tmp_path / 'adapter'}")
    saved, exported = (load_file(d / "adapter_model.safetensors") for d in (run_dir / "model", tmp_path / "adapter"))
    assert saved.keys() == exported.keys() and all(torch.equal(t, exported[k]) for k, t in saved.items())
    line = export(capsys, f"model.pretrained={step}", "merge=true", f"out={tmp_path / 'merged'}")
    assert "its adapter merged into its base" in line
    assert torch.equal(logits(tmp_path / "merged", IDS), logits(peft_merged(base, run_dir / "model"), IDS))


# ----------------------------------------------------------------------------- mistakes


def damaged_checkpoint(directory: Path) -> Path:
    step = directory / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / checkpoint.MANIFEST).write_text(json.dumps({"format": checkpoint.FORMAT, "files": {"part-0.pt": 10}}))
    return step


def copied_checkpoint(directory: Path) -> Path:
    """A complete checkpoint (an empty one) away from any run directory: no recorded config."""
    step = directory / "step-00000001"
    step.mkdir(parents=True)
    (step / checkpoint.TRAINER).write_bytes(b"x")
    (step / "part-0.pt").write_bytes(b"x")
    (step / checkpoint.MANIFEST).write_text(json.dumps(
        {"format": checkpoint.FORMAT, "files": {"part-0.pt": 1, checkpoint.TRAINER: 1}}))
    return step


@pytest.mark.parametrize("args, says", [
    (["out={tmp}/o"], "model.pretrained=DIR is required"),
    (["model.pretrained={adapter}"], "out=DIR is required"),
    (["model.pretrained={tmp}/nothing", "out={tmp}/o"], "does not exist"),
    (["model.pretrained={junk}", "out={tmp}/o"], "is neither a LoRA adapter directory"),
    (["model.pretrained={base}", "out={tmp}/o"], "is a Hugging Face model directory already"),
    (["model.pretrained={damaged}", "out={tmp}/o"], "this checkpoint is damaged (part-0.pt is missing)"),
    (["model.pretrained={copied}", "out={tmp}/o"], "holds no recorded config"),
    (["model.pretrained={adapter}", "out={junk}"], "is not empty"),
    (["model.pretrained={adapter}", "out={junk}/file"], "is a file"),
    (["model.pretrained={adapter}", "out={junk}/file/o"], "cannot be written"),
    (["model.pretrained={adapter}", "out={tmp}/o", "dtype=int8"], "dtype=int8 must be one of auto, float32"),
    (["model.pretrained={adapter}", "out={tmp}/o", "merge=false"], "export merges into its base"),
    (["model.pretrained={adapter}", "out={tmp}/o", "merge=maybe"], "merge=maybe must be true or false"),
    (["model.pretrained={adapter}", "out={tmp}/o", "base={tmp}/nothing"], "is not a directory"),
    (["model.pretrained={adapter}", "out={tmp}/o", "base={other}"], "size mismatch for"),
    (["model.pretrained={copied}", "out={tmp}/o", "base={base}"], "names an adapter's base"),
    (["model.pretrained={adapter}", "out={tmp}/o", "prompt=hi"], "unknown key 'prompt'"),
    (["model.pretrained={adapter}", "{tmp}/o"], "is not KEY=VALUE"),
])
def test_a_mistake_is_one_line_and_exit_2(base, tmp_path, capsys, args, says):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "file").write_text("not a model")
    makers = {"tmp": lambda: tmp_path, "base": lambda: base, "junk": lambda: junk,
              "adapter": lambda: peft_adapter(base, tmp_path / "adapter"),
              "damaged": lambda: damaged_checkpoint(tmp_path / "run"), "copied": lambda: copied_checkpoint(tmp_path / "copy"),
              "other": lambda: tiny_decoder(tmp_path / "other", "llama", hidden_size=64, head_dim=16, tokenizer=False)}
    paths = {name: make() for name, make in makers.items() if "{" + name + "}" in " ".join(args)}
    assert main(["export", *(a.format(**paths) for a in args)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("relaytrain: error: ") and says in line and captured.out == ""
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".*partial"))


def test_export_has_its_help_and_is_listed(capsys):
    assert main(["export", "--help"]) == 0
    assert "model.pretrained=SRC" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "relaytrain export" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what the run says


def test_the_run_says_where_its_model_went_and_in_what_form(base, tmp_path, capsys, wide_table):
    given = [f"model.pretrained={base}", "adapter=lora", *TRAIN_KEYS, "train.steps=1"]
    results = run(resolve(compose_config(given), given), tmp_path, table=True)
    saved = results["saved_model"]
    assert saved == {"path": str((tmp_path / "model").resolve()), "form": "adapter", "base": str(base.resolve()),
                     "dtype": "float32", "generates": True}
    assert json.loads((tmp_path / "results.json").read_text())["saved_model"] == saved
    out = capsys.readouterr().out
    assert f"a peft adapter over {base.resolve()}" in out
    (line,) = [line for line in out.splitlines() if line.startswith("model saved to")]
    assert line == (f"model saved to {saved['path']}; try: relaytrain generate model.pretrained={saved['path']} "
                    f"prompt=Hello; merge it into its base: relaytrain export model.pretrained={saved['path']} out=DIR")
    assert results["adapter"]["merged"] is False and results["adapter"]["quantize"] is None


def adapter_cfg(checkpoint_dir: Path, *overrides: str):
    given = [f"model.pretrained={checkpoint_dir}", *overrides]
    return resolve(compose_config(given), given)


def facts_of(cfg) -> dict | None:
    """results.json's `adapter` of a run of `cfg`, from what the run resolves (`describe_run`)."""
    return adapter_facts(cfg, describe_run(cfg))


@pytest.fixture
def wide_table(monkeypatch):
    """The summary table's rows on one line each, as on a wide terminal."""
    from relaytrain.records import display

    monkeypatch.setattr(display.console, "width", 400)


def test_the_table_shows_a_4_bit_base_and_a_merged_adapter(base, capsys, wide_table):
    facts = facts_of(adapter_cfg(base, "adapter=qlora", "model.quantize_double=true", "train.save_model=true",
                                      "adapter.merge_on_save=true"))
    assert (facts["quantize"], facts["merged"]) == ("nf4-double", True) and "experts" not in facts
    assert not facts_of(adapter_cfg(base, "adapter=qlora", "adapter.merge_on_save=true"))["merged"]  # nothing saved
    results = fake_results(facts, {"path": "/runs/q/model", "form": "merged", "base": None, "dtype": "float32",
                                   "generates": True})
    print_results_table(results, Path("/runs/q/results.json"))
    out = capsys.readouterr().out
    assert "lora r=8 over a 4-bit base (nf4-double)" in out and "the adapter merged into its base" in out


def test_lora_on_a_mixture_says_its_experts_are_not_adapted_and_which_key_adapts_them(tmp_path, capsys, wide_table):
    moe = tiny_moe(tmp_path / "moe", "qwen3_moe", mlp_only_layers=[])  # every MLP routed: all-linear names attention's
    facts = facts_of(adapter_cfg(moe, "adapter=lora"))
    names = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert facts["experts"] == {"names": names, "frozen": names,
                                "adapted_by": "adapter.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"}
    print_results_table(fake_results(facts, None), Path("r.json"))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "experts" in line]
    assert ("not adapted: mlp.experts.gate_up_proj, mlp.experts.down_proj stay frozen; adapter.target_parameters="
            "[mlp.experts.gate_up_proj,mlp.experts.down_proj] adapts them") in row
    half = facts_of(adapter_cfg(moe, "adapter=lora", "adapter.target_parameters=[mlp.experts.down_proj]"))
    assert half["experts"]["frozen"] == ["mlp.experts.gate_up_proj"]
    every = facts_of(adapter_cfg(moe, "adapter=lora", f"adapter.target_parameters=[{','.join(names)}]"))
    assert every["experts"]["frozen"] == []


def test_a_run_reports_the_experts_peft_adapted_as_it_built_them(tmp_path):
    """peft turns target modules named gate_proj / up_proj / down_proj on a mixture into LoRA on the
    fused experts; all-linear names them where a layer is dense (Qwen3's mlp_only_layers). The run
    reports what it built (every expert adapted, the parameters that really train), not the
    pre-run count; naming attention alone leaves the experts frozen, and says so."""
    from relaytrain.models import build_model
    from relaytrain.run.train import run

    moe = tiny_moe(tmp_path / "moe", "qwen3_moe")  # layer 1 dense
    keys = ["strategy=baseline", "train.steps=1", "data.seq_len=8", "strategy.microbatch_size=1",
            "strategy.num_microbatches=1"]
    for targets, frozen in (([], []), (["adapter.target_modules=[q_proj,v_proj]"],
                                       ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])):
        cfg = adapter_cfg(moe, "adapter=lora", *targets, *keys)
        model = build_model(cfg.model, adapter=cfg.adapter)
        trains = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
        facts = run(cfg, tmp_path / f"run{len(frozen)}", table=False)["adapter"]
        assert facts["trained_parameters"] == trains
        assert facts["experts"]["frozen"] == frozen


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_the_pre_run_count_of_what_trains_is_the_built_models(kind, tmp_path):
    """The planner's and the dry run's count of what trains under LoRA (before any model is
    built) is the built model's: a dense layer or a shared expert makes all-linear name gate_proj,
    and peft then adapts every routed layer's experts, which no single block shows."""
    from relaytrain.models import build_model, what_trains

    directory = tiny_moe(tmp_path / "moe") if kind == "qwen3_moe" else tiny_bias_balanced(tmp_path / "moe", kind)
    cfg = adapter_cfg(directory, "adapter=lora")
    model = build_model(cfg.model, adapter=cfg.adapter)
    trains = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    counted = what_trains(cfg.model, cfg.adapter)
    assert counted.parameters == trains
    assert counted.experts and counted.frozen == ()  # every expert adapted, as built


def fake_results(adapter: dict, saved: dict | None) -> dict:
    """The keys the summary table reads, around the adapter's facts and the saved model's."""
    device = {"peak_allocated_bytes": None, "note": "CPU run"}
    return {"strategy": "baseline", "model": {"name": "m", "parameters": 1000, "pretrained": None},
            "adapter": adapter, "saved_model": saved, "device": "cpu", "precision": "fp32", "steps": 1,
            "measured_steps": 1, "loss": [1.0],
            "throughput": {"samples_per_s": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "model_flops_per_s": 1.0},
            "memory": {"device": device, "host_peak_rss_bytes": 1}}
