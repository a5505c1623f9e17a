"""`relaytrain report`: runs and sweeps side by side, so the ways of training one model can be compared.

    relaytrain report multirun/2025-01-31/10-00-00                   # one sweep: table, CSV and plots in it
    relaytrain report outputs/*/ --sort -samples_per_s --filter status=finished
    relaytrain report multirun/2025-01-31/10-00-00 --json > runs.json

Each run directory gives one row, read from what the run left there (`relaytrain.commands.report.runs`),
so a failed or interrupted job is a row with its status and error rather than a gap. The rows
go to one table (`relaytrain.commands.report.table`) or JSON, `summary.csv` (written here: plain numbers,
bytes in bytes, rates in units per second, plus one column per swept key) and, with matplotlib,
PNG plots (`relaytrain.commands.report.plots`). --filter and --sort choose and order the rows here.
"""

from __future__ import annotations

import csv
import difflib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console

from relaytrain.commands.report.plots import write_plots
from relaytrain.commands.report.runs import (
    COLUMNS,
    Run,
    cell_text,
    common_root,
    is_run_dir,
    natural_key,
    read_run,
    run_dirs,
    run_labels,
    shown_path,
    swept_keys,
    to_number,
)
from relaytrain.commands.report.table import print_table
from relaytrain.records.display import console
from relaytrain.utils.errors import ConfigError

_FILTER = re.compile(r"([^=!<>]+)(!=|=|>|<)(.*)")
_stderr = Console(stderr=True)


def compare_runs(paths: Iterable[str | Path], out: str | Path | None = None, sort: str | None = None,
              filters: Iterable[str] = (), as_json: bool = False) -> list[dict]:
    """Print one table (or the JSON rows) for these run and sweep directories, write summary.csv and
    the plots into `out`, and return the rows shown. Bad paths, columns or filters: ConfigError."""
    paths = [Path(p) for p in paths]
    runs = [read_run(d) for d in run_dirs(paths)]
    for run, label in zip(runs, run_labels([r.path for r in runs]), strict=True):
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
        print_table(shown, swept, common_root([r.path for r in runs]), console)
    _write_csv([r.row for r in shown], columns, out / "summary.csv")
    plots = write_plots(shown, out)
    names = ["summary.csv", *(p.name for p in plots or [])]
    _say(f"wrote {', '.join(names)} to {shown_path(out)}", as_json)
    if plots is None:
        _say("plots need matplotlib: pip install 'relaytrain[plot]'", as_json)
    return [r.row for r in shown]


def _say(line: str, as_json: bool) -> None:
    """One plain line (a path or `[plot]` is not markup); with --json on stderr: stdout is the JSON alone."""
    (_stderr if as_json else console).print(line, markup=False, highlight=False, soft_wrap=True)


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
    if op in "<>" and to_number(value) is None:
        raise ConfigError(f"--filter {expr!r}: {op} compares numbers, and {value!r} is not one "
                          f"(e.g. --filter {column}{op}10)")
    return column, op, value


def _matches(cell, op: str, value: str) -> bool:
    if op in "<>":
        number = to_number(cell)
        return number is not None and (number > float(value) if op == ">" else number < float(value))
    a, b = to_number(cell), to_number(value)
    equal = a == b if a is not None and b is not None else cell_text(cell) == value
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
    number = to_number(value)
    return (0, number) if number is not None else (1, natural_key(cell_text(value)))


# ----------------------------------------------------------------------------- output


def _out_dir(paths: list[Path], out: str | Path | None) -> Path:
    """--out, else the sweep when exactly one sweep was given, else the current directory."""
    if out is None:
        out = paths[0] if len(paths) == 1 and not is_run_dir(paths[0]) else Path.cwd()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([cell_text(row.get(c)) for c in columns] for row in rows)
