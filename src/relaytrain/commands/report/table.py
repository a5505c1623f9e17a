"""The table of `relaytrain report`: one row per run, without the columns no run has a value for.

A table wider than the terminal (or than WIDE columns, in a log file or a pipe) is fitted: the
columns every run shares become one caption line, the overrides that differ between runs one
wrapped column, then the least telling columns are left out (summary.csv has them all). Every
cell is plain text: a path or an override such as `[0.9,0.99]` is not markup.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from relaytrain.commands.report.runs import GIB, Run, cell_text, numeric_key, short_keys, shown_path
from relaytrain.records import runlog
from relaytrain.utils.units import si

STATUS_STYLE = {runlog.FINISHED: "green", runlog.FAILED: "bold red", runlog.INTERRUPTED: "yellow",
                runlog.RUNNING: "cyan", "unknown": "dim"}
# The table columns a narrow terminal loses first: derived or seldom decisive figures before the core ones.
LEAVE_OUT_FIRST = ("tokens/s", "model\nFLOP/s", "workers", "params", "precision", "model", "host RSS\n(GiB)",
                   "batch", "device mem\n(GiB)", "last\neval")
WIDE = 160  # the widest table a log file or a pipe gets: wide enough for a sweep, narrow enough to read
OVERRIDES = "overrides"  # the one column the differing overrides become when their own columns do not fit
# The widest a wrapped column grows, and (narrow) the least it is squeezed to when fitting the table
WRAP_WIDTH = {"error": 60, OVERRIDES: 40}
NARROW_WRAP_WIDTH = {"error": 30, OVERRIDES: 24}
WRAPPED = ("run", OVERRIDES, "last\neval", "error")  # text columns: they wrap rather than widen the table
Column = tuple[str, str, Callable[[Run], str]]  # a table column: header, justification, cell text


def print_table(runs: list[Run], swept: list[str], root: Path | None, console: Console) -> None:
    """One table on `console`, without the columns no run has a value for, fitted (`_fit`) to the
    terminal or, in a log file or a pipe (which Rich would wrap at 80 columns), to WIDE columns."""
    width = console.width if console.is_terminal else WIDE
    columns = _table_columns(runs, swept)
    cells = [[cell(run) for _, _, cell in columns] for run in runs]
    kept = [i for i in range(len(columns)) if i == 0 or any(row[i] for row in cells)]
    notes = []
    if not _fits(columns, cells, kept, console, width):
        columns, cells, kept, notes = _fit(columns, cells, kept, swept, console, width)
    where = f" in {shown_path(root)}" if root is not None else ""
    title = f"relaytrain report · {len(runs)} run{'s' * (len(runs) != 1)}{where}"
    table = _table(title, columns, cells, kept, "\n".join(notes))
    if console.is_terminal:
        console.print(table)
    else:  # as wide as the table, up to WIDE: past it, Rich wraps the text columns and shortens the rest
        fitted = Console(file=console.file, width=min(_natural_width(table, console), width),
                         color_system=console.color_system)
        fitted.print(table)


def _fit(columns: list[Column], cells: list[list[str]], kept: list[int], swept: list[str], console: Console,
         width: int) -> tuple[list[Column], list[list[str]], list[int], list[str]]:
    """The columns every run shares become one caption line; the columns of the `swept` overrides
    (after the run's) one wrapped column of KEY=VALUE where that is narrower; then, while the table
    is still too wide, the least telling columns are left out (summary.csv has them all). Returns
    the columns, cells, kept and notes."""
    shared = [i for i in kept[1:] if len(cells) > 1 and len({row[i] for row in cells}) == 1]
    kept = [i for i in kept if i not in shared]
    same = [f"{_flat(columns[i][0])} {cells[0][i]}" for i in shared]
    notes = [f"every run: {' · '.join(same)}"] if same else []
    differing = {i: swept[i - 1] for i in kept if 1 <= i <= len(swept)}
    if len(differing) > 1 and not _fits(columns, cells, kept, console, width):
        merged = _overrides_in_one_column(columns, cells, kept, differing)
        if _width(*merged, console, WRAP_WIDTH) < _width(columns, cells, kept, console, WRAP_WIDTH):
            columns, cells, kept = merged
    headers = [columns[i][0] for i in kept]
    left_out = []
    for header in LEAVE_OUT_FIRST:
        if _fits(columns, cells, kept, console, width):
            break
        if header in headers:
            kept.remove(kept[headers.index(header)])
            headers.remove(header)
            left_out.append(_flat(header))
    if left_out:
        notes.append(f"left out to fit {'the terminal' if console.is_terminal else f'{width} columns'} "
                     f"(summary.csv has them): {', '.join(left_out)}")
    return columns, cells, kept, notes


def _overrides_in_one_column(columns: list[Column], cells: list[list[str]], kept: list[int],
                             differing: dict[int, str]) -> tuple[list[Column], list[list[str]], list[int]]:
    """The `differing` override columns (index: key) as one column in their place, each row
    `KEY=VALUE ...` for the keys it sets, each key whole (its column's header was its last part)."""
    def merged(row: list[str]) -> str:
        return " ".join(f"{key}={row[i]}" for i, key in differing.items() if row[i])

    at, first = len(columns), min(differing)
    columns = [*columns, (OVERRIDES, "left", lambda run: "")]
    cells = [[*row, merged(row)] for row in cells]
    kept = [at if i == first else i for i in kept if i not in differing or i == first]
    return columns, cells, kept


def _fits(columns: list[Column], cells: list[list[str]], kept: list[int], console: Console, width: int) -> bool:
    return _width(columns, cells, kept, console) <= width


def _width(columns: list[Column], cells: list[list[str]], kept: list[int], console: Console,
           wrap_width: dict[str, int] = NARROW_WRAP_WIDTH) -> int:
    """The table's width, its errors and overrides wrapped at `wrap_width` (as narrow as they may be)."""
    return _natural_width(_table("", columns, cells, kept, wrap_width=wrap_width), console)


def _natural_width(table: Table, console: Console) -> int:
    return console.measure(table, options=console.options.update(width=10_000)).maximum


def _flat(header: str) -> str:
    return header.replace("\n", " ")


def _table(title: str, columns: list[Column], cells: list[list[str]], kept: list[int], caption: str = "",
           wrap_width: dict[str, int] = WRAP_WIDTH) -> Table:
    """Title, caption and cells are plain text: a path or an override such as `[0.9,0.99]` is not markup."""
    table = Table(title=Text(title), caption=Text(caption) if caption else None, title_style="bold",
                  box=box.SIMPLE_HEAD, show_edge=False)
    for i in kept:
        header, justify, _ = columns[i]
        if header in WRAPPED:  # text: wraps when the terminal is narrow
            table.add_column(header, justify=justify, overflow="fold", max_width=wrap_width.get(header))
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
        *((header, "right" if numeric_key(runs, k) else "left", lambda run, k=k: cell_text(run.row[k]))
          for k, header in short_keys(swept).items()),
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
