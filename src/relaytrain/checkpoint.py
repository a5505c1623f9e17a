"""Checkpoints that lose nothing: atomic writes, exact resume, strategy-neutral contents.

A checkpoint holds everything the next step depends on: weights and optimizer state keyed by
the Hugging Face parameter names (so a baseline checkpoint resumes under L2L, whose eager
param server holds the same weights and state), the loss scaler, the step count (the LR
schedule is a function of it), the data position, every RNG state, and the loss history.

Writes go to a temporary file in the same directory, are fsync'ed, then renamed over the
final name, and the directory is fsync'ed: a crash during a save leaves the previous
checkpoint intact and the half-written file under a name nothing reads.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch

from relaytrain.errors import ConfigError

FORMAT = 1
NAME = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ------------------------------------------------------------------------------ contents


def capture(cfg, strategy, step: int, data_position: int, history: dict) -> dict:
    names = _names(strategy.model)
    return {
        "format": FORMAT,
        "step": step,
        "data_position": data_position,
        "history": history,
        "identity": identity(cfg),
        "strategy": cfg.strategy.name,
        "weights": {name: p.detach().clone() for name, p in _named_masters(strategy.model)},
        "optimizer": _optimizer_state_by_name(strategy.optimizers(), names),
        "scaler": strategy.scaler.state_dict() if getattr(strategy, "scaler", None) else None,
        "rng": _rng_state(),
    }


def restore(state: dict, strategy) -> None:
    """Load weights, optimizer and scaler state into a freshly built strategy; set the RNGs."""
    with torch.no_grad():
        for name, p in _named_masters(strategy.model):
            p.copy_(state["weights"][name])
    _load_optimizer_state_by_name(strategy.optimizers(), _names(strategy.model), state["optimizer"])
    if state["scaler"] is not None and getattr(strategy, "scaler", None):
        strategy.scaler.load_state_dict(state["scaler"])
    strategy.weights_loaded()
    _set_rng_state(state["rng"])


def identity(cfg) -> dict:
    """What must match for a checkpoint to fit a run: the model's shape and the update rule."""
    m = cfg.model
    return {
        "family": m.family, "task": m.task, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "num_heads": m.num_heads, "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
        "optim": cfg.optim.name, "precision": cfg.precision.name,
    }


def _named_masters(model):
    """(Hugging Face name, parameter) for every parameter, each tied one once."""
    seen = set()
    for name, p in model.hf_model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def _names(model) -> dict[int, str]:
    return {id(p): name for name, p in _named_masters(model)}


def _optimizer_state_by_name(optimizers, names: dict[int, str]) -> dict:
    by_name = {}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            by_name[names[id(p)]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return by_name


def _load_optimizer_state_by_name(optimizers, names: dict[int, str], by_name: dict) -> None:
    # Rebuilt in torch's own (index-keyed) format so `load_state_dict` applies torch's rules
    # for where each state tensor lives (fused kernels keep `step` on the device, others on CPU).
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state_dict = optimizer.state_dict()
        state_dict["state"] = {i: by_name[names[id(p)]] for i, p in enumerate(params) if names[id(p)] in by_name}
        optimizer.load_state_dict(state_dict)


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])


# ------------------------------------------------------------------------------ files


def save(state: dict, directory: Path, keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{state['step']:08d}.pt"
    atomic_write(final, lambda f: torch.save(state, f))
    _prune(directory, keep)
    return final


def atomic_write(final: Path, write) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if NAME.match(p.name))


def latest_under(path: Path, listing) -> Path | None:
    """The newest checkpoint `listing` finds in `path` itself or in its checkpoints folder
    (so `path` may be a checkpoints folder or a run directory); None when there is none."""
    for directory in (path, checkpoint_dir(path)):
        found = listing(directory)
        if found:
            return found[-1]
    return None


def find(resume: str, run_dir: Path) -> Path | None:
    """`auto`: the latest checkpoint of this run directory, None if there is none yet (a fresh
    start, so one command serves the first launch and every relaunch). Otherwise a checkpoint
    file, a checkpoints directory, or a run directory (its latest)."""
    if resume == "auto":
        return latest_under(run_dir, list_checkpoints)
    path = Path(resume).expanduser()
    if path.is_file():
        return path
    if (path / "manifest.json").is_file():
        raise ConfigError(f"train.resume={resume} is a pipeline checkpoint (one part per stage); "
                          f"resume it with the strategy that wrote it (strategy=pipe_flush or pipe_2bw)")
    latest = latest_under(path, list_checkpoints)
    if latest is not None:
        return latest
    raise ConfigError(f"train.resume={resume}: no checkpoint there; give a step-*.pt file, its directory or a run directory")


def load(path: Path, cfg) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated or foreign file: torch raises many kinds
        raise ConfigError(f"checkpoint {path} cannot be read ({type(err).__name__}); it is corrupt or not a "
                          f"relaytrain checkpoint: resume from an earlier one") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} is not a relaytrain checkpoint (format {FORMAT})")
    mismatched = {k: (v, identity(cfg)[k]) for k, v in state["identity"].items() if identity(cfg)[k] != v}
    if mismatched:
        diffs = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in mismatched.items())
        raise ConfigError(f"checkpoint {path} does not fit this config ({diffs}); resume with the config it was saved with")
    if state["step"] >= cfg.train.steps:
        raise ConfigError(f"checkpoint {path} is at step {state['step']}, not before train.steps={cfg.train.steps}; "
                          f"raise train.steps to train further")
    return state
