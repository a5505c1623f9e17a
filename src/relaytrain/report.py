"""`relaytrain report`: runs and sweeps side by side, so the ways of training one model can be compared.

    relaytrain report multirun/2025-01-31/10-00-00                   # one sweep: table, CSV and plots in it
    relaytrain report outputs/*/ --sort -samples_per_s --filter status=finished
    relaytrain report multirun/2025-01-31/10-00-00 --json > runs.json

Each run directory gives one row, read from what the run left there (`results.json`, and
`status.json`, `metrics.csv`, `.hydra/` from `runlog` and Hydra), so a failed or interrupted job
is a row with its status and error rather than a gap. The rows go to one table (or JSON),
`summary.csv` (plain numbers: bytes in bytes, rates in units per second, plus one column per
swept key) and, with matplotlib, PNG plots of throughput against memory, loss curves and
throughput against each numeric swept key.
"""

from __future__ import annotations

import csv
import difflib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from relaytrain import runlog
from relaytrain.display import console
from relaytrain.errors import ConfigError
from relaytrain.evaluation import METRICS
from relaytrain.units import si

COLUMNS = [
    "run", "status", "strategy", "model", "parameters", "microbatch_size", "num_microbatches", "replicas",
    "samples_per_step", "precision", "processes", "device", "steps", "samples_per_s", "tokens_per_s",
    "model_flops_per_s", "step_time_s", "peak_device_memory", "device_memory_simulated", "peak_host_rss",
    "host_rss_total", "final_loss", "eval_step", *(f"eval_{name}" for name in METRICS), "error", "path",
]
STATUS_STYLE = {runlog.FINISHED: "green", runlog.FAILED: "bold red", runlog.INTERRUPTED: "yellow",
                runlog.RUNNING: "cyan", "unknown": "dim"}
GIB = 2**30
# The table columns a narrow terminal loses first: derived or seldom decisive figures before the core ones.
LEAVE_OUT_FIRST = ("tokens/s", "model\nFLOP/s", "workers", "params", "precision", "model", "host RSS\n(GiB)",
                   "batch", "device mem\n(GiB)", "last\neval")
ERROR_WIDTH = 60  # an error line wraps at this width, or down to NARROW_ERROR_WIDTH on a narrow terminal
NARROW_ERROR_WIDTH = 30
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_FILTER = re.compile(r"([^=!<>]+)(!=|=|>|<)(.*)")
_HYDRA_JOB = re.compile(r"(\d+)_.*=.*")  # hydra.sweep.subdir: ${hydra.job.num}_${hydra.job.override_dirname}
_SAFE_NAME = re.compile(r"[^\w.=-]")  # what a swept key may keep in a file name
_stderr = Console(stderr=True)


@dataclass
class Run:
    """One run directory as read: its row (a summary.csv record), its loss curve and its overrides."""

    path: Path
    row: dict
    losses: list[tuple[float, float]]
    overrides: dict[str, str]
    label: str = ""  # the short name the table and the plots show


Column = tuple[str, str, Callable[[Run], str]]  # a table column: header, justification, cell text


def compare_runs(paths: Iterable[str | Path], out: str | Path | None = None, sort: str | None = None,
              filters: Iterable[str] = (), as_json: bool = False) -> list[dict]:
    """Print one table (or the JSON rows) for these run and sweep directories, write summary.csv and
    the plots into `out`, and return the rows shown. Bad paths, columns or filters: ConfigError."""
    paths = [Path(p) for p in paths]
    runs = [_read_run(d) for d in _run_dirs(paths)]
    for run, label in zip(runs, _labels([r.path for r in runs]), strict=True):
        run.label = label
    swept = [k for k in swept_keys([r.overrides for r in runs]) if k not in COLUMNS]  # strategy=: its column
    for run in runs:
        run.row.update({k: run.overrides.get(k) for k in swept})
    columns = COLUMNS + swept
    shown = _sorted(_filtered(runs, list(filters), columns), sort, columns)
    out = _out_dir(paths, out)
    if as_json:
        print(json.dumps([r.row for r in shown], indent=2))
    else:
        _print_table(shown, swept, _common_root([r.path for r in runs]))
    _write_csv([r.row for r in shown], columns, out / "summary.csv")
    plots = _write_plots(shown, out)
    names = ["summary.csv", *(p.name for p in plots or [])]
    _say(f"wrote {', '.join(names)} to {_shown_path(out)}", as_json)
    if plots is None:
        _say("plots need matplotlib: pip install 'relaytrain[plot]'", as_json)
    return [r.row for r in shown]


