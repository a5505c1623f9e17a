"""`model.pretrained=DIR`: the checkpoint's own config decides the model.

A Hugging Face checkpoint already says what it is: its family (`model_type`), its task (from
`architectures`), its sizes, vocabulary and number of labels. `resolve` writes those into the
`model` config before anything is checked or built, so every strategy, the data and the
estimates see the model that will be loaded, whatever `model=` group the config started from.

A key the user set on the command line that contradicts the checkpoint is refused with one
line, except the three a fine-tuning run legitimately changes: `model.task` (a new head on
the pretrained body, e.g. classification from an MLM checkpoint, as the L2L paper fine-tunes
BERT on GLUE), `model.num_labels` (a new head of that size) and `model.dropout`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

from omegaconf import OmegaConf

from relaytrain.models.family import family_of, family_spec
from relaytrain.models.quantize import stored_quantization
from relaytrain.objectives import objective, objective_of_architecture
from relaytrain.objectives.base import Objective
from relaytrain.utils.errors import ConfigError, first_line

# ... and the router's balancing loss of a mixture of experts (`models/moe.py`): on or off, its coefficient.
FINE_TUNABLE = ("task", "num_labels", "dropout", "output_router_logits", "router_aux_loss_coef")


def load_hf_config(pretrained: str, trust_remote_code: bool = False):
    """The checkpoint's Hugging Face config, or one line saying why there is none. A checkpoint
    whose code is its own (`auto_map`, a model type this transformers lacks) is refused unless
    `trust_remote_code`: its code would run here."""
    from transformers import AutoConfig

    local = Path(pretrained).expanduser()
    if local.is_dir() and (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        raise ConfigError(f"model.pretrained={pretrained} is a LoRA adapter, not a model; train on with "
                          f"adapter=lora adapter.pretrained={pretrained} model.pretrained=<its base>")
    if local.is_dir() and not (local / "config.json").is_file():
        raise ConfigError(f"model.pretrained={pretrained} has no config.json; give a directory written by "
                          f"save_pretrained (e.g. a run's model/ directory), or a hub id while online")
    if not trust_remote_code and (remote := _remote_code(local)):
        raise ConfigError(f"model.pretrained={pretrained} is a {remote!r} model that needs its own code "
                          f"(trust_remote_code); relaytrain runs none unless you set model.trust_remote_code=true")
    try:
        return AutoConfig.from_pretrained(str(local) if local.exists() else pretrained,
                                          trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.pretrained={pretrained} could not be loaded ({first_line(err)}); "
                          f"give a local Hugging Face model directory, or a hub id while online") from err


def _remote_code(local: Path) -> str | None:
    """The model type of a local checkpoint that ships its own modelling code, else None."""
    import json

    from transformers import CONFIG_MAPPING

    path = local / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    model_type = raw.get("model_type", "?")
    return model_type if "auto_map" in raw or model_type not in CONFIG_MAPPING else None


def checkpoint_objective(hf_config) -> Objective | None:
    """The objective of the checkpoint's head, None for a bare body (e.g. BertModel)."""
    for arch in hf_config.architectures or []:
        spec = objective_of_architecture(arch)
        if spec is not None:
            return spec
    return None


def checkpoint_task(hf_config) -> str | None:
    """The name (`model.task`) of the checkpoint's head's objective, None for a bare body."""
    found = checkpoint_objective(hf_config)
    return None if found is None else found.name


def facts(hf_config) -> dict:
    """What the checkpoint says, as `model` config keys."""
    family = family_of(hf_config)
    out = {"family": family.name, "vocab_size": hf_config.vocab_size, **family.facts(hf_config),
           "checkpoint_dtype": _dtype_name(hf_config), **stored_quantization(hf_config)}
    task = checkpoint_task(hf_config)
    if task is not None and task not in family.tasks:
        raise ConfigError(f"the checkpoint's head ({', '.join(hf_config.architectures)}) does {task}, which "
                          f"relaytrain's {family.name} family does not train; it trains {', '.join(family.tasks)}")
    if task is not None:
        out["task"] = task
    if task is not None and objective(task).classifies:
        out["num_labels"] = hf_config.num_labels
    return out


