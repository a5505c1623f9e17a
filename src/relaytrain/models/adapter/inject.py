"""peft's layers into the layered model: the config, the injection, the parts re-pointed, the
frozen base, and a continued adapter's weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from relaytrain.models.adapter.files import read_adapter_weights
from relaytrain.models.adapter.fingerprint import base_fingerprint
from relaytrain.models.adapter.layers import ADAPTER, is_conv1d, quiet_peft, short_names, target_names, trains
from relaytrain.utils.errors import ConfigError, first_line

# What peft's SEQ_CLS task adds to modules_to_save: the classification head, trained in full.
CLASSIFIER_NAMES = ("classifier", "score")


def attach(model, a, checkpoint_dtype: str | None = None, quiet: bool = False) -> None:
    """Inject the adapters into `model` (a LayeredModel), point its parts at them and freeze its
    base; with `adapter.pretrained`, load that adapter's weights. Sets `model.adapter` (the peft
    config) and `model.base_fingerprint` (hashed as stored in `checkpoint_dtype`)."""
    from peft import inject_adapter_in_model

    config = peft_config(model, a, quiet)
    tied = _tied_modules(model.hf_model)
    before = {id(module): name for name, module in model.hf_model.named_modules()}
    try:
        with quiet_peft():
            inject_adapter_in_model(config, model.hf_model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's NoMatchingPeftModuleError: the adapter's targets are not in this model
        raise ConfigError(f"adapter.pretrained={a.pretrained} was made for another base ({first_line(err)}); "
                          f"use the model.pretrained it was trained on") from err
    # Here, not at the top: it imports peft's layer classes, seconds that a run without adapters skips.
    from relaytrain.models.adapter.experts import use_experts_param_wrappers
    from relaytrain.models.adapter.fused import use_fused_forward

    use_fused_forward(model.hf_model)
    use_experts_param_wrappers(model.hf_model)
    _refuse_tied(model.hf_model, tied)
    if a.merge_on_save:
        _refuse_unmergeable(model.hf_model)
    repoint_parts(model, before)
    _freeze_base(model.hf_model)
    model.rename_parameters()
    if a.pretrained and not shapes_only(model):
        _load_adapter_weights(model, a.pretrained)
    object.__setattr__(model, "adapter", config)
    object.__setattr__(model, "base_fingerprint", base_fingerprint(model, checkpoint_dtype))


def shapes_only(model) -> bool:
    """A model on the meta device (a dry run, the planner's counts): no weights to load."""
    return any(p.device.type == "meta" for p in model.parameters())


# --------------------------------------------------------------------------- peft's config


def peft_config(model, a, quiet: bool = True):
    """peft's LoraConfig: the keys', or `adapter.pretrained`'s own (its rank, scaling, targets,
    extras) with the run's adapter.dropout. A classification model's head trains in full
    (modules_to_save), as peft's SEQ_CLS task trains it."""
    from peft import LoraConfig

    if a.pretrained:
        config = LoraConfig.from_pretrained(str(Path(a.pretrained).expanduser()))
        config.inference_mode = False
        _take_runs_dropout(config, a, quiet)
    else:
        targets = target_names(model, list(a.target_modules))
        conv1d = any(is_conv1d(module) for module in targets.values())  # GPT-2 stores (in, out)
        config = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, bias="none", fan_in_fan_out=conv1d,
                            target_modules=short_names(model, targets), use_dora=bool(a.use_dora),
                            lora_bias=bool(a.lora_bias), modules_to_save=list(a.modules_to_save) or None,
                            target_parameters=list(a.target_parameters) or None)  # a mixture's fused experts
    if model.objective.classifies:
        head = [n for n in CLASSIFIER_NAMES if hasattr(model.hf_model, n)]
        config.modules_to_save = sorted(set(config.modules_to_save or []) | set(head))
    return config


