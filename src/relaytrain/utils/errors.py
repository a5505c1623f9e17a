"""Errors a user can fix, and the ways a run ends early. The CLI prints each as one line on stderr."""

from __future__ import annotations

import signal
from pathlib import Path


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty): what a
    one-line error quotes of a library's multi-line one."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class ConfigError(Exception):
    """A bad config, bad input data or a run the machine cannot hold; the message names the fix (exit 2)."""


class TrainingDiverged(ConfigError):
    """The loss became NaN or infinite under a precision that cannot skip steps."""


class CheckpointWriteFailed(ConfigError):
    """A checkpoint could not be written (a full disk, a lost mount); the complete ones are kept."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; every process stopped at one step and saved a checkpoint there."""

    def __init__(self, signum: int, step: int, path: Path):
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved to {path}; "
                         f"continue with train.resume={path}")
        self.signum, self.step, self.path = signum, step, path


class Aborted(Exception):
    """A second SIGINT/SIGTERM: the run ended at once, without saving."""

    def __init__(self, signum: int, latest: Path | None = None):
        where = (f"the latest complete checkpoint is {latest}; continue with train.resume={latest}" if latest
                 else "no checkpoint was saved")
        super().__init__(f"{signal.Signals(signum).name} again: stopped at once; {where}")
        self.signum = signum
