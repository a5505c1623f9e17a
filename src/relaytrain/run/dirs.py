"""The run directories `relaytrain train` settles before Hydra starts: the one a resume reads
its config from, and the one the run writes to.

**Resuming from a path alone.** Hydra records every run's overrides in
RUN_DIR/.hydra/overrides.yaml. Given a checkpoint (a step-N directory, its checkpoints
directory or the run directory), `recorded_overrides` reads that run's overrides back, to go
before the user's, so `relaytrain train train.resume=PATH` composes the config the run
trained with (model.pretrained, adapter, strategy, data, ...), and a key the user gives again
(train.steps=100, to train longer) replaces the recorded one; a group the user chooses again
(strategy=l2l, to resume a pipeline's checkpoint under L2L) drops the recorded keys of that group. The checkpoint's manifest then
checks the result as it checks any config (`checkpoint.read`). A checkpoint whose run
directory holds no record (one copied elsewhere) composes from the user's overrides alone.

**A directory the run can write.** Hydra makes `hydra.run.dir` (a sweep's `hydra.sweep.dir`)
only as it starts the job, and a path it cannot make (under a file, on a read-only mount) would
end in its traceback. `check_writable` makes the directory and a file in it first, removes what
it made, and turns any OSError into one line naming the key.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from relaytrain.records.checkpoint import STEP
from relaytrain.utils.errors import ConfigError

RECORD = Path(".hydra") / "overrides.yaml"  # what Hydra records of every run
# Keys whose value is a path: one recorded relative to where the run started is made absolute
# when the resume starts elsewhere.
PATH_KEYS = ("model.pretrained", "adapter.pretrained", "data.path", "data.eval_path", "data.tokenizer",
             "data.cache_dir")


def run_dir_of(resume: str) -> Path:
    """The run directory a `train.resume` path belongs to (a step-N directory's, a checkpoints
    directory's, or the run directory itself)."""
    path = Path(resume).expanduser()
    if STEP.match(path.name):
        path = path.parent
    return path.parent if path.name == "checkpoints" else path


def recorded_overrides(overrides: list[str], say=print) -> list[str]:
    """The recorded overrides of the run that `train.resume=PATH` in `overrides` names, to go
    before them: each but those of a key `overrides` gives ([] without such a PATH or a record).
    `say` gets the one line naming the record read back."""
    given = _keyed(overrides)
    resume = next((value for key, _, value in reversed(given or []) if key == "train.resume"), None)
    if not isinstance(resume, str) or resume == "auto":
        return []
    run_dir = run_dir_of(resume)
    recorded, started_in = _record(run_dir)
    mine = {key for key, _, _ in given} | {"train.resume"}
    chosen = {key for key in mine if "." not in key}  # a group chosen again (strategy=l2l) starts afresh
    kept = [_anchored(o, key, started_in) for key, o, _ in _keyed(recorded) or []
            if key not in mine and key.split(".")[0] not in chosen]
    if not kept:
        return []
    yours = [o for key, o, _ in given if key != "train.resume" and not key.startswith("hydra.")]
    say(f"train.resume: the run's own config read back from {run_dir / RECORD}: {' '.join(kept)}"
        + (f"; yours on top: {' '.join(yours)}" if yours else ""))
    return kept


def _keyed(overrides: list[str]) -> list[tuple[str, str, object]] | None:
    """(key, override, value) for each override (`+exp=x` and `exp=x` alike have the key `exp`);
    None when they do not parse (the config check that follows says why)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # Hydra's grammar errors: reported by cli.check_overrides
        return None
    return [(o.get_key_element().lstrip("+~"), text, o.value()) for o, text in zip(parsed, overrides, strict=True)]


def _record(run_dir: Path) -> tuple[list[str], Path | None]:
    """The overrides a run was composed with and the directory it started in ([] and None
    when the run directory holds no readable record)."""
    from omegaconf import OmegaConf

    try:
        recorded = [str(o) for o in OmegaConf.load(run_dir / RECORD)]
    except Exception:  # no record, or not one Hydra wrote: resume from the user's overrides alone
        return [], None
    try:
        started_in = Path(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.cwd)
    except Exception:
        started_in = None
    return recorded, started_in


def _anchored(override: str, key: str, started_in: Path | None) -> str:
    """A recorded path relative to the directory the run started in, absolute when this command
    runs elsewhere (only where the path is there to be found)."""
    name, _, value = override.partition("=")
    if key not in PATH_KEYS or started_in is None or Path(value).is_absolute() or Path.cwd() == started_in:
        return override
    return f"{name}={started_in / value}" if (started_in / value).exists() else override


# ------------------------------------------------------------------------------ where the run writes


def check_writable(overrides: list[str], multirun: bool = False) -> None:
    """Refuse in one line a run directory (a sweep's, under `multirun`) that cannot be made or
    written. `overrides`: one job's (a sweep's first combination)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    directory = _resolved(overrides, key)
    if directory is None:
        return
    try:
        _make_and_write(directory)
    except OSError as err:
        file = next((p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), None)
        where = err.filename if err.filename and Path(err.filename).parent != directory else directory  # not the probe
        why = f"{file} is a file" if file is not None else f"{err.strerror}: {where}"
        raise ConfigError(f"{key}={directory} cannot be made or written ({why}); "
                          f"choose a directory you can write with {key}=DIR") from err


def _resolved(overrides: list[str], key: str) -> Path | None:
    """The directory Hydra will make for `key` (its interpolations resolved: the time, the
    strategy's name); None where it resolves only once Hydra runs."""
    from omegaconf import OmegaConf

    from relaytrain.run.compose import compose

    try:
        return Path(str(OmegaConf.select(compose(overrides, return_hydra_config=True), key))).absolute()
    except Exception:  # an interpolation of Hydra's runtime: Hydra's own check then applies
        return None


def _make_and_write(directory: Path) -> None:
    """Make `directory` (and what is missing above it), make and drop a file in it, then remove
    the directories made here (Hydra makes them again, its clock's name may be a second on).
    Raises the OSError that stops any of it."""
    made = []
    try:
        for path in [*reversed(directory.parents), directory]:
            if path.is_dir():
                continue
            try:
                path.mkdir()  # a file in the way, a read-only mount, no permission: OSError
            except FileExistsError:
                if path.is_dir():  # another run made it meanwhile: theirs
                    continue
                raise
            made.append(path)
        with tempfile.TemporaryFile(dir=directory):
            pass
    finally:
        for path in reversed(made):
            try:
                path.rmdir()
            except OSError:  # another run made something in it meanwhile: theirs to keep
                pass