def _take_runs_dropout(config, a, quiet: bool) -> None:
    """The run's adapter.dropout replaces the saved one (a training choice, not the adapter's);
    one line says so where they differ."""
    if config.lora_dropout != a.dropout and not quiet:
        print(f"adapter.pretrained={a.pretrained} was saved with lora_dropout={config.lora_dropout}; this run "
              f"trains it with adapter.dropout={a.dropout}", flush=True)
    config.lora_dropout = a.dropout


# --------------------------------------------------------------------------- after the injection


def repoint_parts(model, before: dict[int, str]) -> None:
    """The layered model's embed and head hold the Hugging Face modules they were built on; where
    peft put another module in one's place (lora.Linear on lm_head, lora.Embedding on
    embed_tokens, a ModulesToSaveWrapper on a classifier), the part is pointed at it, so that
    what trains is what runs. (The blocks hold whole layers, which peft changes inside.)"""
    for part in (model.embed, model.head):
        for parent in list(part.modules()):
            for attribute, child in list(parent.named_children()):
                name = before.get(id(child))
                if name is None:
                    continue
                now = model.hf_model.get_submodule(name)
                if now is not child:
                    setattr(parent, attribute, now)


def _tied_modules(hf_model: nn.Module) -> dict[str, str]:
    """Module name -> the module it shares its weight with (tied input and output embeddings)."""
    owners: dict[int, list[str]] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rsplit(".", 1)[0])
    return {name: next(n for n in names if n != name) for names in owners.values() if len(names) > 1
            for name in names}


def _refuse_tied(hf_model: nn.Module, tied: dict[str, str]) -> None:
    """An adapter or a trained copy on a weight tied to another module would untie them (peft
    adapts or copies one of the two): refused in one line, as no single tensor could hold it."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    for name, module in hf_model.named_modules():
        if name in tied and isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper)):
            raise ConfigError(f"adapter: {name} shares its weight with {tied[name]} (tied embeddings), and an adapter "
                              f"or modules_to_save on it would untie them; leave {name.rsplit('.', 1)[-1]} out of "
                              f"target_modules and modules_to_save, or use a base with tie_word_embeddings=false")


def _refuse_unmergeable(hf_model: nn.Module) -> None:
    """peft cannot merge a LoRA bias into a layer that has none: refused before training."""
    from peft.tuners.lora import LoraLayer

    for name, module in hf_model.named_modules():
        if isinstance(module, LoraLayer) and module.lora_bias.get(ADAPTER):
            if getattr(module.get_base_layer(), "bias", None) is None:
                raise ConfigError(f"adapter.merge_on_save=true with lora_bias: {name} has no bias to merge it into "
                                  f"(peft cannot); save the adapter (merge_on_save=false) or drop lora_bias")


def _freeze_base(hf_model: nn.Module) -> None:
    """The adapters (and trained copies) train, nothing else; they keep fp32 masters whatever
    the base is stored in (a copy of a bf16 head for modules_to_save included)."""
    for name, p in hf_model.named_parameters():
        p.requires_grad_(trains(name))
        if trains(name) and p.is_floating_point() and p.dtype != torch.float32 and p.device.type != "meta":
            p.data = p.data.float()


def _load_adapter_weights(model, directory: str) -> None:
    """A peft adapter's weights into the injected adapters, or one line when they do not fit."""
    from peft import set_peft_model_state_dict

    state = read_adapter_weights(directory)
    try:
        result = set_peft_model_state_dict(model.hf_model, state, adapter_name=ADAPTER)
    except RuntimeError as err:  # a size mismatch: another base's shapes
        raise ConfigError(f"adapter.pretrained={directory} was made for another base ({first_line(err)}); "
                          f"use the model.pretrained it was trained on") from err
    trained = [name for name in model.hf_model.state_dict() if trains(name)]
    unexpected = [k for k in result.unexpected_keys if trains(k)]
    missing = [k for k in getattr(result, "missing_keys", []) if k in trained]
    if unexpected or missing or not state:
        what = (unexpected or missing or ["no weights"])[0]
        raise ConfigError(f"adapter.pretrained={directory} was made for another base ({what} has no place in "
                          f"this model); use the model.pretrained it was trained on")