def resolve(cfg, explicit: Iterable[str] = ()):
    """`cfg` with its `model` keys taken from `model.pretrained`'s config (a copy; `cfg` itself
    when there is no pretrained model, or when this was done already: `model.resolved_from`).
    `explicit`: the command-line overrides, whose `model.*` keys must agree with the checkpoint
    unless fine-tuning may change them."""
    pretrained = cfg.model.pretrained
    if not pretrained or cfg.model.resolved_from == pretrained:  # nothing to do, or done already
        return cfg
    hf_config = load_hf_config(pretrained, cfg.model.trust_remote_code)
    said = facts(hf_config)
    given = {o.split("=", 1)[0].removeprefix("+")[len("model."):]: o for o in explicit if o.lstrip("+").startswith("model.")}
    for key, value in said.items():
        if key in given and key not in FINE_TUNABLE and _differs(cfg.model[key], value):
            raise ConfigError(f"{given[key]} contradicts model.pretrained={pretrained}, whose {key} is {value}; "
                              f"drop it (the checkpoint's config decides the model's shape)")
    resolved = copy.deepcopy(cfg)
    for key, value in said.items():
        if key not in given:
            OmegaConf.update(resolved, f"model.{key}", value, merge=False)
    if "task" not in said and "task" not in given:  # a bare body: the family's usual head
        OmegaConf.update(resolved, "model.task", _bare_body_task(resolved.model), merge=False)
    if "name" not in given:
        OmegaConf.update(resolved, "model.name", checkpoint_name(pretrained), merge=False)
    if (pad := _classifier_pad_id(resolved, hf_config)) is not None:
        OmegaConf.update(resolved, "model.pad_token_id", pad, merge=False)
    OmegaConf.update(resolved, "model.resolved_from", pretrained, merge=False)
    return resolved


def _classifier_pad_id(cfg, hf_config) -> int | None:
    """The padding id a sequence classifier's config must name when the checkpoint names none:
    transformers' classifier scores each row's rightmost token that is not padding, and refuses a
    batch without a padding id. It is the id the data pads with, the checkpoint's tokenizer's pad
    (else its eos), which TRL's RewardTrainer writes into the model's config too: a reward model
    then scores the token before a completion's closing eos, in training and once saved. None
    where the checkpoint names one, the model is no decoder classifier, or it has no tokenizer."""
    m = cfg.model
    if hf_config.pad_token_id is not None or m.pad_token_id is not None:
        return None
    if not objective(cfg.objective.name).classifies or family_of(hf_config).name != "decoder":
        return None
    from transformers import AutoTokenizer

    local = Path(m.pretrained).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else m.pretrained,
                                                  trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError):  # no tokenizer here: the data's (data.tokenizer) pads, scored by the mask
        return None
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def checkpoint_name(pretrained: str) -> str:
    """What the report calls the model: the directory's name (a run's `model/`: the run's name too)."""
    path = Path(pretrained)
    return f"{path.parent.name}/{path.name}" if path.name == "model" and path.parent.name else path.name or pretrained


def _bare_body_task(m) -> str:
    """A body without a head: the configured objective where the family has its head, else its first."""
    family = family_spec(m.family)
    return str(m.task) if family.trains(objective(m.task)) else family.tasks[0]


def _dtype_name(hf_config) -> str:
    """The dtype the checkpoint's weights are stored in (float32 when the config does not say)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


def _differs(configured, checkpoint) -> bool:
    if isinstance(checkpoint, float):
        return abs(float(configured) - checkpoint) > 1e-9
    return str(configured) != str(checkpoint)


def explicit_overrides(overrides: Iterable[str]) -> list[str]:
    """The `key=value` overrides a user typed (Hydra's task overrides), without group choices."""
    return [o for o in overrides if "=" in o and "." in o.split("=", 1)[0]]
