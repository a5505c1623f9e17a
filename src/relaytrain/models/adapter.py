"""`adapter=lora`: low-rank adapters through Hugging Face's peft, on any family's blocks.

peft injects its LoRA layers into the Hugging Face model in place (`inject_adapter_in_model`):
each targeted linear layer becomes a `lora.Linear` holding the original as `base_layer` and the
adapters `lora_A`/`lora_B`. The layered model's blocks are the same module objects, so every
strategy runs the adapted layers without knowing it; what a strategy must know is only which
parameters train (`requires_grad`): the adapters. Everything else is the frozen *base*: no
gradient, no optimizer state, no master copy, never sent back from the device.

Out: `save_adapter` writes the directory `PeftModel.from_pretrained(base, DIR)` loads
(`adapter_config.json`, `adapter_model.safetensors`); `merged_state` the full model with every
adapter folded into its base weight, for `adapter.merge_on_save=true`. In: `adapter.pretrained`
continues a peft adapter; one made for another base is refused in one line.

A checkpoint of an adapted run holds the adapters and their optimizer state only; the base is
reloaded from `model.pretrained`, and `base_fingerprint` (written in the checkpoint) makes
sure it is the base the adapters were trained on.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from relaytrain.errors import ConfigError, first_line

ADAPTER = "default"  # peft's adapter name: the one adapter a run trains
PEFT_PREFIX = "base_model.model."  # what PeftModel adds before the base model's names in its files
ALL_LINEAR = "all-linear"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def enabled(a) -> bool:
    return str(a.name) != "none"


def check(a, m, shapes=None) -> None:
    """The adapter keys on their own and against the model (`shapes`: the layered model on the
    meta device, for the target modules); ConfigError on the first problem."""
    if not enabled(a):
        return
    if a.r <= 0:
        raise ConfigError(f"adapter.r={a.r} must be a positive rank (e.g. adapter.r=8)")
    if a.alpha <= 0:
        raise ConfigError(f"adapter.alpha={a.alpha} must be positive (updates are scaled by alpha / r)")
    if not 0.0 <= a.dropout < 1.0:
        raise ConfigError(f"adapter.dropout={a.dropout} must be in [0, 1)")
    if str(m.task) == "classification":
        raise ConfigError("adapter=lora adapts language models (model.task=causal_lm or masked_lm); a new "
                          "classification head trains in full: use adapter=none")
    if a.pretrained and not (Path(a.pretrained).expanduser() / CONFIG_FILE).is_file():
        raise ConfigError(f"adapter.pretrained={a.pretrained} has no {CONFIG_FILE}; give a peft adapter directory "
                          f"(PeftModel.save_pretrained's, or a run's model/ directory saved with adapter=lora)")
    if shapes is not None and not a.pretrained and ALL_LINEAR not in a.target_modules:
        _target_names(shapes, list(a.target_modules))


def attach(model, a) -> None:
    """Inject the adapters into `model` (a LayeredModel) and freeze its base; with
    `adapter.pretrained`, load that adapter's weights. Sets `model.adapter` (the peft config)
    and `model.base_fingerprint`."""
    from peft import inject_adapter_in_model

    config = _peft_config(model, a)
    try:
        with quiet_peft():
            inject_adapter_in_model(config, model.hf_model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's NoMatchingPeftModuleError: the adapter's targets are not in this model
        raise ConfigError(f"adapter.pretrained={a.pretrained} was made for another base ({first_line(err)}); "
                          f"use the model.pretrained it was trained on") from err
    for name, p in model.hf_model.named_parameters():  # the adapters train, nothing else
        p.requires_grad_(_is_adapter(name))
        if _is_adapter(name) and p.is_floating_point() and p.dtype != torch.float32 and p.device.type != "meta":
            p.data = p.data.float()  # fp32 masters for the adapters, whatever the base is stored in
    model.rename_parameters()
    if a.pretrained and not _shapes_only(model):
        _load_adapter_weights(model, a.pretrained)
    object.__setattr__(model, "adapter", config)
    object.__setattr__(model, "base_fingerprint", base_fingerprint(model))


@contextmanager
def quiet_peft():
    """peft asks transformers a question transformers 5 deprecates (`is_gradient_checkpointing`):
    its FutureWarning says nothing to a user of relaytrain, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _shapes_only(model) -> bool:
    """A model on the meta device (a dry run, the planner's counts): no weights to load."""
    return any(p.device.type == "meta" for p in model.parameters())


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _peft_config(model, a):
    """peft's LoraConfig: the keys', or `adapter.pretrained`'s own (its rank, scaling, targets)."""
    from peft import LoraConfig

    if a.pretrained:
        config = LoraConfig.from_pretrained(str(Path(a.pretrained).expanduser()))
        config.inference_mode = False
        return config
    targets = _target_names(model, list(a.target_modules))
    conv1d = any(_is_conv1d(module) for module in targets.values())  # GPT-2 stores (in, out)
    return LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=_short_names(model, targets),
                      fan_in_fan_out=conv1d, bias="none")


