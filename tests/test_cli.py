"""The `relaytrain` command on good and bad input."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relaytrain.commands.cli import main
from relaytrain.strategies import registry

SMALL = ["+exp=tiny_baseline"]


def relaytrain(*args, cwd, env_extra=None, check=True):
    env = {**os.environ, "CI": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_train_writes_results_and_prints_the_report(tmp_path):
    run_dir = tmp_path / "run"
    proc = relaytrain("train", *SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["strategy"] == "baseline"
    assert results["steps"] == 4 and len(results["loss"]) == 4
    assert results["measured_steps"] == 3
    assert results["model"]["parameters"] > 0
    assert results["throughput"]["samples_per_s"] > 0
    assert results["throughput"]["tokens_per_s"] == pytest.approx(results["throughput"]["samples_per_s"] * 32)
    assert results["memory"]["host_peak_rss_bytes"] > 0
    assert results["memory"]["device"]["peak_allocated_bytes"] is None  # CPU: no device memory to report
    assert "+exp=tiny_baseline" in results["overrides"]
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert "samples/s" in proc.stdout and "peak host RSS" in proc.stdout


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_multirun_writes_one_result_per_job(tmp_path):
    relaytrain("train", "-m", *SMALL, "optim.lr=1e-4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    results = sorted((tmp_path / "sweep").glob("*/results.json"))
    assert len(results) == 2
    lrs = {r for f in results for r in json.loads(f.read_text())["overrides"] if r.startswith("optim.lr")}
    assert lrs == {"optim.lr=0.0001", "optim.lr=0.001"}
    kept = [f.read_text() for f in results]

    # The same sweep again: each job refuses to write over its finished run, and says how to keep it.
    again = relaytrain("train", "-m", *SMALL, "optim.lr=1e-4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                       cwd=tmp_path, check=False)
    assert again.returncode == 1 and "2 sweep job(s) failed; each said why in its line above" in again.stderr
    assert again.stderr.count("already holds a run that finished 4 steps: give train.resume=auto to keep it") == 2
    assert "or another hydra.sweep.dir to start afresh" in again.stderr
    relaytrain("train", "-m", *SMALL, "optim.lr=1e-4,1e-3", "train.resume=auto",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)  # keeps both: nothing to train
    assert [f.read_text() for f in results] == kept


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_saved_model_loads_with_hugging_face_and_keeps_parameter_names(tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_dir = tmp_path / "run"
    relaytrain("train", *SMALL, "train.save_model=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    names = {n for n, _ in loaded.named_parameters()}
    assert "bert.encoder.layer.1.attention.self.query.weight" in names and "classifier.weight" in names

    # ... and trains again from there as model.pretrained, weights and all.
    again = tmp_path / "again"
    relaytrain("train", *SMALL, f"model.pretrained={run_dir / 'model'}", "train.steps=2", "train.untimed_steps=0",
               f"hydra.run.dir={again}", cwd=tmp_path)
    assert json.loads((again / "results.json").read_text())["model"]["parameters"] == loaded.num_parameters()


def test_bad_input_is_one_line_exit_2_and_no_traceback(tmp_path):
    proc = relaytrain("train", "model.num_heads=5", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "relaytrain: error: model.num_heads=5 does not divide model.hidden_size=128; "
        "pick heads that divide it (e.g. model.num_heads=4)"
    ]


@pytest.mark.slow  # a second CLI process (about 8 s on 2 cores): the slow step
def test_hydra_full_error_shows_the_traceback_of_bad_input(tmp_path):
    full = relaytrain("train", "model.num_heads=5", cwd=tmp_path, check=False, env_extra={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model=bert_huge", "model=bert_huge is not a known option"),
        ("strategy=nope", "strategy=nope is not a known option"),
        ("model.num_layerz=3", "unknown key model.num_layerz; did you mean model.num_layers?"),
        ("optim.learning_rate=1e-3", "unknown key optim.learning_rate; did you mean optim.lr?"),  # its initials
        ("optim=adafactor", "optim=adafactor is not a known option; choose one of: adamw, lamb, muon, sgd"),  # no `_schema`
        ("strategy=l2k", "did you mean strategy=l2l? choose one of: baseline, fsdp, l2l, l2l_stash_cpu, pipe_2bw,"),
        ("model.num_layers=abc", "model.num_layers=abc is not a valid integer"),
        ("adapter.target_modules=q_proj", "adapter.target_modules=q_proj: adapter.target_modules is a list; give "
                                          "adapter.target_modules=[q_proj]"),
        ("train.save_model=maybe", "train.save_model"),
        ("model.hidden_size=0", "model.hidden_size=0 must be positive"),
        ("data.seq_len=1024", "data.seq_len=1024 exceeds the model's positions"),
        ("model=llama_tiny data.seq_len=4096", "or raise model.max_seq_len=4096 to train past the length the model"),
        ("data=jsonl", "data=jsonl needs a file"),
        ("data.path=/no/such.jsonl", "data.path=/no/such.jsonl does not exist"),
        ("train.device=cuda", "no CUDA device"),
        ("precision=cmp_bf16", "needs the eager param server"),
        ("model=gpt2_tiny model.task=classification", "not available for model.family=gpt2"),
        ("model.family=llama", "not a model family; choose one of bert, decoder, gpt2"),
        ("train.untimed_steps=400", "train.untimed_steps=400 leaves no measured step"),
        ("train.warmup_steps=2", "train.warmup_steps was renamed train.untimed_steps (steps left out of the "
                                 "throughput figures); optim.warmup_steps is the learning-rate warm-up"),
        ("strategy.stages=2", "strategy.stages is not a key of strategy=baseline; only strategy="
                              + "/".join(n for n, c in registry().items() if "stages" in c.Config.__dataclass_fields__)
                              + " have it"),
        ("optim=lamb optim.momentum=0.9", "optim.momentum is not a key of optim=lamb; only optim=muon/sgd have it"),
        ("strategy.recompute=true", "strategy.recompute=True is not one of none, block, stage"),
        ("model.task=clasification", "model.task=clasification is not one of classification, masked_lm, "
                                     "causal_lm, dpo"),
        ("objective.name=dp", "objective.name=dp is not one of classification, masked_lm, causal_lm, dpo"),
        ("strategy=l2l strategy.stash=gpu", "strategy.stash=gpu is not one of device, host"),
        ("strategy=l2l strategy.stash=cpu", "strategy.stash=cpu was renamed strategy.stash=host (host memory, as in "
                                            "strategy.offload=host)"),
        ("strategy=l2l strategy.eps=replicated", "strategy.eps was renamed strategy.eps_state (where the eager param "
                                                 "server's state lives: sharded or replicated); optim.eps is the "
                                                 "optimizer's epsilon"),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(override, expected, capsys):
    if override == "train.device=cuda":
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    if override.startswith("data.path"):
        override = f"data=jsonl {override}"
    if override.startswith("precision=cmp"):
        override = f"{override} strategy=baseline"
    assert main(["train", *override.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: ")
    assert expected in err[0]


def test_every_job_of_a_sweep_is_checked_before_any_runs(capsys):
    assert main(["train", "-m", "model=bert_tiny,bert_wrong"]) == 2
    assert "model=bert_wrong is not a known option" in capsys.readouterr().err


def test_run_that_cannot_fit_in_host_memory_is_refused(capsys):
    # ~80 B parameters (hundreds of GB of host state): refused without building 4000 blocks, even on the meta device
    assert main(["train", "model=bert_large", "model.num_layers=100", "model.hidden_size=8192"]) == 2
    err = capsys.readouterr().err
    assert "GiB of host memory (estimate)" in err and "model.num_layers" in err


@pytest.mark.slow  # about 10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_help_lists_commands_strategies_and_config_groups(tmp_path, capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("relaytrain train", "relaytrain schedule", "baseline", "l2l", "pipe_2bw", "+exp="):
        assert word in out
    proc = relaytrain("train", "--help", cwd=tmp_path)
    for word in ("Config groups", "bert_large", "*baseline", "pipe_gpipe", "strategy.microbatch_size = 8",
                 "train.steps = 300", "+exp=NAME"):
        assert word in proc.stdout


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_help_names_every_config_group_and_section(tmp_path, capsys):
    """Every section of the schema is named: the groups with options (adapter too), and those set
    key by key (log too); train --help stars each group's choice, qlora's as given."""
    from relaytrain.commands.help import key_sections, option_groups
    from relaytrain.schema.config import RelayTrainConfig

    sections = [f.name for f in dataclasses.fields(RelayTrainConfig)]
    assert sorted(option_groups() + key_sections()) == sorted(sections)
    assert {"adapter", "model", "optim"} <= set(option_groups()) and {"log", "train"} <= set(key_sections())
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert f"Config groups (GROUP=OPTION): {', '.join(option_groups())}; experiments: +exp=NAME." in out
    assert f"Keys only (KEY=VALUE): {', '.join(key_sections())}." in out
    proc = relaytrain("train", "adapter=qlora", "--help", cwd=tmp_path, env_extra={"COLUMNS": "100"})
    assert "  adapter    lora none *qlora" in proc.stdout and "  data       chat glue jsonl preference prompts *synthetic" in proc.stdout
    assert f"  {', '.join(key_sections())}: no options, keys only (below)" in proc.stdout
    assert "log.tensorboard = False" in proc.stdout
    groups = proc.stdout[proc.stdout.index("Config groups"):proc.stdout.index("Keys of this config")]
    assert max(len(line) for line in groups.splitlines()) <= 100  # the options wrap to the terminal


def test_plan_help_names_every_plan_key(capsys):
    from relaytrain.schema.config import PlanConfig

    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert [f.name for f in dataclasses.fields(PlanConfig) if f"plan.{f.name}=" not in out] == []


def test_unknown_command_exits_2(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_configs_are_found_from_any_working_directory(tmp_path):
    proc = relaytrain("train", "--cfg", "job", cwd=Path("/"))
    assert "num_layers: 4" in proc.stdout


def test_every_packaged_experiment_composes_and_passes_the_checks():
    from relaytrain.run.compose import compose_config, validate

    experiments = sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "exp").glob("*.yaml"))
    assert "bert_large_l2l" in experiments
    for name in experiments:
        validate(compose_config([f"+exp={name}"]))


@pytest.mark.parametrize(("steps", "measured"), [(1, 1), (2, 1), (3, 1), (5, 3)])
def test_a_short_run_measures_what_the_default_untimed_steps_leave(tmp_path, steps, measured):
    """train.untimed_steps defaults to 2 where the run has a step left to measure, fewer in a
    shorter one: `train.steps=2` trains (it was refused), and an explicit value stays strict."""
    from relaytrain.run.train import run
    from tests.conftest import tiny_cfg

    results = run(tiny_cfg("bert", f"train.steps={steps}", "train.untimed_steps=null"), tmp_path, table=False)
    assert results["measured_steps"] == measured


@pytest.mark.parametrize(("key", "sweep"), [("hydra.run.dir", []), ("hydra.sweep.dir", ["-m", "optim.lr=1e-3,1e-4"])])
def test_an_output_directory_that_cannot_be_made_is_one_line_exit_2(tmp_path, capsys, key, sweep):
    # Under a file here; a read-only mount or a directory without write permission fails in the
    # same mkdir (or the probe file after it), with its OS error named instead.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", *SMALL, *sweep, f"{key}={blocker / 'run'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"relaytrain: error: {key}={blocker / 'run'} cannot be made or written ({blocker} is a file); "
        f"choose a directory you can write with {key}=DIR"]
    assert list(tmp_path.iterdir()) == [blocker]


def test_the_output_directory_check_leaves_nothing_behind_and_the_run_makes_it(tmp_path, monkeypatch):
    from relaytrain.run.dirs import check_writable

    monkeypatch.chdir(tmp_path)  # a relative directory is where the command runs
    check_writable(["hydra.run.dir=a/b"])
    assert list(tmp_path.iterdir()) == []  # Hydra makes it as it starts the run
    assert main(["train", *SMALL, "hydra.run.dir=a/b"]) == 0
    assert (tmp_path / "a" / "b" / "results.json").is_file()


def test_a_run_from_a_checkpoint_is_named_after_it(tmp_path, monkeypatch):
    """outputs/DATE/TIME_STRATEGY_NAME names the checkpoint's directory (or hub name), not the model
    config the run started from (bert_tiny, the default, for any `model.pretrained=DIR`)."""
    from relaytrain.run.compose import run_label
    from tests.checkpoints import tiny_decoder

    checkpoint = tiny_decoder(tmp_path / "my-llama", "llama", layers=1)
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"model.pretrained={checkpoint}/", "train.steps=1", "data.seq_len=16",
                 "data.num_samples=32"]) == 0
    [run_dir] = (tmp_path / "outputs").glob("*/*")
    assert run_dir.name.endswith("_baseline_my-llama")
    assert run_label("llama_tiny", "meta-llama/Llama-3.1-8B") == "Llama-3.1-8B"
    assert run_label("bert_tiny", None) == "bert_tiny"


@pytest.mark.slow  # over 8 s on 2 cores: the slow step (the default suite stays within 8 minutes)
@pytest.mark.parametrize("strategy", ["baseline", "pipe_flush"])
def test_a_run_whose_output_reader_went_away_trains_on_and_finishes(tmp_path, strategy):
    """`relaytrain train | head`: the reader leaves, the run does not (nor does it say it failed)."""
    run_dir = tmp_path / "run"
    read, write = os.pipe()
    os.close(read)  # gone before the first line: every write to stdout finds the pipe broken
    try:
        proc = subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", "train", *SMALL, f"strategy={strategy}",
                               "train.log_every=1", f"hydra.run.dir={run_dir}"], stdout=write,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "CI": "1"}, timeout=240)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "finished" and "error" not in status
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 4
