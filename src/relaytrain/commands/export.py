"""`relaytrain export`: a Hugging Face model directory from what training left behind.

    relaytrain export model.pretrained=SOURCE out=DIR [dtype=auto] [base=DIR] [merge=true]

SOURCE is either
- a peft LoRA adapter directory (a run's model/ saved with adapter=lora or qlora, or any peft
  adapter): merged into its base by peft's own `merge_and_unload`, on the base's original
  (unquantized) weights in fp32. The base is the one adapter_config.json names
  (base_model_name_or_path; one a run saved beside the adapter), or `base=DIR`;
- a training checkpoint of any strategy: a step-N directory, its checkpoints directory or a run
  directory (its newest complete checkpoint). The model is the one the run's recorded config
  (RUN_DIR/.hydra) builds, with the checkpoint's weights, written as `train.save_model` writes
  it (an adapter run's: its adapter, or with merge=true the adapter merged into its base).

The weights go out in `dtype` (auto: the base checkpoint's own dtype, else float32), with the
tokenizer and a generation config that stops where a chat turn ends. DIR must not exist yet, or
be empty: it is written beside (.DIR.partial) and renamed once complete. Every mistake is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from relaytrain.models import adapter as adapters
from relaytrain.records import checkpoint
from relaytrain.records.export import SAVE_DTYPES, write_merged_adapter, write_model
from relaytrain.utils.errors import ConfigError, first_line

KEYS = ("model.pretrained", "out", "dtype", "base", "merge")
DTYPES = ("auto", *SAVE_DTYPES)
SOURCES = ("a LoRA adapter directory (adapter_config.json), or a training checkpoint: a step-N directory, "
           "its checkpoints directory or a run directory")

EXPORT_USAGE = "relaytrain export model.pretrained=SRC out=DIR [dtype=auto] [base=DIR] [merge=true]"
EXPORT_HELP = f"""\
usage: {EXPORT_USAGE}

Write a Hugging Face model directory (AutoModel*.from_pretrained, AutoTokenizer.from_pretrained and
`relaytrain generate` load it as it is) from what training left behind. SRC is one of:
  a LoRA adapter directory   a run's model/ (adapter=lora or qlora) or any peft adapter: merged into
                             its base by peft's own merge_and_unload, on the base's original
                             (unquantized) fp32 weights; the base is the one adapter_config.json names
  a training checkpoint      a step-N directory, its checkpoints directory or a run directory (its
                             newest complete checkpoint), of any strategy: the model the run's
                             recorded config (RUN_DIR/.hydra) builds, with the checkpoint's weights

keys:
  model.pretrained=SRC  the adapter or checkpoint to export
  out=DIR               where the model goes: a new or empty directory
  dtype=NAME            auto (default: the base checkpoint's own dtype, else float32), float32,
                        bfloat16 or float16
  base=DIR              an adapter's base, where adapter_config.json names none or one since moved
  merge=true|false      an adapter run's checkpoint: merge the adapter into its base (default: as
                        the run saved its model, adapter.merge_on_save)

examples:
  relaytrain export model.pretrained=runs/lora/model out=runs/lora/merged
  relaytrain export model.pretrained=runs/lora/model base=~/models/Qwen3-0.6B out=merged dtype=bfloat16
  relaytrain export model.pretrained=runs/fsdp out=runs/fsdp/export             # its newest checkpoint
  relaytrain export model.pretrained=runs/lora/checkpoints/step-00000100 merge=true out=merged-100