def _say(line: str, as_json: bool) -> None:
    """One plain line (a path or `[plot]` is not markup); with --json on stderr: stdout is the JSON alone."""
    (_stderr if as_json else console).print(line, markup=False, highlight=False, soft_wrap=True)


def swept_keys(overrides: list[dict[str, str]]) -> list[str]:
    """The override keys whose values differ between runs (a key some runs lack differs too), in the
    order they first appear: what a sweep varied, whatever the runs' directory names say."""
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    return [k for k in keys if len({o.get(k) for o in overrides}) > 1]


# ----------------------------------------------------------------------------- reading runs


def _is_run_dir(path: Path) -> bool:
    return (path / "results.json").is_file() or (path / runlog.STATUS).is_file()


def _run_dirs(paths: list[Path]) -> list[Path]:
    """Each path's run directories, each once: the path itself, or a sweep's jobs in job order."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory; give a run directory or a sweep directory "
                              f"(e.g. multirun/DATE/TIME)")
        jobs = [path] if _is_run_dir(path) else sorted(
            (d for d in path.iterdir() if d.is_dir() and _is_run_dir(d)), key=lambda d: _natural(d.name))
        if not jobs:
            raise ConfigError(f"{path} holds no run: neither it nor a directory directly inside it has "
                              "results.json or status.json; give a run or a sweep (multirun/DATE/TIME) "
                              "directory")
        found += [job.resolve() for job in jobs]
    return list(dict.fromkeys(found))


def _read_run(path: Path) -> Run:
    results = _read_json(path / "results.json")
    status = runlog.read_status(path) or {}
    metrics = runlog.read_metrics(path)
    row = dict.fromkeys(COLUMNS)
    row.update(run=path.name, path=str(path), error=status.get("error"),
               status=status.get("status") or (runlog.FINISHED if results else "unknown"))
    row.update(_from_results(results) if results else _from_config(path, status, metrics))
    losses = _loss_curve(results, metrics)
    row["final_loss"] = losses[-1][1] if losses else None
    row.update(_last_eval(results, metrics))
    return Run(path, row, losses, _overrides(path, results))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _from_results(results: dict) -> dict:
    model, t, memory = results["model"], results["throughput"], results["memory"]
    device = memory["device"]
    return {
        "strategy": results["strategy"], "model": model["name"], "parameters": model["parameters"],
        "microbatch_size": results["microbatch_size"], "num_microbatches": results["num_microbatches"],
        "replicas": results.get("replicas", 1), "samples_per_step": results["samples_per_step"],
        "precision": results["precision"], "processes": results["processes"], "device": results["device"],
        "steps": results["steps"], "samples_per_s": t["samples_per_s"], "tokens_per_s": t["tokens_per_s"],
        "model_flops_per_s": t["model_flops_per_s"], "step_time_s": t["step_time_s"],
        "peak_device_memory": device["peak_allocated_bytes"],
        "device_memory_simulated": bool(device.get("simulated")),
        "peak_host_rss": memory["host_peak_rss_bytes"],
        "host_rss_total": memory.get("host_peak_rss_total_bytes"),
    }


def _from_config(path: Path, status: dict, metrics: list[dict]) -> dict:
    """A run without results.json (failed, interrupted, running) still names its strategy, model and
    batch, from the config Hydra saved, so it groups and filters with the others."""
    try:
        cfg = yaml.safe_load((path / ".hydra" / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    strategy = cfg.get("strategy") or {}
    last_step = metrics[-1]["step"] if metrics and metrics[-1]["step"] is not None else None
    return {
        "strategy": strategy.get("name"),
        "model": (cfg.get("model") or {}).get("name"),
        "precision": (cfg.get("precision") or {}).get("name"),
        "microbatch_size": strategy.get("microbatch_size"),
        "num_microbatches": strategy.get("num_microbatches"),
        "replicas": strategy.get("replicas", 1 if strategy else None),  # a strategy without the key has one
        "steps": status.get("step", int(last_step) if last_step is not None else None),
    }


def _loss_curve(results: dict | None, metrics: list[dict]) -> list[tuple[float, float]]:
    """(step, loss) pairs: metrics.csv has the steps (a resumed run's too); results.json only the losses."""
    if metrics:
        return [(m["step"], m["loss"]) for m in metrics if m["step"] is not None and m["loss"] is not None]
    return [(float(step), loss) for step, loss in enumerate((results or {}).get("loss", []), start=1)]


def _last_eval(results: dict | None, metrics: list[dict]) -> dict:
    evals = (results or {}).get("eval") or [
        {"step": m["step"], **{k: m.get(f"eval_{k}") for k in METRICS}}
        for m in metrics if m.get("eval_loss") is not None]
    if not evals:
        return {}
    last = evals[-1]
    return {"eval_step": int(last["step"]), **{f"eval_{k}": last.get(k) for k in METRICS}}


def _overrides(path: Path, results: dict | None) -> dict[str, str]:
    """The overrides as typed (results.json's, else Hydra's record of them), key to value text; a
    `+`/`~` prefix only says how Hydra applied the key, so it is dropped."""
    typed = (results or {}).get("overrides")
    if typed is None:
        try:
            typed = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
        except (OSError, yaml.YAMLError):
            typed = []
    pairs = (str(o).partition("=") for o in typed)
    return {key.lstrip("+~"): value for key, eq, value in pairs if eq}


# ----------------------------------------------------------------------------- selecting rows


def _filtered(runs: list[Run], filters: list[str], columns: list[str]) -> list[Run]:
    tests = [_parse_filter(f, columns) for f in filters]
    return [r for r in runs if all(_matches(r.row.get(column), op, value) for column, op, value in tests)]


def _parse_filter(expr: str, columns: list[str]) -> tuple[str, str, str]:
    match = _FILTER.fullmatch(expr)
    if not match:
        raise ConfigError(f"--filter {expr!r} is not COLUMN=VALUE, COLUMN!=VALUE, COLUMN>NUMBER or "
                          f"COLUMN<NUMBER (e.g. --filter status=finished)")
    column, op, value = match.group(1).strip(), match.group(2), match.group(3).strip()
    _check_column(column, columns, "--filter")
    if op in "<>" and _number(value) is None:
        raise ConfigError(f"--filter {expr!r}: {op} compares numbers, and {value!r} is not one "
                          f"(e.g. --filter {column}{op}10)")
    return column, op, value


def _matches(cell, op: str, value: str) -> bool:
    if op in "<>":
        number = _number(cell)
        return number is not None and (number > float(value) if op == ">" else number < float(value))
    a, b = _number(cell), _number(value)
    equal = a == b if a is not None and b is not None else _text(cell) == value
    return equal if op == "=" else not equal


def _sorted(runs: list[Run], sort: str | None, columns: list[str]) -> list[Run]:
    """Ordered by a column, ascending (`-COLUMN`: descending); runs without a value go last either way."""
    if not sort:
        return runs
    column = sort.removeprefix("-")
    _check_column(column, columns, "--sort")
    present = [r for r in runs if r.row.get(column) not in (None, "")]
    missing = [r for r in runs if r.row.get(column) in (None, "")]
    return sorted(present, key=lambda r: _order(r.row[column]), reverse=sort.startswith("-")) + missing


def _check_column(column: str, columns: list[str], option: str) -> None:
    if column not in columns:
        hint = difflib.get_close_matches(column, columns, n=1)
        fix = f"did you mean {hint[0]}? " if hint else ""
        raise ConfigError(f"{option}: no column {column!r}; {fix}columns: {', '.join(columns)}")


def _order(value) -> tuple:
    """Numbers by value, text naturally (job 10 after job 9)."""
    number = _number(value)
    return (0, number) if number is not None else (1, _natural(_text(value)))


def _natural(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def _number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return float(value) if _NUMBER.fullmatch(str(value).strip()) else None


def _text(value) -> str:
    """A cell as summary.csv writes it and --filter compares it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ----------------------------------------------------------------------------- output


def _out_dir(paths: list[Path], out: str | Path | None) -> Path:
    """--out, else the sweep when exactly one sweep was given, else the current directory."""
    if out is None:
        out = paths[0] if len(paths) == 1 and not _is_run_dir(paths[0]) else Path.cwd()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([_text(row.get(c)) for c in columns] for row in rows)


def _common_root(paths: list[Path]) -> Path | None:
    return Path(os.path.commonpath([p.parent for p in paths])) if paths else None


def _labels(paths: list[Path]) -> list[str]:
    """Short run names: each path below the directory all runs share, and a Hydra job
    (`N_key=value,...`, named by every override) by its number N: its swept values get columns."""
    root = _common_root(paths)
    labels = []
    for path in paths:
        relative = path.relative_to(root)
        job = _HYDRA_JOB.fullmatch(relative.name)
        labels.append((relative.parent / job.group(1) if job else relative).as_posix())
    return labels


def _short(key: str) -> str:
    """A swept key as headers and legends show it: strategy.num_microbatches as num_microbatches."""
    return key.rpartition(".")[2]


def _shown_path(path: Path) -> str:
    """A path short enough to read: relative to the current directory when below it."""
    relative = os.path.relpath(Path(path).resolve(), Path.cwd())
    return str(Path(path).resolve()) if relative == "." or relative.startswith("..") else relative


def _print_table(runs: list[Run], swept: list[str], root: Path | None) -> None:
    """One table, without the columns no run has a value for. A log file or a pipe gets it whole,
    rather than wrapped to 80 columns; a terminal too narrow for it gets it fitted (`_fit`)."""
    columns = _table_columns(runs, swept)
    cells = [[cell(run) for _, _, cell in columns] for run in runs]
    kept = [i for i in range(len(columns)) if i == 0 or any(row[i] for row in cells)]
    notes = []
    if console.is_terminal and not _fits(columns, cells, kept):
        kept, notes = _fit(columns, cells, kept)
    where = f" in {_shown_path(root)}" if root is not None else ""
    title = f"relaytrain report · {len(runs)} run{'s' * (len(runs) != 1)}{where}"
    table = _table(title, columns, cells, kept, "\n".join(notes))
    if console.is_terminal:
        console.print(table)
    else:
        whole = Console(file=console.file, width=_natural_width(table), color_system=console.color_system)
        whole.print(table)


def _fit(columns: list[Column], cells: list[list[str]], kept: list[int]) -> tuple[list[int], list[str]]:
    """The columns every run shares become one caption line; then, while the table is still too wide,
    the least telling columns are left out (summary.csv has them all). Returns the columns and notes."""
    shared = [i for i in kept[1:] if len(cells) > 1 and len({row[i] for row in cells}) == 1]
    kept = [i for i in kept if i not in shared]
    same = [f"{_flat(columns[i][0])} {cells[0][i]}" for i in shared]
    notes = [f"every run: {' · '.join(same)}"] if same else []
    headers = [columns[i][0] for i in kept]
    left_out = []
    for header in LEAVE_OUT_FIRST:
        if _fits(columns, cells, kept):
            break
        if header in headers:
            kept.remove(kept[headers.index(header)])
            headers.remove(header)
            left_out.append(_flat(header))
    if left_out:
        notes.append(f"left out to fit the terminal (summary.csv has them): {', '.join(left_out)}")
    return kept, notes


def _fits(columns: list[Column], cells: list[list[str]], kept: list[int]) -> bool:
    """Whether the table fits the terminal with its error lines wrapped as narrow as they may be."""
    return _natural_width(_table("", columns, cells, kept, error_width=NARROW_ERROR_WIDTH)) <= console.width


def _natural_width(table: Table) -> int:
    return console.measure(table, options=console.options.update(width=10_000)).maximum


def _flat(header: str) -> str:
    return header.replace("\n", " ")


def _table(title: str, columns: list[Column], cells: list[list[str]], kept: list[int], caption: str = "",
           error_width: int = ERROR_WIDTH) -> Table:
    """Title, caption and cells are plain text: a path or an override such as `[0.9,0.99]` is not markup."""
    table = Table(title=Text(title), caption=Text(caption) if caption else None, title_style="bold",
                  box=box.SIMPLE_HEAD, show_edge=False)
    for i in kept:
        header, justify, _ = columns[i]
        if header in ("run", "last\neval", "error"):  # text: wraps when the terminal is narrow
            width = error_width if header == "error" else None
            table.add_column(header, justify=justify, overflow="fold", max_width=width)
        else:  # a figure or a name: never broken across lines
            table.add_column(header, justify=justify, no_wrap=True)
    for row in cells:
        table.add_row(*(Text(row[i], style=STATUS_STYLE.get(row[i], "") if columns[i][0] == "status" else "")
                        for i in kept))
    return table


def _table_columns(runs: list[Run], swept: list[str]) -> list[Column]:
    """(header, justification, cell text) for each column the table can show, the run's name first."""
    def number(column: str, fmt: Callable[[float], str]) -> Callable[[Run], str]:
        return lambda run: "" if run.row[column] is None else fmt(run.row[column])

    return [
        ("run", "left", lambda run: run.label),
        *((_short(k), "right" if _numeric(runs, k) else "left", lambda run, k=k: _text(run.row[k]))
          for k in swept),
        ("status", "left", lambda run: run.row["status"]),
        ("strategy", "left", lambda run: run.row["strategy"] or ""),
        ("model", "left", lambda run: run.row["model"] or ""),
        ("params", "right", number("parameters", si)),
        ("batch", "right", lambda run: _batch(run.row)),
        ("precision", "left", lambda run: run.row["precision"] or ""),
        ("workers", "right", number("processes", str)),
        ("samples/s", "right", number("samples_per_s", si)),
        ("tokens/s", "right", number("tokens_per_s", si)),
        ("model\nFLOP/s", "right", number("model_flops_per_s", si)),
        ("device mem\n(GiB)", "right", lambda run: _device_memory(run.row)),
        ("host RSS\n(GiB)", "right", number("peak_host_rss", lambda b: f"{b / GIB:.2f}")),
        ("final\nloss", "right", number("final_loss", lambda loss: f"{loss:.4f}")),
        ("last\neval", "left", lambda run: _eval_text(run.row)),
        ("error", "left", lambda run: run.row["error"] or ""),
    ]


def _batch(row: dict) -> str:
    """micro-batches x micro-batch size, per replica; "x R replicas" when the step is split across R."""
    if row["num_microbatches"] is None or row["microbatch_size"] is None:
        return ""
    replicas = row["replicas"] or 1
    shape = f"{row['num_microbatches']}x{row['microbatch_size']}"
    return f"{shape} x{replicas} replicas" if replicas > 1 else shape


def _device_memory(row: dict) -> str:
    if row["peak_device_memory"] is None:
        return "n/a (CPU)" if str(row["device"] or "").startswith("cpu") else ""
    gib = f"{row['peak_device_memory'] / GIB:.2f}"
    return f"{gib} (simulated)" if row["device_memory_simulated"] else gib


def _eval_text(row: dict) -> str:
    """The last evaluation's headline figure: accuracy, else perplexity, else loss; GLUE's own metric too."""
    if row["eval_step"] is None:
        return ""
    if row["eval_accuracy"] is not None:
        figures = [f"acc {row['eval_accuracy']:.2f}"]
    elif row["eval_perplexity"] is not None:
        figures = [f"ppl {row['eval_perplexity']:.1f}"]
    else:
        figures = [f"loss {row['eval_loss']:.2f}"]
    for name, key in (("mcc", "eval_matthews_correlation"), ("f1", "eval_f1")):
        if row[key] is not None:
            figures.append(f"{name} {row[key]:.2f}")
    return f"{', '.join(figures)} @ step {row['eval_step']}"


# ----------------------------------------------------------------------------- plots

PLOT_STYLE = {
    "font.size": 11, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 9,
    "legend.title_fontsize": 10, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False,
}
MARKERS = "osD^vP*X"


def _write_plots(runs: list[Run], out: Path) -> list[Path] | None:
    """The PNGs that have something to show, or None without matplotlib (an optional dependency).
    Figures are drawn on the Agg canvas directly: no pyplot state, no GUI backend, safe in a callback."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    varying = swept_keys([r.overrides for r in runs])
    plots = [("throughput_vs_memory.png", lambda ax: _throughput_vs_memory(ax, runs, varying)),
             ("loss_curves.png", lambda ax: _loss_curves(ax, runs, varying))]
    plots += [(f"throughput_vs_{_SAFE_NAME.sub('_', key)}.png",
               lambda ax, key=key: _throughput_vs_key(ax, runs, key, varying))
              for key in varying if _numeric(runs, key)]
    written = []
    with matplotlib.rc_context(PLOT_STYLE):
        for name, draw in plots:
            figure = Figure(figsize=(9, 5.5), layout="constrained")
            FigureCanvasAgg(figure)
            if draw(figure.subplots()):
                figure.savefig(out / name, dpi=130)
                written.append(out / name)
    return written


def _numeric(runs: list[Run], key: str) -> bool:
    """Whether every run that sets this override gives it a number (a swept size, rather than a choice)."""
    values = [r.overrides[key] for r in runs if key in r.overrides]
    return bool(values) and all(_number(v) is not None for v in values)


def _plot_label(run: Run, varying: list[str], omit: tuple[str, ...] = ()) -> str:
    """A run as a plot names it: a Hydra job's number says little there, so its swept values follow it."""
    values = _swept_values(run, [k for k in varying if k not in omit])
    is_job_number = run.label.rpartition("/")[2].isdigit()
    return f"{run.label}: {', '.join(values)}" if values and is_job_number else run.label


def _swept_values(run: Run, keys: list[str]) -> list[str]:
    return [f"{_short(k)}={run.overrides[k]}" for k in keys if k in run.overrides]


def _by_strategy(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.row["strategy"] or "?", []).append(run)
    return groups


def _throughput_vs_memory(ax, runs: list[Run], varying: list[str]) -> bool:
    """samples/s against the peak memory every run has: the device's when all report it, else host RSS."""
    measured = [r for r in runs if r.row["samples_per_s"] is not None]
    on_device = bool(measured) and all(r.row["peak_device_memory"] is not None for r in measured)
    if on_device:
        column, what = "peak_device_memory", "peak device memory"
        what += " (simulated)" if any(r.row["device_memory_simulated"] for r in measured) else ""
    else:
        column, what = "peak_host_rss", "peak host RSS"
    points = [r for r in measured if r.row[column] is not None]
    if not points:
        return False
    for i, (strategy, group) in enumerate(_by_strategy(points).items()):
        xs, ys = [r.row[column] / GIB for r in group], [r.row["samples_per_s"] for r in group]
        ax.scatter(xs, ys, s=70, marker=MARKERS[i % len(MARKERS)], color=f"C{i}", label=strategy, zorder=3)
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.1)  # from zero: a 1% difference in memory looks like one
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    middle = sum(ax.get_xlim()) / 2
    for run in points:  # labels point inwards, so none runs off the axes
        x = run.row[column] / GIB
        ax.annotate(_plot_label(run, varying, omit=("strategy",)), (x, run.row["samples_per_s"]),
                    xytext=(-7 if x > middle else 7, 5), textcoords="offset points",
                    ha="right" if x > middle else "left", fontsize=8, color="0.3")
    ax.set(title=f"Throughput against {what}", xlabel=f"{what} (GiB)", ylabel="throughput (samples/s)")
    ax.legend(title="strategy")
    return True


def _loss_curves(ax, runs: list[Run], varying: list[str]) -> bool:
    """Every run's training loss per step; a run that did not finish is dashed and says why in the legend."""
    from matplotlib.ticker import MaxNLocator

    drawn = [r for r in runs if r.losses]
    for i, run in enumerate(drawn):  # markers tell apart runs whose losses coincide (equivalent strategies)
        steps, losses = zip(*run.losses, strict=True)
        finished = run.row["status"] == runlog.FINISHED
        label = _plot_label(run, varying) + ("" if finished else f" ({run.row['status']})")
        ax.plot(steps, losses, linestyle="-" if finished else "--", linewidth=1.6, label=label,
                marker=MARKERS[i % len(MARKERS)], markersize=6, fillstyle="none",
                markevery=max(1, len(steps) // 12))
    if not drawn:
        return False
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title="Training loss", xlabel="step", ylabel="loss (mean per item)")
    _legend(ax, len(drawn), "run")
    return True


def _throughput_vs_key(ax, runs: list[Run], key: str, varying: list[str]) -> bool:
    """samples/s against one numeric swept key; a line joins runs that differ only in that key."""
    others = [k for k in varying if k not in (key, "strategy")]
    series: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        x = _number(run.overrides.get(key))
        if x is None or run.row["samples_per_s"] is None:
            continue
        label = ", ".join([run.row["strategy"] or "?", *_swept_values(run, others)])
        series.setdefault(label, []).append((x, run.row["samples_per_s"]))
    xs = sorted({x for points in series.values() for x, _ in points})
    if len(xs) < 2:
        return False
    for i, (label, points) in enumerate(series.items()):
        px, py = zip(*sorted(points), strict=True)
        ax.plot(px, py, marker=MARKERS[i % len(MARKERS)], markersize=7, linewidth=1.8, label=label)
    if xs[0] > 0 and xs[-1] / xs[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
    ax.set(title=f"Throughput against {key}", xlabel=key, ylabel="throughput (samples/s)")
    _legend(ax, len(series), ", ".join(["strategy", *map(_short, others)]))
    return True


def _legend(ax, entries: int, title: str) -> None:
    """Inside the axes while it is short; beside them once it would cover the lines."""
    if entries > 6:
        ax.legend(title=title, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(title=title)
