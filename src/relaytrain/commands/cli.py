"""The `relaytrain` command: every subcommand's arguments, and one line for every mistake.

    relaytrain train [KEY=VALUE ...] [+exp=NAME] [-m]   train (a Hydra app)
    relaytrain schedule [KEY=VALUE ...]                 print a pipeline schedule's timeline
    relaytrain report PATH...                           compare runs and sweeps
    relaytrain plan [KEY=VALUE ...]                     which strategy and shape fit your devices
    relaytrain generate model.pretrained=DIR prompt=... what a saved model answers to a prompt
    relaytrain export model.pretrained=SRC out=DIR      an adapter merged, or a checkpoint, as a model directory

Bad input never reaches the training code: the overrides are composed and checked first,
and any problem ends with one line on stderr naming the key and the fix, exit code 2, no
traceback (set HYDRA_FULL_ERROR=1 for one). This module only reads arguments and hands them
on: the trainer (`train`), the planner (`plan`, `estimate`), the report (`report`), the
schedule view (`strategies.pipeline.view`) and `generate` do the work.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from relaytrain.utils.errors import ConfigError, first_line

EXIT_USAGE = 2
MAX_SWEEP_CHECKS = 256

USAGE = """\
relaytrain: train transformers that do not fit your GPU.

Usage:
  relaytrain train [KEY=VALUE ...] [+exp=NAME] [-m]   train a model (a Hydra app)
  relaytrain schedule [KEY=VALUE ...] [--out FILE]    show a pipeline schedule as a timeline
  relaytrain report PATH... [--sort KEY] [--json]     compare runs and sweeps: a table, summary.csv, plots
  relaytrain plan [KEY=VALUE ...] [--out DIR]         which strategy and shape fit your devices (predicted)
  relaytrain generate model.pretrained=DIR prompt=TEXT [KEY=VALUE ...]   what a saved model answers
  relaytrain export model.pretrained=SRC out=DIR [KEY=VALUE ...]   an adapter merged into its base, or a
                                                     training checkpoint, as a Hugging Face model directory
  relaytrain --version

Strategies (strategy=NAME): {strategies}.
Config groups (GROUP=OPTION): {groups}; experiments: +exp=NAME.
Keys only (KEY=VALUE): {sections}.
`relaytrain train --help` lists every option and key with what it does; each command has --help.

Examples:
  relaytrain train                                   # bert_tiny on synthetic data, about a minute on CPU
  relaytrain train strategy=l2l model=bert_base train.steps=50
  relaytrain train +exp=bert_large_l2l
  relaytrain train -m strategy=baseline,l2l optim.lr=1e-4,3e-4
  relaytrain train strategy=pipe_2bw strategy.stages=2 strategy.replicas=2
  relaytrain train strategy=l2l strategy.replicas=2
  relaytrain schedule strategy=pipe_2bw strategy.stages=4 strategy.num_microbatches=8 [--out t.svg]
  relaytrain generate model.pretrained=outputs/DATE/TIME/model prompt="What is 2+2?"
  relaytrain export model.pretrained=outputs/DATE/TIME/model out=merged
"""

SCHEDULE_USAGE = "relaytrain schedule [KEY=VALUE ...] [--schedule NAME] [--batches N] [--out FILE.svg|.png]"
SCHEDULE_HELP = f"""\
usage: {SCHEDULE_USAGE}

Draw a pipeline schedule's timeline, as in the PipeDream-2BW paper's Figures 1-3: a row per
stage, a column per time unit of the schedule's dry run (forward = 1 unit, backward = 2),
each box one micro-batch's forward or backward with its id (1-based) and the weight version
it uses (the colour; upper/lower case F/B when the output has no colour). Below the grid: the
bubble (idle share) and when each stage makes and first uses each weight version. A timeline
wider than the terminal is split into bands. Colour is left out when the output is not a
terminal or NO_COLOR is set.

