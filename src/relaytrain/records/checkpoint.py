"""Checkpoints that lose nothing, for every strategy: atomic, exact, keyed by parameter name.

    RUN_DIR/checkpoints/step-00000010/        complete: manifest.json, trainer.pt, part-0.pt ... part-{n-1}.pt
    RUN_DIR/checkpoints/step-00000020.parts/  a save in progress, or one a crash cut short: ignored

Every process writes its *share* (`Strategy.state_dict()` plus its RNG streams; on disk
`part-R.pt`, the name every checkpoint so far has, and `step-N.parts/` while staged): weights and
optimizer state keyed by Hugging Face parameter name, the loss scaler, and the strategy's own
name-keyed sections (`extra`, e.g. 2BW's second weight version). The reporting process also
writes `trainer.pt` (the step, the data position, the optimizer updates applied, which place
the LR schedule, and the run's history). Each file is written
atomically (temporary file, fsync, rename); after a barrier, rank 0 writes the manifest (what
was saved, by which config and layout, every file's size) and renames the directory: a
`step-N` directory whose manifest's files are all there, at their recorded sizes, is a
complete checkpoint, and nothing else is.

Loading reads only what a process needs: every share is opened with `mmap` (and
`weights_only=True`), so a process picks its parameters by name from whichever shares hold
them. That is why checkpoints are strategy-neutral: a baseline checkpoint resumes under
`l2l`, a 2-stage pipeline's under 3 stages or under `l2l`. Under the same strategy and layout
the resume is exact, RNG streams included; otherwise weights, optimizer state and the step are
exact, and the RNG streams start afresh (this is said in one line).

A strategy whose state is sharded across its processes (FSDP: `Strategy.sharded_state_dict`)
has it written by every process together with `torch.distributed.checkpoint` into the
checkpoint's `sharded/` directory, keyed by the same names (optimizer state under
optimizer/<name>/<state>); its shares keep the rest. The manifest lists those files too, so
completeness means the same. A reader that is not sharded gets whole tensors by name from it
(`state_for`), and a sharded one loads it straight into its shards, on any number of processes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from relaytrain.records.optimizer_state import load_optimizer_state, optimizer_state
from relaytrain.step.lowbit import moment_like
from relaytrain.utils import failpoints
from relaytrain.utils.errors import CheckpointWriteFailed, ConfigError, first_line
from relaytrain.utils.files import atomic_write, crc32_of, fsync_dir, write_json

FORMAT = 2
MANIFEST = "manifest.json"
TRAINER = "trainer.pt"
BEST = "best.json"  # in the checkpoints directory: the step `train.keep_best` keeps
STEP = re.compile(r"^step-(\d{8})$")
STAGING = re.compile(r"^step-(\d{8})\.parts$")
NAME_KEYED = ("weights", "optimizer")  # share sections merged by parameter name (plus every `extra` section)
SHARDED = "sharded"  # the directory of a sharded strategy's state (torch.distributed.checkpoint)
OPTIMIZER_PREFIX = "optimizer/"  # a sharded key of optimizer state: optimizer/<name>/<state>


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def share_file(rank: int) -> str:
    """The file of process `rank`'s share ("part-R.pt": kept, so that older checkpoints still read)."""
    return f"part-{rank}.pt"


# ------------------------------------------------------------------------------ contents by name


def unique_named_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(Hugging Face name, parameter) for every parameter the layered model holds, each tied one once."""
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield model.hf_name(p), p


def trained_named_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) for every parameter that trains: what a checkpoint holds. Under adapters
    the frozen base is left out (it is `model.pretrained` again on resume, `identity` checks it)."""
    return ((name, p) for name, p in unique_named_parameters(model) if p.requires_grad)


def model_state(model, params, optimizers, scaler, name_of=None) -> dict:
    """A process's share for a strategy whose weights are the layered model's own parameters:
    `params` (by name), the optimizers' state for them, the loss scaler. `name_of`: the name of
    a parameter an optimizer steps, where it is not the model's own (bf16 masters' stand-ins)."""
    return {
        "weights": {model.hf_name(p): p.detach().cpu().clone() for p in params},
        "optimizer": optimizer_state(optimizers, name_of or model.hf_name),
        "scaler": scaler.state_dict(),
        "extra": None,
    }