"""


@dataclass(frozen=True)
class Request:
    """One `relaytrain export` call, checked."""

    source: Path
    out: Path
    dtype: str = "auto"  # auto: the base checkpoint's dtype, else float32
    base: str | None = None  # an adapter's base, instead of the one adapter_config.json names
    merge: bool | None = None  # an adapter run's checkpoint: merged (None: as the run saved its model)


def parse_request(items: list[str]) -> Request:
    """The KEY=VALUE arguments of `relaytrain export`, each checked; a mistake is one line."""
    from relaytrain.commands.generate import key_values

    given = key_values(items, KEYS, "export", "out=merged")
    for key, what in (("model.pretrained", SOURCES), ("out", "the directory to write the model into")):
        if not given.get(key):
            raise ConfigError(f"{key}=DIR is required: {what}")
    if given.get("dtype", "auto") not in DTYPES:
        raise ConfigError(f"dtype={given['dtype']} must be one of {', '.join(DTYPES)}")
    if given.get("merge", "true") not in ("true", "false"):
        raise ConfigError(f"merge={given['merge']} must be true or false")
    return Request(source=Path(given["model.pretrained"]).expanduser(), out=Path(given["out"]).expanduser(),
                   dtype=given.get("dtype", "auto"), base=given.get("base") or None,
                   merge=None if "merge" not in given else given["merge"] == "true")


def export(request: Request) -> str:
    """Write the model `request` asks for into request.out; returns the line that says what went where."""
    kind, source = _what_is(request.source)
    if request.base and kind != "adapter":
        raise ConfigError(f"base={request.base} names an adapter's base; model.pretrained={request.source} is a "
                          f"checkpoint, whose run's config names its model")
    if request.merge is False and kind == "adapter":
        raise ConfigError(f"merge=false: model.pretrained={request.source} is an adapter, which export merges into "
                          f"its base; drop merge (the adapter directory is yours already)")
    if request.base and not Path(request.base).expanduser().is_dir():
        raise ConfigError(f"base={request.base} is not a directory; give the base model's directory")
    staging = _prepare_out(request.out)
    try:
        said = (_export_adapter if kind == "adapter" else _export_checkpoint)(source, request, staging)
        if request.out.is_dir():  # empty (checked): the finished directory takes its place
            request.out.rmdir()
        os.replace(staging, request.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return said


def _what_is(source: Path) -> tuple[str, Path]:
    """("adapter", its directory) or ("checkpoint", the step-N directory) for what was given."""
    if not source.exists():
        raise ConfigError(f"model.pretrained={source} does not exist; give {SOURCES}")
    if adapters.is_adapter_dir(str(source)):
        return "adapter", source
    if checkpoint.STEP.match(source.name) and source.is_dir():
        if (problem := checkpoint.damage(source)) is not None:
            raise ConfigError(f"model.pretrained={source}: this checkpoint is damaged ({problem}); export an "
                              f"earlier one, or its run directory (the newest complete one)")
        return "checkpoint", source
    if (newest := checkpoint.latest(source)) is not None:
        return "checkpoint", newest
    if adapters.is_adapter_dir(str(source / "model")):  # a run without checkpoints that saved its adapter
        return "adapter", source / "model"
    if (source / "config.json").is_file():
        raise ConfigError(f"model.pretrained={source} is a Hugging Face model directory already; nothing to "
                          f"export (give {SOURCES})")
    raise ConfigError(f"model.pretrained={source} is neither {SOURCES.replace(', or ', ', nor ')}")


def _prepare_out(out: Path) -> Path:
    """The staging directory beside `out`, which must not exist or be an empty directory."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; give a directory to write the model into")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"out={out} is not empty; give a new directory, or empty it")
    staging = out.with_name(f".{out.name}.partial")
    try:
        shutil.rmtree(staging, ignore_errors=True)  # left by an export that was killed
        staging.mkdir(parents=True)
    except OSError as err:
        raise ConfigError(f"out={out} cannot be written ({err.strerror or err}: {err.filename}); "
                          f"give a directory you can write to") from err
    return staging


# ----------------------------------------------------------------------------- an adapter


def _export_adapter(adapter_dir: Path, request: Request, out: Path) -> str:
    """peft's merge of the adapter into its base's original weights, written into `out`."""
    from relaytrain.commands.generate import adapter_base_of

    base = request.base or adapter_base_of(str(adapter_dir), "give its base with base=DIR")
    recorded = _recorded_model_keys(adapter_dir)
    base_hf = _load_base(base, adapter_dir, recorded)
    dtype = request.dtype if request.dtype != "auto" else _stored_dtype(base_hf.config)
    write_merged_adapter(adapter_dir, base_hf, out, dtype, _tokenizer(adapter_dir, base))
    what = f"{adapter_dir} merged into its base {base} (peft's merge_and_unload, {dtype})"
    if str(recorded.get("quantize", "none")) != "none":
        what += (f"; merged into the original (unquantized) weights: the adapter trained over their "
                 f"{recorded['quantize']} quantization")
    return _said(what, request.out, base_hf.can_generate())


def _recorded_model_keys(adapter_dir: Path) -> dict:
    """The model keys of the run whose model/ the adapter is (RUN_DIR/.hydra/config.yaml), {} for
    an adapter from elsewhere: whether it trained over a 4-bit base, a classifier's labels."""
    recorded = adapter_dir.parent / ".hydra" / "config.yaml"
    if adapter_dir.name != "model" or not recorded.is_file():
        return {}
    return (yaml.safe_load(recorded.read_text()) or {}).get("model") or {}


def _load_base(base: str, adapter_dir: Path, recorded: dict):
    """The base in fp32 under the head the adapter was trained with (peft's task_type; the base's
    own head where the adapter names none), its original weights: a base stored in 4 bits has
    none to merge into."""
    import transformers

    from relaytrain.commands.generate import quiet_transformers
    from relaytrain.models.pretrained import checkpoint_objective, load_hf_config
    from relaytrain.objectives import objectives

    try:
        config = load_hf_config(base)
    except ConfigError as err:  # its words name model.pretrained: here that is the adapter
        raise ConfigError(f"model.pretrained={adapter_dir}: its base {base} cannot be read ({err}); "
                          f"give it with base=DIR") from err
    if getattr(config, "quantization_config", None) is not None:
        raise ConfigError(f"the adapter's base {base} is stored quantized: there are no original weights to merge "
                          f"into; give the bf16/fp32 checkpoint with base=DIR")
    task_type = adapters.saved_config(str(adapter_dir)).get("task_type")
    trained = next((spec for spec in objectives().values() if task_type and spec.peft_task_type == task_type),
                   None) or checkpoint_objective(config)
    if trained is None:
        raise ConfigError(f"model.pretrained={adapter_dir}: neither the adapter (task_type) nor its base {base} "
                          f"says which head it trains; set task_type in its adapter_config.json")
    labels = {"num_labels": recorded.get("num_labels", config.num_labels)} if trained.classifies else {}
    quiet = quiet_transformers()
    try:
        return getattr(transformers, trained.head).from_pretrained(base, dtype=torch.float32, **labels)
    except (OSError, ValueError) as err:
        raise ConfigError(f"the adapter's base {base} could not be loaded ({first_line(err)}); give it with base=DIR"
                          ) from err
    finally:
        quiet()


