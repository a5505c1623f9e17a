"""The `relaytrain` command.

    relaytrain train [KEY=VALUE ...] [+exp=NAME] [-m]   train (a Hydra app)
    relaytrain schedule [KEY=VALUE ...]                 print a pipeline schedule's timeline
    relaytrain report PATH...                           compare runs and sweeps

Bad input never reaches the training code: the overrides are composed and checked first,
and any problem ends with one line on stderr naming the key and the fix, exit code 2, no
traceback (set HYDRA_FULL_ERROR=1 for one).
"""

from __future__ import annotations

import difflib
import itertools
import os
import sys

from relaytrain.errors import ConfigError

CONFIG_MODULE = "relaytrain.configs"
EXIT_USAGE = 2
MAX_SWEEP_CHECKS = 256

USAGE = """\
relaytrain: train transformers that do not fit your GPU.

Usage:
  relaytrain train [KEY=VALUE ...] [+exp=NAME] [-m]   train a model (a Hydra app)
  relaytrain schedule [KEY=VALUE ...] [--out FILE]    show a pipeline schedule as a timeline
  relaytrain report PATH... [--sort KEY] [--json]     compare runs and sweeps: a table, summary.csv, plots
  relaytrain plan [KEY=VALUE ...] [--out DIR]         which strategy and shape fit your devices (predicted)
  relaytrain --version

Strategies (strategy=NAME): {strategies}.
Config groups: model, data, strategy, optim, precision; experiments: +exp=NAME.
`relaytrain train --help` lists every option and key with what it does; each command has --help.

Examples:
  relaytrain train                                   # bert_tiny on synthetic data, about a minute on CPU
  relaytrain train strategy=l2l model=bert_base train.steps=50
  relaytrain train +exp=bert_large_l2l
  relaytrain train -m strategy=baseline,l2l optim.lr=1e-4,3e-4
  relaytrain train strategy=pipe_2bw strategy.stages=2 strategy.replicas=2
  relaytrain train strategy=l2l strategy.replicas=2
  relaytrain schedule strategy=pipe_2bw strategy.stages=4 strategy.num_microbatches=8 [--out t.svg]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        from relaytrain.strategies import registry

        print(USAGE.format(strategies=", ".join(registry())), end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "--version":
        from relaytrain import __version__

        print(f"relaytrain {__version__}")
        return 0
    if command == "train":
        return _guard(lambda: _train(rest))
    if command == "schedule":
        from relaytrain.strategies.pipeline.view import schedule_command

        return _guard(lambda: schedule_command(rest, checked_config))
    if command == "report":
        from relaytrain.summary import report_command

        return _guard(lambda: report_command(rest))
    if command == "plan":
        from relaytrain.plan import plan_command

        return _guard(lambda: plan_command(rest))
    _fail(f"unknown command {command!r}; use `relaytrain train`, `relaytrain schedule` or `relaytrain report` "
          f"(see relaytrain --help)")
    return EXIT_USAGE


def _guard(action) -> int:
    """Run a command; a ConfigError becomes one line on stderr and exit code 2."""
    try:
        return action() or 0
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(str(err))
        return EXIT_USAGE


def _fail(message: str) -> None:
    print(f"relaytrain: error: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- train


def _train(args: list[str]) -> int:
    if "--help" in args or "-h" in args:
        from relaytrain.help import train_help

        print(train_help([a for a in args if not a.startswith("-")], checked_config), end="")
        return 0
    hydra_flags = {"--hydra-help", "--info", "--cfg", "-c", "--resolve", "--shell-completion", "-sc"}
    if not hydra_flags.intersection(args):
        overrides = [a for a in args if not a.startswith("-")]
        check_overrides(overrides, multirun="-m" in args or "--multirun" in args)
    return _run_hydra(args)


def _run_hydra(args: list[str]) -> int:
    import hydra

    from relaytrain import sweep
    from relaytrain.config import register_schema

    register_schema()
    sweep.failed_jobs.clear()

    @hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
    def train_app(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from relaytrain import sweep
        from relaytrain.errors import Aborted, Interrupted
        from relaytrain.train import run

        hydra_cfg = HydraConfig.get()
        in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
        try:
            run(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task), table=not in_sweep)
        except (Interrupted, Aborted) as stop:  # the whole sweep stops too: the user asked
            print(f"relaytrain: {stop}", file=sys.stderr)
            sys.exit(128 + stop.signum)  # the shell's convention for "ended by this signal"
        except Exception as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _fail(_first_line(err) if isinstance(err, ConfigError)
                  else f"{type(err).__name__}: {_first_line(err)} (HYDRA_FULL_ERROR=1 shows the traceback)")
            if not in_sweep:
                sys.exit(EXIT_USAGE if isinstance(err, ConfigError) else 1)  # passes through Hydra's error report
            sweep.failed_jobs.append(hydra_cfg.runtime.output_dir)  # the sweep goes on; its table shows the row

    saved = sys.argv
    sys.argv = ["relaytrain train", *args]
    try:
        train_app()
    finally:
        sys.argv = saved
    from relaytrain import sweep

    if sweep.failed_jobs:
        _fail(f"{len(sweep.failed_jobs)} sweep job(s) failed; their rows in the table above say why")
        return 1
    return 0


def check_overrides(overrides: list[str], multirun: bool = False) -> None:
    """Compose the config for these overrides (every combination of a sweep) and validate it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from relaytrain.config import register_schema, validate
    from relaytrain.models.pretrained import explicit_overrides, resolve

    register_schema()
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar errors
        raise ConfigError(f"cannot parse the overrides: {_first_line(err)}") from err
    combos = _combinations(parsed) if multirun else [overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            for combo in itertools.islice(combos, MAX_SWEEP_CHECKS):
                cfg = resolve(_compose(compose, combo), explicit_overrides(combo))
                validate(cfg)
                _check_fits(cfg)
    finally:
        GlobalHydra.instance().clear()


def _check_fits(cfg) -> None:
    """Refuse a run this machine cannot start or hold before Hydra creates its run directory."""
    from relaytrain.budget import check_host_memory
    from relaytrain.launch import check_machine
    from relaytrain.strategies import strategy_class

    cls = strategy_class(cfg.strategy.name)
    check_machine(cfg, cls.processes(cfg))
    if cfg.train.check_memory:
        check_host_memory(cfg, cls)


def checked_config(overrides: list[str]):
    """The config these overrides compose (no cross-key checks), or one ConfigError line."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from relaytrain.config import register_schema

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return _compose(compose, overrides)
    finally:
        GlobalHydra.instance().clear()


def _combinations(parsed) -> itertools.product:
    choices = []
    for o in parsed:
        key = o.get_key_element()
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return itertools.product(*choices)


def _compose(compose, overrides):
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(config_name="config", overrides=list(overrides))
    except MissingConfigException as err:
        raise ConfigError(_missing_option_message(err)) from err
    except ConfigCompositionException as err:
        raise ConfigError(_composition_message(err)) from err
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from err


def _missing_option_message(err) -> str:
    options = list(getattr(err, "options", None) or [])
    group = getattr(err, "missing_cfg_file", "") or ""
    if "/" in group:
        group, option = group.rsplit("/", 1)
        hint = difflib.get_close_matches(option, options, n=1)
        fix = f"did you mean {group}={hint[0]}? " if hint else ""
        return f"{group}={option} is not a known option; {fix}choose one of: {', '.join(sorted(options))}"
    return _first_line(err)


def _composition_message(err) -> str:
    cause = err.__cause__
    if cause is not None and hasattr(cause, "full_key"):
        return _omegaconf_message(cause)
    text = str(err)
    if "Could not find" in text or "Could not load" in text:
        return _first_line(err).replace("Could not find", "no config option").rstrip(".") + " (see relaytrain train --help)"
    return _first_line(err)


_NODE_KINDS = {"IntegerNode": "integer", "FloatNode": "number", "BooleanNode": "boolean (true or false)",
               "StringNode": "string"}


def _omegaconf_message(err) -> str:
    """One line from OmegaConf's structured error: which key, what it expected, the close match."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    key = getattr(err, "full_key", "") or ""
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key_message(key, getattr(err, "object_type", None))
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        node = getattr(err, "child_node", None)
        enum_type = getattr(node, "enum_type", None)
        if enum_type is not None:
            choices = [member.name for member in enum_type]
            hint = difflib.get_close_matches(str(value), choices, n=1)
            fix = f"did you mean {key}={hint[0]}? " if hint else ""
            return f"{key}={value} is not one of {', '.join(choices)}; {fix}".rstrip("; ").rstrip()
        kind = _NODE_KINDS.get(type(node).__name__, "value of the key's type")
        return f"{key}={value} is not a valid {kind}; give one (see relaytrain train --help)"
    msg = getattr(err, "msg", str(err)).splitlines()[0]
    return f"{key}: {msg}" if key else msg


def _unknown_key_message(key: str, schema) -> str:
    """An unknown key: a close match among the keys of its section, and for the strategy and
    optim groups, which options do have the key."""
    from dataclasses import fields, is_dataclass

    section, _, leaf = key.rpartition(".")
    owners = _options_with_key(section, leaf)
    chosen = getattr(schema, "name", None) if schema is not None else None
    if owners and chosen:
        return (f"{key} is not a key of {section}={chosen}; only {section}={'/'.join(owners)} "
                f"{'has' if len(owners) == 1 else 'have'} it (see relaytrain train --help)")
    known = [f.name for f in fields(schema)] if schema is not None and is_dataclass(schema) else _keys_of(section)
    hint = difflib.get_close_matches(leaf, known, n=1)
    if hint:
        return f"unknown key {key}; did you mean {section + '.' if section else ''}{hint[0]}?"
    return f"unknown key {key}; see `relaytrain train --help` for the keys"


def _options_with_key(section: str, leaf: str) -> list[str]:
    from dataclasses import fields

    from relaytrain.config import OPTIMIZER_CONFIGS
    from relaytrain.strategies import registry

    schemas = {"strategy": {n: c.Config for n, c in registry().items()}, "optim": OPTIMIZER_CONFIGS}.get(section, {})
    return [name for name, schema in schemas.items() if leaf in {f.name for f in fields(schema)}]


def _keys_of(section: str) -> list[str]:
    from dataclasses import fields, is_dataclass

    from relaytrain.config import RelayTrainConfig

    for f in fields(RelayTrainConfig):
        if f.name == section and f.default_factory is not None and is_dataclass(f.default_factory):
            return [g.name for g in fields(f.default_factory)]
    return [f.name for f in fields(RelayTrainConfig)] if not section else []


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
