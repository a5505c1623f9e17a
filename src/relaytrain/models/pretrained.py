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

from relaytrain.errors import ConfigError

FAMILIES = ("bert", "gpt2")
FINE_TUNABLE = ("task", "num_labels", "dropout")
# Architecture name endings -> the task their head does.
HEAD_TASKS = (("ForSequenceClassification", "classification"), ("LMHeadModel", "causal_lm"),
              ("ForCausalLM", "causal_lm"), ("ForMaskedLM", "masked_lm"), ("ForPreTraining", "masked_lm"))


def load_hf_config(pretrained: str):
    """The checkpoint's Hugging Face config, or one line saying why there is none."""
    from transformers import AutoConfig

    local = Path(pretrained).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        raise ConfigError(f"model.pretrained={pretrained} has no config.json; give a directory written by "
                          f"save_pretrained (e.g. a run's model/ directory), or a hub id while online")
    try:
        return AutoConfig.from_pretrained(str(local) if local.exists() else pretrained)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.pretrained={pretrained} could not be loaded ({str(err).splitlines()[0]}); "
                          f"give a local Hugging Face model directory, or a hub id while online") from err


def checkpoint_task(hf_config) -> str | None:
    """The task of the checkpoint's head, None for a bare body (e.g. BertModel)."""
    for arch in hf_config.architectures or []:
        for ending, task in HEAD_TASKS:
            if arch.endswith(ending):
                return task
    return None


def facts(hf_config) -> dict:
    """What the checkpoint says, as `model` config keys."""
    family = hf_config.model_type
    if family == "bert":
        sizes = {"num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
                 "num_heads": hf_config.num_attention_heads, "intermediate_size": hf_config.intermediate_size,
                 "max_seq_len": hf_config.max_position_embeddings, "dropout": hf_config.hidden_dropout_prob}
    elif family == "gpt2":
        sizes = {"num_layers": hf_config.n_layer, "hidden_size": hf_config.n_embd, "num_heads": hf_config.n_head,
                 "intermediate_size": hf_config.n_inner or 4 * hf_config.n_embd,
                 "max_seq_len": hf_config.n_positions, "dropout": hf_config.resid_pdrop}
    else:
        raise ConfigError(f"the checkpoint is a {family!r} model; relaytrain has adapters for {', '.join(FAMILIES)}")
    out = {"family": family, "vocab_size": hf_config.vocab_size, **sizes}
    task = checkpoint_task(hf_config)
    if task is not None:
        out["task"] = task
    if task == "classification":
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
    said = facts(load_hf_config(pretrained))
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
        OmegaConf.update(resolved, "model.name", _name(pretrained), merge=False)
    OmegaConf.update(resolved, "model.resolved_from", pretrained, merge=False)
    return resolved


def _name(pretrained: str) -> str:
    """What the report calls the model: the directory's name (a run's `model/`: the run's name too)."""
    path = Path(pretrained)
    return f"{path.parent.name}/{path.name}" if path.name == "model" and path.parent.name else path.name or pretrained


def _bare_body_task(m) -> str:
    if str(m.family) == "gpt2":
        return "causal_lm"
    return str(m.task) if str(m.task) != "causal_lm" else "classification"


def _differs(configured, checkpoint) -> bool:
    if isinstance(checkpoint, float):
        return abs(float(configured) - checkpoint) > 1e-9
    return str(configured) != str(checkpoint)


def explicit_overrides(overrides: Iterable[str]) -> list[str]:
    """The `key=value` overrides a user typed (Hydra's task overrides), without group choices."""
    return [o for o in overrides if "=" in o and "." in o.split("=", 1)[0]]
