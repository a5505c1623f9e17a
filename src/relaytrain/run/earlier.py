"""What a run does with the run its directory already holds: a finished run relaunched with
`train.resume=auto` returns that run's results (a relaunched sweep completes only what is
missing); a start afresh over a finished run or its checkpoints, and a resume behind a finished
run's last step, are refused in one line, so no run's results or checkpoints are written over."""

from __future__ import annotations

import json
from pathlib import Path

from relaytrain.records import checkpoint, runlog
from relaytrain.run import dirs as run_dirs
from relaytrain.utils.errors import ConfigError


def earlier_run(resume: str | None, steps: int, run_dir: Path, dir_key: str = "hydra.run.dir") -> dict | None:
    """What `run_dir` already holds decides this run (train.resume as the attempt runs with it,
    train.steps): a run that finished `steps` relaunched with `auto` gives its results (None: train);
    a run that would write over the one there is refused in one line. `dir_key`: the key that names
    another directory (a sweep's jobs are under hydra.sweep.dir)."""
    done = _finished_results(resume, steps, run_dir)
    if done is None:
        refuse_to_start_over(resume, run_dir, dir_key)
        refuse_to_retrain_a_finished_run(resume, run_dir)
    return done


def _finished_results(resume: str | None, steps: int, run_dir: Path) -> dict | None:
    """With `train.resume=auto`, a run directory whose run already finished `steps`: its
    results, so a relaunched sweep completes only what is missing. None otherwise (asking for
    more steps continues from the final checkpoint, which a run with `train.resume` set keeps)."""
    if resume != "auto" or runlog.finished_steps(run_dir) != steps:
        return None
    return json.loads((Path(run_dir) / "results.json").read_text())


def how_to_train_further(steps: int, run_dir: Path) -> str:
    """What a finished run's line advises: more steps where it kept its last step's checkpoint."""
    if _kept_last_step(run_dir, steps):
        return "raise train.steps to train further"
    return ("it kept no checkpoint of its last step (train.checkpoint_every=0), so it cannot train further "
            "here: start a longer run in another hydra.run.dir")


def _kept_last_step(run_dir: Path, steps: int) -> bool:
    """Whether the run in `run_dir`, finished at `steps`, kept a checkpoint of that step."""
    newest = checkpoint.latest(run_dir)
    return newest is not None and step_of(newest) == steps


def refuse_to_start_over(resume: str | None, run_dir: Path, dir_key: str = "hydra.run.dir") -> None:
    """A run without `train.resume` (`resume` None) into a directory that holds a finished
    run or checkpoints, in one line: starting afresh there would write over its results and
    metrics, and the new run's checkpoints would rotate the old ones away. `dir_key`: the key
    that names another directory (a sweep's jobs are under hydra.sweep.dir)."""
    if resume is not None:
        return
    finished, newest = runlog.finished_steps(run_dir), checkpoint.latest(run_dir)
    if finished is None and newest is None:
        return
    if finished is None:
        held, keep = f"checkpoints up to step {step_of(newest)}", "to continue from the newest"
    elif _kept_last_step(run_dir, finished):
        held, keep = f"a run that finished {finished} steps", "to keep it (with a larger train.steps, to train further)"
    else:
        held = f"a run that finished {finished} steps"
        keep = "to keep it (without a checkpoint of its last step it cannot train further)"
    raise ConfigError(f"{run_dir} already holds {held}: give train.resume=auto {keep}, or another {dir_key} "
                      f"to start afresh")


def refuse_to_retrain_a_finished_run(resume: str | None, run_dir: Path) -> None:
    """A resume that would go back behind a finished run's last step, in one line: a run
    finished without a checkpoint of its last step (train.checkpoint_every=0) and resumed with
    `auto` would train again from an older checkpoint, or from step 0, over its results;
    `train.resume=RUN_DIR` of such a run would quietly start where that run did not end. (The
    finished run relaunched as it was is no resume: `earlier_run` returns its results first.)"""
    if resume is None:
        return
    given = Path(run_dir) if resume == "auto" else Path(resume).expanduser()
    chosen = checkpoint.STEP.match(given.name) is not None  # a step-N directory: the user picked the step
    newest = given if chosen else checkpoint.latest(given)
    step = step_of(newest) if newest is not None else 0
    here = runlog.finished_steps(run_dir)
    if here is not None and step < here:
        how = f"resuming from step {step}" if newest is not None else "starting afresh"
        raise ConfigError(f"{run_dir} holds a run that finished {here} steps without a checkpoint of its last "
                          f"step; {how} here would train again over its results: give another hydra.run.dir")
    there = None if chosen or resume == "auto" else runlog.finished_steps(run_dirs.run_dir_of(resume))
    if there is not None and step < there:
        fix = f"to train again from step {step}, give train.resume={newest}" if newest else "start a new run"
        raise ConfigError(f"train.resume={resume}: that run finished {there} steps without a checkpoint of its "
                          f"last step; {fix}")


def step_of(path: Path) -> int:
    return int(checkpoint.STEP.match(path.name).group(1))