options:
  -h, --help        show this text and exit
  --schedule NAME   draw the schedule of pipeline strategy NAME ({{schedules}}) instead of the
                    chosen strategy's own
  --batches N       weight updates to draw (default: as many as show the schedule's first version switch)
  --out FILE        also write the picture, with a legend: FILE.svg (needs nothing) or FILE.png (matplotlib)

keys (the same as for `relaytrain train`):
  strategy=NAME                  a pipeline strategy ({{schedules}}): the schedule drawn
  strategy.stages=D              pipeline stages (the rows)
  strategy.num_microbatches=M    micro-batches per weight update (pipe_2bw needs M >= D)
  strategy.chunks=V              model chunks per stage (pipe_interleaved; M a multiple of D)

examples:
  relaytrain schedule strategy=pipe_2bw strategy.stages=4 strategy.num_microbatches=8
  relaytrain schedule strategy=pipe_flush --batches 2 --out flush.svg
  relaytrain schedule strategy=pipe_gpipe strategy.stages=2 --out gpipe.png
  relaytrain schedule strategy=pipe_flush --schedule pipe_gpipe strategy.num_microbatches=12 | less
  relaytrain schedule strategy=pipe_interleaved strategy.stages=4 strategy.chunks=2 strategy.num_microbatches=8
"""

PLAN_USAGE = "relaytrain plan [KEY=VALUE ...] [--out DIR]"
PLAN_HELP = f"""\
relaytrain plan: which strategy and shape fit a model on a machine, and how fast they train (predicted).

Usage: {PLAN_USAGE}
  KEY=VALUE               the model and data of `relaytrain train` (model=bert_large data.seq_len=128 ...)
  plan.workers=N          devices (GPUs, or CPU worker processes) to plan for (default 1)
  plan.device_memory_gb=G memory of each device in GB (default: the GPU profile's, else 16)
  plan.host_memory_gb=G   host memory of each machine in GB (default: this machine's with plan.device=this,
                          else unlimited); decides where offloaded weights and stashes may go
  plan.batch_size=B       the global minibatch (default strategy.microbatch_size x strategy.num_microbatches)
  plan.device=NAME        `this` (profile this machine, default), a GPU profile ({{profiles}}) or a JSON file
  plan.strategies=[a,b]   strategies to consider (default: all)
  --out DIR               where plan.json goes (default: hydra.run.dir if given, else outputs/plan/DATE_TIME)

Times are predictions from a cost model over the profile (measured here, or spec-sheet figures);
device memory is a dry run of the real strategy code on PyTorch's meta device. The planner decides
strategy.* (the keys in the printed command); other strategy.* overrides are ignored.

Examples:
  relaytrain plan model=bert_tiny plan.workers=2 plan.batch_size=32
  relaytrain plan model=bert_large data.seq_len=128 plan.device=v100_16gb plan.workers=8 plan.batch_size=256
"""

REPORT_USAGE = "relaytrain report PATH... [--sort [-]COLUMN] [--filter EXPR]... [--json] [--out DIR]"
REPORT_HELP = f"""\
Usage: {REPORT_USAGE}

Compare runs: one row per run directory (one holding results.json or status.json); a sweep
directory (multirun/DATE/TIME) stands for every run directory directly inside it.

Options:
  --sort COLUMN    order the rows by a summary.csv column (samples_per_s, peak_host_rss,
                   final_loss, run, ...); -COLUMN for descending. Default: as given, jobs by name
  --filter EXPR    keep the rows where COLUMN=VALUE, COLUMN!=VALUE, COLUMN>NUMBER or
                   COLUMN<NUMBER holds; repeat to require several (--filter status=finished)
  --json           print the rows as JSON instead of the table (summary.csv is still written)
  --out DIR        where summary.csv and the plots go. Default: the sweep directory when one
                   sweep is given, else the current directory

Plots (throughput_vs_memory.png, loss_curves.png, throughput_vs_KEY.png per numeric swept key)
need matplotlib: pip install 'relaytrain[plot]'.
"""

GENERATE_USAGE = "relaytrain generate model.pretrained=DIR prompt=TEXT [KEY=VALUE ...]"
GENERATE_HELP = f"""\
usage: {GENERATE_USAGE}

Print what a causal language model answers to a prompt: only the new text. DIR is a Hugging
Face directory with its tokenizer, such as a run's RUN_DIR/model (train.save_model=true), or
a peft LoRA adapter directory (adapter=lora), which is put on the base model it names.
Decoding is Hugging Face's own `generate`, on the GPU when there is one, the weights in the
dtype they were saved in.

keys:
  model.pretrained=DIR   the model directory (required)
  prompt=TEXT            what the model answers (required, not empty)
  max_new_tokens=N       tokens to generate at most (default 64)
  chat=auto|true|false   auto (default): put the prompt in a user turn of the tokenizer's chat
                         template, ready for the assistant's answer, when it has one;
                         false: continue the raw text
  do_sample=true|false   false (default): greedy, the same answer every time; true: sample
  temperature=T          sampling only: T > 0 (default: the model's generation config)
  top_p=P                sampling only: nucleus mass, 0 < P <= 1 (default: the model's generation config)
  seed=S                 what sampling draws from (default 0: the same command, the same text)

examples:
  relaytrain generate model.pretrained=outputs/2025-01-01/12-00-00/model prompt="What is 2+2?"
  relaytrain generate model.pretrained=runs/sft/model prompt="Tell me a story" do_sample=true temperature=0.8 seed=1
  relaytrain generate model.pretrained=runs/lm/model prompt="Once upon a time" chat=false max_new_tokens=32
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        from relaytrain.commands.help import key_sections, option_groups
        from relaytrain.strategies import choices

        print(USAGE.format(strategies=", ".join(choices()), groups=", ".join(option_groups()),
                           sections=", ".join(key_sections())), end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "--version":
        from relaytrain import __version__

        print(f"relaytrain {__version__}")
        return 0
    commands = {"train": _train, "schedule": _schedule, "report": _report, "plan": _plan, "generate": _generate,
                "export": _export}
    if command not in commands:
        _fail(f"unknown command {command!r}; use `relaytrain {'`, `relaytrain '.join(commands)}` "
              f"(see relaytrain --help)")
        return EXIT_USAGE
    return _guard(lambda: commands[command](rest))


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


def parse_args(args: list[str], usage: str, values: tuple[str, ...] = (), repeated: tuple[str, ...] = (),
               flags: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """A subcommand's arguments: `--name VALUE` (or `--name=VALUE`) for `values` and `repeated`
    (a list), `--name` alone for `flags` and -h/--help, the rest (overrides, paths) in order.
    A mistake is one ConfigError line that ends with the usage."""
    options: dict = {"--help": True} if {"-h", "--help"} & set(args) else {}
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg in ("-h", "--help"):
            continue
        if name in flags and not eq:
            options[name] = True
        elif name in values or name in repeated:
            value = inline if eq else next(items, None)
            if not value:
                raise ConfigError(f"{name} needs a value; usage: {usage}")
            if name in repeated:
                options.setdefault(name, []).append(value)
            else:
                options[name] = value
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}; usage: {usage}")
        else:
            rest.append(arg)
    return options, rest


# ----------------------------------------------------------------------------- train


def _train(args: list[str]) -> int:
    if "--help" in args or "-h" in args:
        from relaytrain.commands.help import train_help
        from relaytrain.run.compose import compose

        print(train_help([a for a in args if not a.startswith("-")], compose), end="")
        return 0
    from relaytrain.placement.world import under_torchrun
    from relaytrain.run.dirs import recorded_overrides
    from relaytrain.utils.stdio import outliving_readers

    hydra_flags = {"--hydra-help", "--info", "--cfg", "-c", "--resolve", "--shell-completion", "-sc"}
    with outliving_readers():  # `relaytrain train | head`: the run outlives its reader
        if not hydra_flags.intersection(args):
            overrides = [a for a in args if not a.startswith("-")]
            say = (lambda line: None) if under_torchrun() and os.environ["RANK"] != "0" else print
            recorded = recorded_overrides(overrides, say)  # train.resume=PATH: the run's own config first
            args = [*recorded, *args]
            check_overrides([*recorded, *overrides], multirun="-m" in args or "--multirun" in args)
        return _run_hydra(args)


def _run_hydra(args: list[str]) -> int:
    import hydra

    from relaytrain.commands import sweep
    from relaytrain.run.compose import CONFIG_MODULE, register_schema

    register_schema()
    sweep.failed_jobs.clear()

    @hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
    def train_app(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from relaytrain.placement.world import pick_device
        from relaytrain.run.earlier import earlier_run
        from relaytrain.run.elastic import resume_key
        from relaytrain.run.train import run
        from relaytrain.utils.errors import Aborted, Interrupted

        hydra_cfg = HydraConfig.get()
        in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
        overrides = list(hydra_cfg.overrides.task)
        run_dir = hydra_cfg.runtime.output_dir
        try:
            device = pick_device(cfg.train.device)  # this job's, decided once
            resume = resume_key(cfg.train.resume, device.type)  # `auto` under a restart policy
            finished = earlier_run(resume, cfg.train.steps, Path(run_dir),  # refuses before the estimate's line
                                   "hydra.sweep.dir" if in_sweep else "hydra.run.dir") is not None  # nothing to estimate
            run(cfg, run_dir, overrides, table=not in_sweep,
                estimate=None if finished else _estimate(cfg, overrides, device), device=device)
        except (Interrupted, Aborted) as stop:  # the whole sweep stops too: the user asked
            print(f"relaytrain: {stop}", file=sys.stderr)
            sys.exit(128 + stop.signum)  # the shell's convention for "ended by this signal"
        except Exception as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _fail(first_line(err) if isinstance(err, ConfigError)
                  else f"{type(err).__name__}: {first_line(err)} (HYDRA_FULL_ERROR=1 shows the traceback)")
            if not in_sweep:
                sys.exit(EXIT_USAGE if isinstance(err, ConfigError) else 1)  # passes through Hydra's error report
            sweep.failed_jobs.append(run_dir)  # the sweep goes on; its table shows the row

    saved = sys.argv
    sys.argv = ["relaytrain train", *args]
    try:
        train_app()
    finally:
        sys.argv = saved
    if sweep.failed_jobs:
        _fail(f"{len(sweep.failed_jobs)} sweep job(s) failed; each said why in its line above")
        return 1
    return 0


def _estimate(cfg, overrides: list[str], device):
    """The planner's prediction of this run on its `device`, printed before it starts, on the
    process that shows progress; None for a dry run (it times nothing) or a config the planner
    cannot model."""
    from relaytrain.models.pretrained import explicit_overrides, resolve
    from relaytrain.placement.world import under_torchrun
    from relaytrain.planner.estimate import estimate
    from relaytrain.run.resolve import choose

    if device.type == "meta" or (under_torchrun() and int(os.environ["RANK"]) != 0):
        return None
    try:
        resolved = resolve(cfg, explicit_overrides(overrides))
        cls = choose(resolved).strategy
    except ConfigError:
        return None  # the run itself says what is wrong
    guess = estimate(resolved, cls)
    if guess is not None:
        print(guess.line(cfg.train.steps, device), flush=True)
    return guess


def check_overrides(overrides: list[str], multirun: bool = False) -> None:
    """Compose the config for these overrides (every combination of a sweep), validate it, and
    check this machine can start and hold it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from relaytrain.models.pretrained import explicit_overrides, resolve
    from relaytrain.placement.world import pick_device
    from relaytrain.records.trackers import check_trackers
    from relaytrain.run.compose import compose, validate
    from relaytrain.run.dirs import check_writable
    from relaytrain.run.preflight import check_can_start

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar errors
        raise ConfigError(f"cannot parse the overrides: {first_line(err)}") from err
    combos = _combinations(parsed) if multirun else [overrides]
    for combo in itertools.islice(combos, MAX_SWEEP_CHECKS):
        cfg = resolve(compose(combo), explicit_overrides(combo))
        chosen = validate(cfg)  # every name looked up once
        check_can_start(cfg, chosen.strategy, pick_device(cfg.train.device))
        check_trackers(cfg.log)
    check_writable(list(next(iter(_combinations(parsed)))) if multirun else overrides, multirun)


def _combinations(parsed) -> itertools.product:
    choices = []
    for o in parsed:
        key = o.get_key_element()
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return itertools.product(*choices)


# ----------------------------------------------------------------------------- schedule


def _schedule(args: list[str]) -> int:
    from relaytrain.strategies.pipeline.schedule import schedules

    options, overrides = parse_args(args, SCHEDULE_USAGE, values=("--out", "--batches", "--schedule"))
    names = " | ".join(schedules())
    if options.get("--help"):
        print(SCHEDULE_HELP.format(schedules=names), end="")
        return 0
    from relaytrain.run.compose import compose
    from relaytrain.run.resolve import choose
    from relaytrain.strategies.pipeline.view import check_image_path, show

    out = Path(options["--out"]) if "--out" in options else None
    if out is not None:
        check_image_path(out)  # before anything is printed: a failure leaves only its one line
    cfg = compose(overrides)
    s, cls = cfg.strategy, choose(cfg).strategy
    chosen = options.get("--schedule")
    schedule = schedules().get(chosen) if chosen else getattr(cls, "schedule", None)
    if schedule is None:
        given = f"--schedule {chosen}" if chosen else f"strategy={s.name}"
        raise ConfigError(f"{given} has no pipeline schedule; choose strategy= or --schedule among {names}")
    batches = _positive_int(options.get("--batches", str(schedule.batches_shown)), "--batches")
    show(schedule.build(s.stages, s.num_microbatches, batches, chunks=s.get("chunks", 1)), out,
         _layout_notes(cfg, cls))
    return 0


def _layout_notes(cfg, cls) -> list[str]:
    """The blocks each stage holds, where the config makes a pipeline a run would accept."""
    from relaytrain.strategies.pipeline.view import layout_line

    if not hasattr(cls, "stage_blocks"):
        return []
    try:
        cls.check_config(cfg)
    except ConfigError as e:
        return [f"layout not shown: {e}"]
    return [layout_line(cls, cfg)]


def _positive_int(value: str, name: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value} must be a positive integer")
    return int(value)


# ----------------------------------------------------------------------------- plan


def _plan(args: list[str]) -> int:
    options, overrides = parse_args(args, PLAN_USAGE, values=("--out",))
    if options.get("--help"):
        from relaytrain.cost.profile import spec_names

        print(PLAN_HELP.format(profiles=", ".join(spec_names())), end="")
        return 0
    from relaytrain.planner.output import infeasible_line, print_plan, write_plan
    from relaytrain.planner.plan import make_plan, out_dir

    plan = make_plan(overrides)
    where = out_dir(overrides, options.get("--out"))
    path = write_plan(plan, where)
    if plan.best is None:
        raise ConfigError(infeasible_line(plan, where))
    print_plan(plan, path)
    return 0


# ----------------------------------------------------------------------------- report


def _report(args: list[str]) -> int:
    options, paths = parse_args(args, REPORT_USAGE, values=("--sort", "--out"), repeated=("--filter",),
                                flags=("--json",))
    if options.get("--help"):
        print(REPORT_HELP, end="")
        return 0
    if not paths:
        raise ConfigError(f"give at least one run or sweep directory; usage: {REPORT_USAGE}")
    from relaytrain.commands.report.command import compare_runs

    compare_runs(paths, out=options.get("--out"), sort=options.get("--sort"), filters=options.get("--filter", []),
                 as_json=bool(options.get("--json")))
    return 0


# ----------------------------------------------------------------------------- generate


def _generate(args: list[str]) -> int:
    options, items = parse_args(args, GENERATE_USAGE)
    if options.get("--help"):
        print(GENERATE_HELP, end="")
        return 0
    from relaytrain.commands.generate import generate, parse_request

    answer = generate(parse_request(items))
    if answer.empty_because:  # stdout stays the answer alone: nothing; stderr says why
        print(f"relaytrain: {answer.empty_because}", file=sys.stderr)
    else:
        print(answer.text)
    return 0


# ----------------------------------------------------------------------------- export


def _export(args: list[str]) -> int:
    from relaytrain.commands.export import EXPORT_HELP, EXPORT_USAGE, export, parse_request

    options, items = parse_args(args, EXPORT_USAGE)
    if options.get("--help"):
        print(EXPORT_HELP, end="")
        return 0
    print(export(parse_request(items)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
