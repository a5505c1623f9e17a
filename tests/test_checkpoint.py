"""Checkpoints: nothing lost, exact resume, atomic writes, clear failures."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.commands.cli import main
from relaytrain.records import checkpoint, runlog
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_BERT, TINY_LLAMA, wait_for

# bert_tiny at this batch takes ~0.1 s a step on 2 cores: slow enough to kill mid-run.
RUN = ["train", "train.steps=30", "train.untimed_steps=1", "strategy.microbatch_size=8",
       "strategy.num_microbatches=2", "data.num_samples=512", "model.dropout=0.1", "train.save_model=true"]


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "CI": "1"}
    return subprocess.Popen([sys.executable, "-m", "relaytrain.commands.cli", *RUN, f"hydra.run.dir={run_dir}", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(run_dir: Path, *extra: str) -> dict:
    proc = start(run_dir, *extra)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads((run_dir / "results.json").read_text())


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    return run_dir, finish(run_dir)


@pytest.mark.slow  # the default suite kills and resumes L2L (test_l2l_killed_run_resumes_bit_for_bit) and the pipelines
@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_to_the_same_weights_and_losses(uninterrupted, tmp_path, kill):
    whole_dir, whole = uninterrupted
    run_dir = tmp_path / "run"
    proc = start(run_dir, "train.checkpoint_every=5", "train.resume=auto")
    wait_for(run_dir / "checkpoints" / "step-00000010", proc)
    proc.send_signal(kill)
    _, err = proc.communicate(timeout=60)
    if kill == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "SIGTERM at step" in err and "checkpoint saved to" in err and "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "results.json").exists()  # it really stopped early

    resumed = finish(run_dir, "train.checkpoint_every=5", "train.resume=auto")
    assert resumed["loss"] == whole["loss"]  # bit-for-bit, every step before and after the resume
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "finished" and "error" not in status  # the stop's line went with the stop
    ours, theirs = weights(run_dir), weights(whole_dir)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
    run_dir = tmp_path / "run"
    assert main([*RUN, "train.steps=7", "train.checkpoint_every=2", "train.keep_checkpoints=2",
                 f"hydra.run.dir={run_dir}"]) == 0
    directory = checkpoint.checkpoint_dir(run_dir)
    # Every 2 steps and after the last one, the last 2 kept.
    assert [p.name for p in checkpoint.list_checkpoints(directory)] == ["step-00000006", "step-00000007"]

    staging = directory / "step-00000008.parts"
    staging.mkdir()
    crash = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from relaytrain.records import checkpoint\n"
        "def half_then_die(f):\n"
        "    f.write(b'x' * 1_000_000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"checkpoint.atomic_write(Path({str(staging / 'part-0.pt')!r}), half_then_die)\n"
    )
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert any(p.name.endswith(".tmp") for p in staging.iterdir())  # the torn write is there ...
    latest, passed = checkpoint.find("auto", run_dir)
    assert latest.name == "step-00000007" and passed == []  # ... but nothing reads it
    from relaytrain.run.compose import compose_config

    cfg = compose_config([*RUN[1:], "train.steps=9"])
    found = checkpoint.read(latest, checkpoint.identity(cfg), cfg.train.steps, "baseline", {"processes": 1})
    assert found.step == 7 and found.exact and found.trainer()["step"] == 7


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_keeps_only_the_last_k_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    assert main([*RUN, "train.steps=9", "train.checkpoint_every=2", "train.keep_checkpoints=2",
                 f"hydra.run.dir={run_dir}"]) == 0
    names = [p.name for p in checkpoint.list_checkpoints(checkpoint.checkpoint_dir(run_dir))]
    assert names == ["step-00000008", "step-00000009"]  # every 2 steps, and the last step always


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_checkpoint_that_does_not_fit_the_config_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*RUN, "train.steps=4", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*RUN, "model.num_layers=3", f"train.resume={run_dir}", f"hydra.run.dir={tmp_path / 'b'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "does not fit this config (num_layers: checkpoint 4 vs config 3)" in err

    corrupt = tmp_path / "step-00000002"
    shutil.copytree(checkpoint.checkpoint_dir(run_dir) / "step-00000002", corrupt)
    part = corrupt / "part-0.pt"
    part.write_bytes(b"x" * part.stat().st_size)  # the size the manifest recorded, garbage inside
    with pytest.raises(SystemExit) as stop:
        main([*RUN, "train.steps=4", f"train.resume={corrupt}", f"hydra.run.dir={tmp_path / 'c'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this checkpoint is damaged (part-0.pt does not match its checksum)" in err[0]

    with pytest.raises(SystemExit) as stop:
        main([*RUN, "train.steps=4", f"train.resume={part}", f"hydra.run.dir={tmp_path / 'd'}"])
    assert "is a file; give a checkpoint directory" in capsys.readouterr().err


def test_a_nan_loss_stops_the_run_naming_the_step(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*RUN, "optim=sgd", "optim.lr=1e30", "train.checkpoint_every=1", f"hydra.run.dir={tmp_path}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the loss became nan at step" in err[0] or "the loss became inf at step" in err[0]
    step = int(err[0].split(" at step ")[1].split()[0])
    kept = checkpoint.list_checkpoints(checkpoint.checkpoint_dir(tmp_path))
    assert kept and all(int(p.stem.split("-")[1]) < step for p in kept)  # only good steps were saved


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_l2l_killed_run_resumes_bit_for_bit(tmp_path):
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    l2l = ("strategy=l2l", "train.steps=12")
    whole = finish(whole_dir, *l2l)
    proc = start(resumed_dir, *l2l, "train.checkpoint_every=3", "train.resume=auto")
    wait_for(resumed_dir / "checkpoints" / "step-00000003", proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = finish(resumed_dir, *l2l, "train.checkpoint_every=3", "train.resume=auto")
    assert resumed["loss"] == whole["loss"]
    ours, theirs = weights(resumed_dir), weights(whole_dir)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


# The slow step (GPT-2's ~14 s on 2 cores): tests/test_dropout.py resumes a BERT baseline checkpoint
# under L2L with dropout on in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_baseline_checkpoint_resumes_under_l2l(tmp_path, family):
    model = ["model=gpt2_tiny"] if family == "gpt2" else []
    steps = [*RUN, *model, "train.steps=6", "model.dropout=0.0"]
    assert main([*steps, f"hydra.run.dir={tmp_path / 'whole'}"]) == 0
    assert main([*steps, "train.checkpoint_every=3", f"hydra.run.dir={tmp_path / 'first'}"]) == 0
    half = checkpoint.checkpoint_dir(tmp_path / "first") / "step-00000003"
    assert main([*steps, "strategy=l2l", f"train.resume={half}", f"hydra.run.dir={tmp_path / 'then'}"]) == 0
    ours, theirs = weights(tmp_path / "then"), weights(tmp_path / "whole")
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_finished_run_relaunched_says_so_and_more_steps_continue_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    again = [*RUN, "train.steps=4", "train.checkpoint_every=2", "train.resume=auto", f"hydra.run.dir={run_dir}"]
    assert main(again) == 0
    results = (run_dir / "results.json").read_text()
    capsys.readouterr()

    assert main(again) == 0  # a relaunched sweep job that had finished: nothing to do, no error
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"this run already finished its 4 steps ({run_dir / 'results.json'}); raise train.steps to "
                   f"train further"]
    assert (run_dir / "results.json").read_text() == results  # kept as it was
    assert [p.name for p in checkpoint.list_checkpoints(checkpoint.checkpoint_dir(run_dir))][-1] == "step-00000004"

    longer = [*again[:-2], "train.steps=6", *again[-2:]]
    assert main(longer) == 0
    assert "resuming from step 4" in capsys.readouterr().out
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 6


def test_a_manifest_from_before_the_eps_state_rename_still_resumes_exactly(tmp_path):
    from relaytrain.run.compose import compose_config
    from relaytrain.strategies import strategy_class

    cfg = compose_config(["strategy=l2l", "strategy.replicas=2", "strategy.eps_state=replicated"])
    layout = strategy_class("l2l").state_layout(cfg)
    older = {("eps" if key == "eps_state" else key): value for key, value in layout.items()}
    assert older != layout  # the manifest as checkpoints written before the rename have it
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(
        {"format": checkpoint.FORMAT, "identity": checkpoint.identity(cfg), "step": 1, "strategy": "l2l",
         "layout": older}))
    assert checkpoint.read(tmp_path, checkpoint.identity(cfg), cfg.train.steps, "l2l", layout).exact


# ------------------------------------------------------------------------------ resuming as the console says

LORA = [*TINY_LLAMA, "adapter=lora", "train.steps=4", "train.untimed_steps=0", "strategy.microbatch_size=4",
        "strategy.num_microbatches=1"]
SMALL = ["train", *TINY_BERT, "train.untimed_steps=0", "strategy.microbatch_size=4", "strategy.num_microbatches=1"]


def refused(*args: str, capsys) -> str:
    """The one error line of a `relaytrain train` that is refused (exit code 2)."""
    with pytest.raises(SystemExit) as stop:
        main(["train", *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: "), err
    return err[0].removeprefix("relaytrain: error: ")


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_checkpoint_resumes_from_its_path_alone_with_the_runs_own_config(tmp_path, capsys):
    run_dir = tmp_path / "lora"
    assert main(["train", *LORA, "train.checkpoint_every=2", f"hydra.run.dir={run_dir}"]) == 0
    whole = json.loads((run_dir / "results.json").read_text())
    half = checkpoint.checkpoint_dir(run_dir) / "step-00000002"
    capsys.readouterr()

    # As the SIGINT line prints it: the path and nothing else (the default config is bert_tiny, no adapter).
    assert main(["train", f"train.resume={half}", f"hydra.run.dir={tmp_path / 'resumed'}"]) == 0
    out = capsys.readouterr().out
    read_back = f"train.resume: the run's own config read back from {run_dir / '.hydra' / 'overrides.yaml'}: "
    assert read_back + " ".join([*LORA, "train.checkpoint_every=2"]) + "\n" in out
    assert f"resuming from step 2 of {half}\n" in out
    assert json.loads((tmp_path / "resumed" / "results.json").read_text())["loss"] == whole["loss"]  # exact

    # The user's keys go on top: from the run directory's latest checkpoint (step 4), two more steps.
    assert main(["train", f"train.resume={run_dir}", "train.steps=6", f"hydra.run.dir={tmp_path / 'longer'}"]) == 0
    assert "; yours on top: train.steps=6\n" in capsys.readouterr().out
    longer = json.loads((tmp_path / "longer" / "results.json").read_text())
    assert longer["steps"] == 6 and longer["loss"][:4] == whole["loss"]


def test_adapters_and_a_full_fine_tune_are_told_apart_on_resume(tmp_path):
    from relaytrain.run.compose import compose_config

    lora, full = compose_config(["model=llama_tiny", "adapter=lora"]), compose_config(["model=llama_tiny"])
    for saved, config, held, fix in [
        (lora, full, "holds lora adapters, but this config trains every weight", "adapter=lora"),
        (full, lora, "holds a full fine-tune (every weight), but this config has adapter=lora", "adapter=none"),
    ]:
        (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(
            {"format": checkpoint.FORMAT, "identity": checkpoint.identity(saved), "step": 1, "strategy": "baseline",
             "layout": {"processes": 1}}))
        with pytest.raises(ConfigError) as refusal:
            checkpoint.read(tmp_path, checkpoint.identity(config), config.train.steps, "baseline", {"processes": 1})
        assert str(refusal.value) == f"checkpoint {tmp_path} {held}; resume with {fix}"


# ------------------------------------------------------------------------------ a finished run stays finished


def test_a_run_with_train_resume_keeps_its_final_state_so_more_steps_continue_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    auto = [*SMALL, "train.steps=2", "train.resume=auto", f"hydra.run.dir={run_dir}"]  # checkpoint_every=0
    assert main(auto) == 0
    first = json.loads((run_dir / "results.json").read_text())
    assert [p.name for p in checkpoint.list_checkpoints(checkpoint.checkpoint_dir(run_dir))] == ["step-00000002"]
    capsys.readouterr()
    assert main([*auto, "train.steps=3"]) == 0
    assert f"resuming from step 2 of {checkpoint.checkpoint_dir(run_dir) / 'step-00000002'}" in capsys.readouterr().out
    longer = json.loads((run_dir / "results.json").read_text())
    assert longer["steps"] == 3 and longer["loss"][:2] == first["loss"]


def test_more_steps_never_train_again_over_a_finished_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*SMALL, "train.steps=2", f"hydra.run.dir={run_dir}"]) == 0  # checkpoint_every=0, no train.resume
    kept = (run_dir / "results.json").read_text(), (run_dir / "status.json").read_text()
    capsys.readouterr()

    assert main([*SMALL, "train.steps=2", "train.resume=auto", f"hydra.run.dir={run_dir}"]) == 0  # a sweep relaunched
    assert capsys.readouterr().out.strip().splitlines() == [
        f"this run already finished its 2 steps ({run_dir / 'results.json'}); it kept no checkpoint of its last "
        f"step (train.checkpoint_every=0), so it cannot train further here: start a longer run in another "
        f"hydra.run.dir"]
    assert refused(*SMALL[1:], "train.steps=3", "train.resume=auto", f"hydra.run.dir={run_dir}", capsys=capsys) == (
        f"{run_dir} holds a run that finished 2 steps without a checkpoint of its last step; starting afresh here "
        f"would train again over its results: give another hydra.run.dir")
    assert ((run_dir / "results.json").read_text(), (run_dir / "status.json").read_text()) == kept


@pytest.mark.slow  # the default suite refuses the start from step 0 (test_more_steps_never_train_again_over_a_finished_run)
def test_a_finished_run_is_not_resumed_from_a_checkpoint_older_than_its_end(tmp_path, capsys):
    # A checkpoint at step 2, finished at step 3 without one (its final checkpoint removed, as a
    # user pruning checkpoints would, or as a run before 2026-12-01 left it when started afresh there).
    run_dir = tmp_path / "run"
    assert main([*SMALL, "train.steps=3", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}"]) == 0
    shutil.rmtree(checkpoint.checkpoint_dir(run_dir) / "step-00000003")
    kept = (run_dir / "results.json").read_text(), (run_dir / "status.json").read_text()
    capsys.readouterr()
    assert refused(*SMALL[1:], "train.steps=4", "train.resume=auto", f"hydra.run.dir={run_dir}", capsys=capsys) == (
        f"{run_dir} holds a run that finished 3 steps without a checkpoint of its last step; resuming from step 2 "
        f"here would train again over its results: give another hydra.run.dir")
    older = checkpoint.checkpoint_dir(run_dir) / "step-00000002"
    assert refused(*SMALL[1:], "train.steps=4", f"train.resume={run_dir}", f"hydra.run.dir={tmp_path / 'new'}",
                   capsys=capsys) == (
        f"train.resume={run_dir}: that run finished 3 steps without a checkpoint of its last step; to train again "
        f"from step 2, give train.resume={older}")
    assert ((run_dir / "results.json").read_text(), (run_dir / "status.json").read_text()) == kept


def test_a_start_afresh_over_an_earlier_run_is_refused_and_keeps_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = [*SMALL, "train.steps=2", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}"]
    assert main(first) == 0
    kept = {name: (run_dir / name).read_text() for name in ("results.json", "metrics.csv")}
    capsys.readouterr()
    afresh = "or another hydra.run.dir to start afresh"

    assert refused(*first[1:], capsys=capsys) == (  # the same command again
        f"{run_dir} already holds a run that finished 2 steps: give train.resume=auto to keep it (with a larger "
        f"train.steps, to train further), {afresh}")
    runlog.write_status(run_dir, runlog.INTERRUPTED, step=2)  # as a Ctrl-C leaves it: checkpoints, no end
    assert refused(*first[1:], capsys=capsys) == (
        f"{run_dir} already holds checkpoints up to step 2: give train.resume=auto to continue from the newest, {afresh}")
    runlog.write_status(run_dir, runlog.FINISHED, step=3)  # finished after its newest checkpoint
    assert refused(*first[1:], capsys=capsys) == (
        f"{run_dir} already holds a run that finished 3 steps: give train.resume=auto to keep it (without a "
        f"checkpoint of its last step it cannot train further), {afresh}")
    assert {name: (run_dir / name).read_text() for name in kept} == kept
    assert [p.name for p in checkpoint.list_checkpoints(checkpoint.checkpoint_dir(run_dir))] == ["step-00000002"]


def test_a_run_resumed_after_it_failed_ends_with_no_error_in_its_status(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    every = [*SMALL, "train.steps=3", "train.checkpoint_every=1", "train.resume=auto", f"hydra.run.dir={run_dir}"]
    monkeypatch.setenv("RELAYTRAIN_FAILPOINTS", "loss:2=nan")  # step 2 diverges: step 1's checkpoint is the newest
    with pytest.raises(SystemExit):
        main(every)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "the loss became nan at step 2" in status["error"]
    monkeypatch.delenv("RELAYTRAIN_FAILPOINTS")
    assert main(every) == 0
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 3 and "error" not in status