def _stored_dtype(hf_config) -> str:
    """The dtype a checkpoint stores its weights in, where export can write it; else float32."""
    stored = str(getattr(hf_config, "dtype", None) or "float32").removeprefix("torch.")
    return stored if stored in SAVE_DTYPES else "float32"


def _tokenizer(adapter_dir: Path, base: str):
    """The adapter's tokenizer (a run saves it there), else its base's; None when neither has one."""
    from transformers import AutoTokenizer

    from relaytrain.data.tokenizer import may_hold_tokenizer

    for source in (str(adapter_dir), base):
        if may_hold_tokenizer(source):
            try:
                return AutoTokenizer.from_pretrained(source)
            except (OSError, ValueError):
                continue  # a base given by hub id while offline, say: the model still goes out
    return None


# ----------------------------------------------------------------------------- a checkpoint


def _export_checkpoint(step: Path, request: Request, out: Path) -> str:
    """The model the run's recorded config builds, with the checkpoint's weights, written into `out`."""
    from relaytrain.models import build_model

    run_dir, cfg = _recorded_config(step)
    if request.dtype != "auto":
        cfg.train.save_dtype = request.dtype
    if request.merge is not None:
        if not adapters.enabled(cfg.adapter):
            raise ConfigError(f"merge={str(request.merge).lower()}: {step} is a full fine-tune's checkpoint; "
                              f"there is no adapter to merge (drop merge)")
        cfg.adapter.merge_on_save = request.merge
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    ours = checkpoint.identity(cfg)
    diffs = [f"{k}: checkpoint {v} vs recorded config {ours.get(k)}" for k, v in manifest["identity"].items()
             if ours.get(k) != v]
    if diffs:
        raise ConfigError(f"{step} does not fit its run's recorded config ({', '.join(diffs)}); export it from the "
                          f"run directory it was saved in")
    model = build_model(cfg.model, cfg.train.seed, quiet=True, adapter=cfg.adapter)
    names = [name for name, _ in checkpoint.trained_named_parameters(model)]
    with warnings.catch_warnings():  # a sharded checkpoint is read whole here, by one process: as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        weights = checkpoint.Checkpoint(step, manifest, exact=False).state_for(names, rank=0)["weights"]
    write_model(cfg, model, weights, run_dir, out, merge_key="relaytrain export merge=true")
    return _said(f"step {manifest['step']} of {run_dir} (strategy={manifest['strategy']}) as {_form(cfg, out)}",
                 request.out, _generates(cfg))


def _recorded_config(step: Path):
    """The run directory of the checkpoint `step` and the config the run was launched with: its
    recorded overrides (RUN_DIR/.hydra, paths anchored where it started) composed again, resolved."""
    from relaytrain.models.pretrained import explicit_overrides, resolve
    from relaytrain.run import dirs as run_dirs
    from relaytrain.run.compose import compose

    run_dir = run_dirs.run_dir_of(str(step))
    if not (run_dir / run_dirs.RECORD).is_file():
        raise ConfigError(f"model.pretrained={step}: {run_dir} holds no recorded config ({run_dirs.RECORD}) to "
                          f"build its model from; export the checkpoint from the run directory it was saved in")
    overrides = run_dirs.recorded_overrides([f"train.resume={step}"], say=lambda line: None)
    return run_dir, resolve(compose(overrides), explicit_overrides(overrides))


def _form(cfg, out: Path) -> str:
    from relaytrain.records.export import save_dtype

    if not adapters.enabled(cfg.adapter):
        return f"a model directory ({save_dtype(cfg)})"
    if cfg.adapter.merge_on_save:
        return f"its adapter merged into its base (peft's merge_and_unload, {save_dtype(cfg)})"
    return f"a peft adapter over {adapters.adapter_base(str(out))} (merge=true merges it)"


def _generates(cfg) -> bool:
    from relaytrain.run.resolve import choose

    return choose(cfg).objective.predicts_next_token


def _said(what: str, out: Path, generates: bool) -> str:
    line = f"exported {what} to {out}"
    return line + (f"; try: relaytrain generate model.pretrained={out} prompt=Hello" if generates else "")