def _target_names(model, wanted: list[str]) -> dict[str, nn.Module]:
    """The blocks' linear layers `wanted` names (by name ending; all-linear: every one), by full name."""
    names = {id(module): name for name, module in model.hf_model.named_modules()}
    linear = {names[id(module)]: module for block in model.blocks for module in block.layer.modules()
              if _is_linear(module)}
    if ALL_LINEAR in wanted:
        return linear
    chosen = {name: module for name, module in linear.items() if any(_ends_with(name, w) for w in wanted)}
    if not chosen:
        endings = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ConfigError(f"adapter.target_modules={wanted} matches no linear layer of the blocks; they end in "
                          f"{', '.join(endings)} (or use all-linear)")
    return chosen


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linear layers, weights stored (in, out))."""
    return type(module).__name__ == "Conv1D"


def _is_linear(module: nn.Module) -> bool:
    """A layer LoRA can adapt: a linear layer, or GPT-2's Conv1D."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _ends_with(name: str, ending: str) -> bool:
    return name == ending or name.endswith("." + ending)


def _short_names(model, targets: dict[str, nn.Module]) -> list[str]:
    """The targets as peft writes them in adapter_config.json: their name endings, where those
    name no other layer of the model (BERT's pooler is also a `dense`); else the full names."""
    endings = sorted({name.rsplit(".", 1)[-1] for name in targets})
    matched = {name for name, module in model.hf_model.named_modules()
               if any(_ends_with(name, e) for e in endings) and _is_linear(module)}
    return endings if matched == set(targets) else sorted(targets)


def _load_adapter_weights(model, directory: str) -> None:
    """A peft adapter's weights into the injected adapters, or one line when they do not fit."""
    from peft import set_peft_model_state_dict

    state = read_adapter_weights(directory)
    try:
        result = set_peft_model_state_dict(model.hf_model, state, adapter_name=ADAPTER)
    except RuntimeError as err:  # a size mismatch: another base's shapes
        raise ConfigError(f"adapter.pretrained={directory} was made for another base ({first_line(err)}); "
                          f"use the model.pretrained it was trained on") from err
    adapters = [name for name in model.hf_model.state_dict() if _is_adapter(name)]
    unexpected = [k for k in result.unexpected_keys if _is_adapter(k)]
    missing = [k for k in getattr(result, "missing_keys", []) if k in adapters]
    if unexpected or missing or not state:
        what = (unexpected or missing or ["no weights"])[0]
        raise ConfigError(f"adapter.pretrained={directory} was made for another base ({what} has no place in "
                          f"this model); use the model.pretrained it was trained on")


def read_adapter_weights(directory: str) -> dict[str, torch.Tensor]:
    """A peft adapter directory's weights, named as the base model names them (prefix removed)."""
    from safetensors.torch import load_file

    folder = Path(directory).expanduser()
    if (folder / WEIGHTS_FILE).is_file():
        state = load_file(str(folder / WEIGHTS_FILE))
    elif (folder / "adapter_model.bin").is_file():
        state = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"adapter.pretrained={directory} has no {WEIGHTS_FILE}; give a peft adapter directory")
    return {k.removeprefix(PEFT_PREFIX): v.float() for k, v in state.items()}


# --------------------------------------------------------------------------- what training keeps


def base_fingerprint(model) -> str:
    """A short hash of the frozen base: each frozen tensor's name, shape and 64 of its values
    spread over it. Two bases that differ anywhere a fine-tune touches differ here; computing
    it reads 64 values a tensor, not the model."""
    digest = hashlib.sha256()
    for name, p in model.hf_model.named_parameters():
        if p.requires_grad:
            continue
        digest.update(f"{name}:{tuple(p.shape)}".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)
            count = min(64, flat.numel())
            picks = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)  # integers: exact at any size
            digest.update(flat[picks].float().numpy().tobytes())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------- out


def peft_name(name: str) -> str:
    """An adapter parameter's name in peft's files: the PeftModel prefix, without the adapter name."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def save_adapter(model, out: Path, base: str | None, dtype: torch.dtype) -> None:
    """The adapter directory PeftModel.from_pretrained(base, out) loads: the config (with the base
    it was trained on) and the adapters' weights in `dtype`."""
    from safetensors.torch import save_file

    config = model.adapter
    config.base_model_name_or_path = base
    config.task_type = {"causal_lm": "CAUSAL_LM"}.get(model.task)
    config.inference_mode = True
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    weights = {peft_name(name): p.detach().to(dtype).contiguous()
               for name, p in model.hf_model.named_parameters() if _is_adapter(name)}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def merged_state(hf_model) -> dict[str, torch.Tensor]:
    """The model's state with every adapter folded into its base weight (W + scale B A), under
    the base model's own names: what `AutoModel*.from_pretrained` loads."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            with torch.no_grad():
                deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER)
    state = {}
    for name, t in hf_model.state_dict(keep_vars=True).items():
        if _is_adapter(name):
            continue
        plain = name.replace(".base_layer.", ".")
        state[plain] = t.detach().float() + deltas[plain].float() if plain in deltas else t  # folded in fp32
    return state


def adapter_base(directory: str) -> str | None:
    """The base model an adapter directory names (peft's `base_model_name_or_path`)."""
    return json.loads((Path(directory) / CONFIG_FILE).read_text()).get("base_model_name_or_path")


def is_adapter_dir(directory: str) -> bool:
    return (Path(directory).expanduser() / CONFIG_FILE).is_file()