def load_model_state(model, optimizers, scaler, state: dict, name_of=None) -> None:
    """The inverse of `model_state`, for every parameter that trains (each tied one once)."""
    with torch.no_grad():
        for name, p in trained_named_parameters(model):
            p.copy_(state["weights"][name])
    load_optimizer_state(optimizers, name_of or model.hf_name, state["optimizer"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


def rng_state(device: torch.device) -> dict:
    """This process's RNG streams: the CPU one, its own GPU's, and Python's."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])


def identity(cfg) -> dict:
    """What must match for a checkpoint to fit a run: the model's shape and the update rule."""
    m = cfg.model
    return {
        "family": str(m.family), "task": str(m.task), "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "num_heads": m.num_heads, "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
        "optim": str(cfg.optim.name), "precision": str(cfg.precision.name), **_adapter_identity(cfg),
        **_state_bits_identity(cfg.optim),
    }


def _state_bits_identity(o) -> dict:
    """AdamW's moments in 8 or 4 bits (`optim.state_bits`): a checkpoint of them fits only a run that
    keeps them so; nothing for fp32 moments, so other checkpoints keep their identity."""
    bits = o.get("state_bits", 32)  # read here, not through lowbit.state_bits: the config's walk stays short
    return {"state_bits": bits} if bits != 32 else {}


def _adapter_identity(cfg) -> dict:
    """An adapter run's shape (its checkpoint holds only the adapters); nothing without one, so
    checkpoints of full fine-tunes keep their identity."""
    a = getattr(cfg, "adapter", None)
    if a is None or str(a.name) == "none":
        return {}
    return {"adapter": str(a.name), "adapter_r": a.r if not a.pretrained else "pretrained"}


# ------------------------------------------------------------------------------ writing


def save(world, directory: Path, step: int, share: dict, trainer: dict | None, manifest: dict, keep: int,
         best: bool = False, sharded: dict | None = None) -> Path:
    """Write this process's share (every process calls this at the same step) and, on the
    process given `trainer`, the trainer's state; rank 0 publishes once all are on disk.
    `best`: the checkpoint also becomes the best one, kept beside the latest `keep`.
    `sharded`: this process's shards (every process gives them), saved together.
    A write that fails (a full disk) is one line naming the newest complete checkpoint."""
    staging = _staging_dir(directory, step)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if sharded is not None:
            dcp.save(sharded, checkpoint_id=staging / SHARDED)
        sums = {share_file(world.rank): atomic_write(staging / share_file(world.rank), lambda f: torch.save(share, f))}
        if trainer is not None:
            sums[TRAINER] = atomic_write(staging / TRAINER, lambda f: torch.save(trainer, f))
        failpoints.reach("checkpoint", step, world.rank)
    except (OSError, CheckpointException) as err:  # the staging goes once every process has ended
        why = f"{err.strerror or err}: {err.filename or staging}" if isinstance(err, OSError) else first_line(err)
        raise CheckpointWriteFailed(f"the checkpoint of step {step} could not be written ({why}); "
                                    f"{continue_from(latest(directory), 'make room')}") from err
    gathered = world.gather(sums, 0)  # on rank 0 once every share is on disk
    if world.rank == 0:
        publish(directory, step, {**manifest, "processes": world.size}, keep,
                checksums={name: crc for each in gathered for name, crc in each.items()})
        if best:
            write_json(Path(directory) / BEST, {"step": step}, indent=None)
    world.barrier()  # and the checkpoint is complete before any process may report it
    return step_dir(directory, step)


def best_step(directory: Path) -> int | None:
    """The step of the checkpoint `train.keep_best` keeps, None when there is none."""
    try:
        return int(json.loads((Path(directory) / BEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def publish(directory: Path, step: int, contents: dict, keep: int, checksums: dict[str, int]) -> Path:
    """Make the staged files of `step` a complete checkpoint; call once every file is written.
    `checksums`: the CRC-32 of each share and of the trainer's file, as their writers summed them
    (a sharded directory's files are summed here). Older complete ones beyond the newest `keep`
    are removed, except the best one."""
    staging, final = _staging_dir(directory, step), step_dir(directory, step)
    files = [share_file(rank) for rank in range(contents["processes"])] + [TRAINER]
    if (staging / SHARDED).is_dir():
        sharded = sorted(f.relative_to(staging).as_posix() for f in (staging / SHARDED).iterdir())
        checksums = {**checksums, **{name: crc32_of(staging / name) for name in sharded}}
        files += sharded
    record = {**contents, "format": FORMAT, "step": step, "sharded": (staging / SHARDED).is_dir(),
              "files": {name: (staging / name).stat().st_size for name in files},
              "checksums": {name: checksums[name] for name in files}}
    write_json(staging / MANIFEST, record)
    if final.exists():  # saved before by a run that was resumed from an earlier step
        _remove(final)
    os.replace(staging, final)
    fsync_dir(directory)
    kept = step_dir(directory, best) if (best := best_step(directory)) is not None else None
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        if old != kept:
            _remove(old)
    return final


def remove_staging(directory: Path) -> None:
    """Drop the files of saves a crash cut short (before any process writes new ones)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if STAGING.match(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _staging_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.parts"


def _remove(path: Path) -> None:
    (path / MANIFEST).unlink(missing_ok=True)  # first: from here on it is incomplete
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------ finding


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not Path(directory).is_dir():
        return []
    return sorted(p for p in Path(directory).iterdir() if STEP.match(p.name) and is_complete(p))


def is_complete(path: Path) -> bool:
    """Every file the manifest lists is there at its recorded size (cheap: nothing is read)."""
    return damage(path, read=False) is None


def damage(path: Path, read: bool = True) -> str | None:
    """What is wrong with a checkpoint's files (None: intact): a file missing, cut short, or,
    with `read`, whose CRC-32 is not the one its writer recorded (every byte is read)."""
    try:
        record = json.loads((path / MANIFEST).read_text())
        if record["format"] != FORMAT:
            return f"its manifest is not of format {FORMAT}"
        files, sums = dict(record["files"]), record.get("checksums", {})  # checkpoints before checksums: sizes only
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its manifest cannot be read ({type(err).__name__})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is cut short ({file.stat().st_size} of {size} bytes)"
        if read and name in sums and crc32_of(file) != sums[name]:
            return f"{name} does not match its checksum"
    return None


def continue_from(newest: Path | None, fix: str = "") -> str:
    """How a run that failed goes on: from `newest`, the newest complete checkpoint, after `fix`."""
    if newest is None:
        return "no checkpoint was saved" + (f": {fix} and start again" if fix else "")
    return f"the newest complete checkpoint is {newest}: {fix + ', then ' if fix else ''}continue with train.resume={newest}"


def newest_intact(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of a run directory whose every file is intact, and a line for
    each newer one passed over (corrupt or cut short: a disk fault, or a copy interrupted)."""
    for directory in (Path(run_dir), checkpoint_dir(run_dir)):
        steps = sorted(p for p in directory.iterdir() if STEP.match(p.name)) if directory.is_dir() else []
        passed: list[str] = []
        for path in reversed(steps):
            problem = damage(path)
            if problem is None:
                return path, passed
            passed.append(f"{path.name} is damaged ({problem})")
        if passed:
            return None, passed
    return None, []


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (or of a checkpoints directory)."""
    for directory in (Path(run_dir), checkpoint_dir(run_dir)):
        found = list_checkpoints(directory)
        if found:
            return found[-1]
    return None


def find(resume: str, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, and a line for each newer damaged one passed over.
    `auto`: the newest intact checkpoint of this run directory, None if there is none yet (a
    fresh start, so one command serves the first launch and every relaunch). Otherwise a step-N
    directory (refused if damaged), a checkpoints directory or a run directory (its latest)."""
    if resume == "auto":
        return newest_intact(run_dir)
    path = Path(resume).expanduser()
    if STEP.match(path.name) and path.is_dir():
        problem = damage(path)
        if problem is not None:
            raise ConfigError(f"train.resume={resume}: this checkpoint is damaged ({problem}); "
                              f"resume from an earlier one, or with train.resume=auto (the newest intact one)")
        return path, []
    if path.is_file():
        raise ConfigError(f"train.resume={resume} is a file; give a checkpoint directory (step-N), "
                          f"its checkpoints directory or a run directory")
    found = latest(path)
    if found is not None:
        return found, []
    raise ConfigError(f"train.resume={resume}: no complete checkpoint there; give a step-N directory, "
                      f"its checkpoints directory or a run directory")


# ------------------------------------------------------------------------------ loading


@dataclass
class Checkpoint:
    """A complete checkpoint, checked against the run's config; reads shares lazily."""

    path: Path
    manifest: dict
    exact: bool  # same strategy and layout: every process finds its own share (RNG streams included)

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def strategy(self) -> str:
        return self.manifest["strategy"]

    @property
    def sharded(self) -> bool:
        """Whether a sharded strategy's state is in `sharded_dir` rather than in the shares."""
        return bool(self.manifest.get("sharded"))

    @property
    def sharded_dir(self) -> Path:
        return self.path / SHARDED

    def trainer(self) -> dict:
        return _load(self.path / TRAINER)

    def applied_updates(self) -> int:
        """Optimizer updates applied up to this step (the LR schedule's position): the step less
        the steps an fp16 overflow skipped. Checkpoints from before the count was saved give it
        from their history's skipped steps (any process may read trainer.pt)."""
        trainer = self.trainer()
        if "applied_updates" in trainer:
            return trainer["applied_updates"]
        return self.step - trainer.get("history", {}).get("skipped", 0)

    def rng(self, rank: int) -> dict | None:
        return _load(self.path / share_file(rank))["rng"] if self.exact else None

    def state_for(self, names: list[str], rank: int) -> dict:
        """`weights`, `optimizer` and every `extra` section, for `names`, from whichever shares hold
        them; `scaler` from any share. `extra` is None unless the resume is exact."""
        wanted = set(names)
        out: dict = {"weights": {}, "optimizer": {}, "scaler": None, "extra": {} if self.exact else None}
        shares = [f for f in self.manifest["files"] if f.startswith("part-")]
        own = share_file(rank)
        for name in sorted(shares, key=lambda f: f != own):  # its own share first, where it has one
            share = _load(self.path / name)
            for section in NAME_KEYED:
                out[section].update({k: v for k, v in share[section].items() if k in wanted})
            if self.exact:
                for section, values in (share["extra"] or {}).items():
                    out["extra"].setdefault(section, {}).update({k: v for k, v in values.items() if k in wanted})
            out["scaler"] = out["scaler"] or share["scaler"]
            if wanted <= out["weights"].keys():  # a parameter's sections live in the share that holds it
                break
        if self.sharded:
            weights, optimizer = read_sharded(self.sharded_dir, wanted - out["weights"].keys(),
                                              self.manifest["identity"].get("state_bits", 32))
            out["weights"].update(weights)
            out["optimizer"].update(optimizer)
        missing = sorted(wanted - out["weights"].keys())
        if missing:
            raise ConfigError(f"checkpoint {self.path} holds no weights for {missing[0]} (and {len(missing) - 1} more); "
                              f"resume with the model it was saved with")
        return out


def read(path: Path, ours: dict, steps: int, strategy: str, layout: dict, base: str | None = None) -> Checkpoint:
    """The checkpoint at `path`, refused with one line unless it fits a run of `identity` `ours`
    and train.steps=`steps` (and, given the fingerprint of the frozen `base` adapters train on,
    unless it was made on that base); exact under the run's `strategy` and `layout`."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint {path} has no readable manifest ({type(err).__name__}); resume from another") from err
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} is not a relaytrain checkpoint (format {FORMAT}); resume from another")
    misfit = _misfit(manifest["identity"], ours)
    if misfit:
        raise ConfigError(f"checkpoint {path} {misfit}")
    if base is not None and not _same_base(manifest.get("base"), base):
        raise ConfigError(f"checkpoint {path} holds adapters trained on another base (fingerprint "
                          f"{manifest.get('base')}, this model.pretrained gives {base}); resume with the base it was made on")
    if manifest["step"] >= steps:
        raise ConfigError(f"checkpoint {path} is at step {manifest['step']}, not before train.steps={steps}; "
                          f"raise train.steps to train further")
    exact = manifest["strategy"] == strategy and _renamed(manifest["layout"]) == layout
    return Checkpoint(path, manifest, exact)


def _misfit(saved: dict, ours: dict) -> str | None:
    """Why a checkpoint's identity does not fit this config's (None: it fits). Whether adapters
    trained comes first: a full fine-tune's identity has no adapter keys at all."""
    if ("adapter" in saved) != ("adapter" in ours):
        if "adapter" in saved:
            return f"holds {saved['adapter']} adapters, but this config trains every weight; resume with adapter={saved['adapter']}"
        return f"holds a full fine-tune (every weight), but this config has adapter={ours['adapter']}; resume with adapter=none"
    diffs = [f"{k}: checkpoint {v} vs config {ours.get(k)}" for k, v in saved.items() if ours.get(k) != v]
    return f"does not fit this config ({', '.join(diffs)}); resume with the config it was saved with" if diffs else None


def _same_base(written: str | None, base: str) -> bool:
    """The manifest's base fingerprint against this run's: every byte hashed, or in a checkpoint
    written before that, 64 values a tensor (`models.adapter.fingerprint`)."""
    from relaytrain.models.adapter import same_base

    return same_base(written, base)


# Layout keys renamed since checkpoints were first written: an older manifest still resumes exactly.
RENAMED_LAYOUT_KEYS = {"eps": "eps_state"}  # L2L's placement of the param server's state


def _renamed(layout: dict) -> dict:
    return {RENAMED_LAYOUT_KEYS.get(key, key): value for key, value in layout.items()}


def sharded_contents(directory: Path) -> dict:
    """What a sharded checkpoint holds: its keys, each with torch.distributed.checkpoint's metadata."""
    try:
        return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as err:  # a missing or corrupt metadata file: torch raises many kinds
        raise ConfigError(f"checkpoint {directory} cannot be read ({type(err).__name__}); it is corrupt: "
                          f"resume from an earlier checkpoint") from err


def read_sharded(directory: Path, names: set[str], state_bits: int = 32) -> tuple[dict, dict]:
    """Whole tensors by name from a sharded checkpoint, on one process (no process group): the
    weights of `names`, and their optimizer state by name and state (AdamW's moments in
    `state_bits`: torchao's codes and scales read whole, as they were saved)."""
    stored = sharded_contents(directory)
    wanted = [key for key in stored if key in names or
              (key.startswith(OPTIMIZER_PREFIX) and key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)[0] in names)]
    # A tensor is read into a whole one of its size; anything else comes back in the dict.
    state = {key: _whole_like(key, stored[key], state_bits) if hasattr(stored[key], "size") else None for key in wanted}
    if state:
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    weights = {key: value for key, value in state.items() if not key.startswith(OPTIMIZER_PREFIX)}
    optimizer: dict = {}
    for key, value in state.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, field = key[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
            optimizer.setdefault(name, {})[field] = value
    return weights, optimizer


def _whole_like(key: str, stored, state_bits: int) -> torch.Tensor:
    """An empty whole tensor to read sharded checkpoint entry `key` into (metadata `stored`)."""
    field = key.rsplit("/", 1)[1] if key.startswith(OPTIMIZER_PREFIX) else None
    return moment_like(stored.size, state_bits, field, stored.properties.dtype)


def _load(file: Path) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated or foreign file: torch raises many kinds
        raise ConfigError(f"checkpoint file {file} cannot be read ({type(err).__name__}); it is corrupt: "
                          f"resume from an earlier checkpoint") from err
