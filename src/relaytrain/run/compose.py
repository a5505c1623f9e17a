"""The config a run or a command works with: composed by Hydra from the packaged YAML and every
strategy's and optimizer's typed schema, then checked across keys and by its strategy.

- `register_schema` stores the schemas in Hydra's ConfigStore (the root one, each optimizer's,
  each registered strategy's `Strategy.Config`).
- `compose(overrides)` is what a command composes: any problem Hydra or OmegaConf finds is one
  `ConfigError` line naming the key and the fix. OmegaConf's errors are read by type and
  attribute, not by their English: `ConfigAttributeError` + `object_type` gives the schema that
  lacks a key (and the registry the options that have it), `ValidationError` + the node's class
  or enum type what was expected, and `difflib` (or the key's initials: `lr`) the close match.
- `compose_config(overrides)` is the same without the translation (tests, scripts, notebooks).
- `validate(cfg, chosen)` runs the shared checks (`checks.check_shared`: the keys across each
  other, what the precision and optimizer ask of the strategy's capabilities), then a preset's
  fixed keys, the strategy's own rules, the data source's and the model's (`checks.check_layers`),
  with the names looked up once (`resolve.choose`).
"""

from __future__ import annotations

import dataclasses
import difflib

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from relaytrain.models.pretrained import checkpoint_name
from relaytrain.run.checks import check_layers, check_shared
from relaytrain.run.resolve import Choices, choose
from relaytrain.schema.config import RelayTrainConfig
from relaytrain.step.optim import optimizer_schemas
from relaytrain.strategies import registry
from relaytrain.utils.errors import ConfigError, first_line

CONFIG_MODULE = "relaytrain.configs"
SCHEMA_SUFFIX = "_schema"  # an option's typed schema in the ConfigStore: `optim/adamw_schema`
_NODE_KINDS = {"IntegerNode": "integer", "FloatNode": "number", "BooleanNode": "boolean (true or false)",
               "StringNode": "string"}


def run_label(name: str, pretrained: str | None) -> str:
    """What a run directory is named after (`run_label` in config.yaml's hydra.run.dir): the name
    the report gives a checkpoint where the run starts from one (one directory level: a run's
    `RUN/model` becomes `RUN-model`), else the model config's."""
    return checkpoint_name(str(pretrained)).replace("/", "-") if pretrained else name


def register_schema() -> None:
    """Store the root schema and every strategy's and optimizer's schema in Hydra's ConfigStore;
    register `run_label` for the run directory's name."""
    OmegaConf.register_new_resolver("run_label", run_label, replace=True)
    store = ConfigStore.instance()
    store.store(name="relaytrain_schema", node=RelayTrainConfig)
    for name, schema in optimizer_schemas().items():
        store.store(group="optim", name=f"{name}{SCHEMA_SUFFIX}", node=schema)
    for name, cls in registry().items():
        store.store(group="strategy", name=f"{name}{SCHEMA_SUFFIX}", node=cls.Config)


def compose_config(overrides: list[str] | tuple[str, ...] = (), return_hydra_config: bool = False):
    """The config `relaytrain train OVERRIDES...` would run with (no validation, no Hydra run
    dir), Hydra's own exceptions on a bad override: for tests, benchmarks and notebooks. With
    `return_hydra_config`, its `hydra` section too (`hydra.runtime.choices`: each group's option)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides),
                                 return_hydra_config=return_hydra_config)
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str] | tuple[str, ...], return_hydra_config: bool = False):
    """The config these overrides compose (no cross-key checks), or one ConfigError line."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides, return_hydra_config)
    except MissingConfigException as err:
        raise ConfigError(_missing_option_message(err)) from err
    except ConfigCompositionException as err:
        raise ConfigError(_composition_message(err)) from err
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from err


def validate(cfg, chosen: Choices | None = None) -> Choices:
    """Every check a config must pass before any work, with what its names name (`chosen`,
    looked up here when not given); ConfigError on the first problem. Returns `chosen`. The keys
    every run shares first (`checks.check_shared`), then the strategy's, the data source's and the
    model's rules (`checks.check_layers`)."""
    chosen = chosen or choose(cfg)
    check_shared(cfg, chosen)
    check_layers(cfg, chosen)
    return chosen


# --------------------------------------------------------------------------- one-line errors


def _missing_option_message(err) -> str:
    # The ConfigStore lists the typed schemas (`adamw_schema`) beside the options: not choices.
    options = [name for name in getattr(err, "options", None) or [] if not name.endswith(SCHEMA_SUFFIX)]
    group = getattr(err, "missing_cfg_file", "") or ""
    if "/" in group:
        group, option = group.rsplit("/", 1)
        hint = difflib.get_close_matches(option, options, n=1)
        fix = f"did you mean {group}={hint[0]}? " if hint else ""
        return f"{group}={option} is not a known option; {fix}choose one of: {', '.join(sorted(options))}"
    return first_line(err)


