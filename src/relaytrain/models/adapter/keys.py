"""The `adapter.*` keys: on their own, against the model, against a continued adapter's own config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from relaytrain.models.adapter.layers import ALL_LINEAR, target_names
from relaytrain.utils.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
# Our key -> peft's LoraConfig field: what a continued adapter fixes and a run may not contradict.
SAVED_KEYS = {"r": "r", "alpha": "lora_alpha", "target_modules": "target_modules", "use_dora": "use_dora",
              "lora_bias": "lora_bias", "modules_to_save": "modules_to_save", "target_parameters": "target_parameters"}


def enabled(a) -> bool:
    return str(a.name) != "none"


def set_without_adapter(a, defaults) -> list[str]:
    """The `adapter.*` keys that differ from their defaults (`defaults`: an AdapterConfig) while
    no adapter is on: they would change nothing, so the run would not be what was asked."""
    if enabled(a):
        return []
    return [f"adapter.{f.name}={getattr(a, f.name)}" for f in dataclasses.fields(defaults)
            if f.name != "name" and _plain(getattr(a, f.name)) != _plain(getattr(defaults, f.name))]


def check(a, m, shapes=None, defaults=None) -> None:
    """The adapter keys on their own and against the model (`shapes`: the layered model on the
    meta device, for the target modules) and, continuing one, against `adapter.pretrained`'s
    config (`defaults`: an AdapterConfig, to tell the keys a run sets); ConfigError on the first."""
    if not enabled(a):
        return
    if a.r <= 0:
        raise ConfigError(f"adapter.r={a.r} must be a positive rank (e.g. adapter.r=8)")
    if a.alpha <= 0:
        raise ConfigError(f"adapter.alpha={a.alpha} must be positive (updates are scaled by alpha / r)")
    if not 0.0 <= a.dropout < 1.0:
        raise ConfigError(f"adapter.dropout={a.dropout} must be in [0, 1)")
    if a.use_dora and a.lora_bias:
        raise ConfigError("adapter.use_dora=true and adapter.lora_bias=true: peft's DoRA has no LoRA bias; keep one")
    if a.pretrained:
        _check_continued(a, defaults)
    elif shapes is not None and ALL_LINEAR not in a.target_modules:
        target_names(shapes, list(a.target_modules))
    if shapes is not None and a.target_parameters and not a.pretrained:
        _check_target_parameters(shapes, list(a.target_parameters))


def _check_target_parameters(model, wanted: list[str]) -> None:
    """Each of `adapter.target_parameters` ends the name of a parameter of the blocks (peft adapts
    a mixture's fused 3-D expert tensors so), or one line naming the blocks' expert parameters."""
    names = [name for block in model.blocks for name, _ in block.layer.named_parameters()]
    missing = [w for w in wanted if not any(name == w or name.endswith("." + w) for name in names)]
    if missing:
        fused = sorted({name for name in names if "experts" in name}) or sorted(set(names))[:6]
        raise ConfigError(f"adapter.target_parameters={wanted}: {', '.join(missing)} names no parameter of the "
                          f"blocks; they have e.g. {', '.join(fused)}")


def saved_config(directory: str) -> dict:
    return json.loads((Path(directory).expanduser() / CONFIG_FILE).read_text())


def saved_targets(directory: str) -> list[str]:
    """The parameters a saved adapter adapts by name (peft's target_parameters: a mixture's experts)."""
    return list(saved_config(directory).get("target_parameters") or [])


def _check_continued(a, defaults) -> None:
    """`adapter.pretrained` is a peft LoRA directory, and the run's keys do not contradict it:
    its rank, scaling, targets and extras are the adapter's own (a key left at its default takes
    the saved value; one set otherwise must agree). adapter.dropout is the run's (`inject`)."""
    if not (Path(a.pretrained).expanduser() / CONFIG_FILE).is_file():
        raise ConfigError(f"adapter.pretrained={a.pretrained} has no {CONFIG_FILE}; give a peft adapter directory "
                          f"(PeftModel.save_pretrained's, or a run's model/ directory saved with adapter=lora)")
    saved = saved_config(a.pretrained)
    if saved.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"adapter.pretrained={a.pretrained} is a {saved['peft_type']} adapter; adapter=lora "
                          f"continues LoRA adapters")
    for key, field in SAVED_KEYS.items() if defaults is not None else ():
        ours, theirs = _plain(getattr(a, key)), _plain(saved.get(field))
        if ours != _plain(getattr(defaults, key)) and not _agree(key, ours, theirs):
            raise ConfigError(f"adapter.{key}={getattr(a, key)} contradicts adapter.pretrained={a.pretrained} "
                              f"({field}={saved.get(field)}); drop adapter.{key} to continue it as saved")


def _plain(value):
    """A config value as plain Python (OmegaConf's lists are ListConfig)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return list(value)


def _agree(key: str, ours, theirs) -> bool:
    if key in ("target_modules", "modules_to_save", "target_parameters"):  # lists of names, in any order (or peft's one string)
        return _names(ours) == _names(theirs)
    return ours == theirs or (theirs is None and not ours)


def _names(value) -> set:
    return {value} if isinstance(value, str) else set(value or [])