def _composition_message(err) -> str:
    cause = err.__cause__
    if cause is not None and hasattr(cause, "full_key"):
        return _omegaconf_message(cause)
    text = str(err)
    if "Could not find" in text or "Could not load" in text:
        return first_line(err).replace("Could not find", "no config option").rstrip(".") + " (see relaytrain train --help)"
    return first_line(err)


def _omegaconf_message(err) -> str:
    """One line from OmegaConf's structured error: which key, what it expected, the close match."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    key = getattr(err, "full_key", "") or ""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key_message(key, getattr(err, "object_type", None))
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        if (key, str(value)) in RENAMED_VALUES:
            return RENAMED_VALUES[key, str(value)]
        node = getattr(err, "child_node", None)
        enum_type = getattr(node, "enum_type", None)
        if enum_type is not None:
            choices = [member.name for member in enum_type]
            hint = difflib.get_close_matches(str(value), choices, n=1)
            fix = f"did you mean {key}={hint[0]}? " if hint else ""
            return f"{key}={value} is not one of {', '.join(choices)}; {fix}".rstrip("; ").rstrip()
        if type(node).__name__ == "ListConfig":  # one value where a list goes: the brackets forgotten
            return f"{key}={value}: {key} is a list; give {key}=[{value}] (several: [a,b])"
        kind = _NODE_KINDS.get(type(node).__name__, "value of the key's type")
        return f"{key}={value} is not a valid {kind}; give one (see relaytrain train --help)"
    msg = getattr(err, "msg", str(err)).splitlines()[0]
    return f"{key}: {msg}" if key else msg


# Keys and values that were renamed: the old one is refused in one line naming the new one, for
# one release, and means nothing else meanwhile (no silent alias).
RENAMED_KEYS = {
    "train.warmup_steps": "train.warmup_steps was renamed train.untimed_steps (steps left out of the "
                          "throughput figures); optim.warmup_steps is the learning-rate warm-up",
    "strategy.eps": "strategy.eps was renamed strategy.eps_state (where the eager param server's state lives: "
                    "sharded or replicated); optim.eps is the optimizer's epsilon",
}
RENAMED_VALUES = {
    ("strategy.stash", "cpu"): "strategy.stash=cpu was renamed strategy.stash=host (host memory, as in "
                               "strategy.offload=host)",
}


def _unknown_key_message(key: str, schema) -> str:
    """An unknown key: a renamed one's new name; else a close match among the keys of its section,
    and for the strategy and optim groups, which options do have the key."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key]
    section, _, leaf = key.rpartition(".")
    owners = _options_with_key(section, leaf)
    chosen = getattr(schema, "name", None) if schema is not None else None
    if owners and chosen:
        return (f"{key} is not a key of {section}={chosen}; only {section}={'/'.join(owners)} "
                f"{'has' if len(owners) == 1 else 'have'} it (see relaytrain train --help)")
    known = ([f.name for f in dataclasses.fields(schema)] if schema is not None and dataclasses.is_dataclass(schema)
             else _keys_of(section))
    hint = _nearest_key(leaf, known)
    if hint:
        return f"unknown key {key}; did you mean {section + '.' if section else ''}{hint}?"
    return f"unknown key {key}; see `relaytrain train --help` for the keys"


def _nearest_key(typed: str, known: list[str]) -> str | None:
    """The known key a typo or a spelled-out name means: the closest by difflib (`num_layerz`),
    else one whose initials the other spells (`learning_rate` for `lr`, which difflib rates far)."""
    close = difflib.get_close_matches(typed, known, n=1)
    if close:
        return close[0]
    return next((k for k in known if k == _initials(typed) or typed == _initials(k)), None)


def _initials(key: str) -> str:
    words = key.split("_")
    return "".join(w[0] for w in words if w) if len(words) > 1 else ""


def _options_with_key(section: str, leaf: str) -> list[str]:
    schemas = {"strategy": {n: c.Config for n, c in registry().items()}, "optim": optimizer_schemas()}.get(section, {})
    return [name for name, schema in schemas.items() if leaf in {f.name for f in dataclasses.fields(schema)}]


def _keys_of(section: str) -> list[str]:
    for f in dataclasses.fields(RelayTrainConfig):
        if f.name == section and f.default_factory is not None and dataclasses.is_dataclass(f.default_factory):
            return [g.name for g in dataclasses.fields(f.default_factory)]
    return [f.name for f in dataclasses.fields(RelayTrainConfig)] if not section else []

