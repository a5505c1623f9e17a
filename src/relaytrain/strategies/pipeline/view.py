"""A schedule's timeline as in the PipeDream-2BW paper's Figures 1-3 (`relaytrain schedule`).

Rows are stages, columns time units from the schedule's replay with a backward costing
twice a forward (the papers' convention). Each box shows the micro-batch id, 1-based as in
the figures; forwards and backwards have their own colours, and the colours switch with the
weight version the work uses, so 2BW's version changes show as colour changes (under an
interleaved schedule the colours tell the model chunks apart instead, as the survey's Fig. 9
does). Without colour (piped, NO_COLOR) every box reads on its own: `|F12` / `|B12` for a
forward / backward on an even weight version, `|f12` / `|b12` on an odd one (interleaved: the
chunk's letter follows, `|F12a`, and lower case marks an odd chunk). A timeline wider than
the console is split into bands of time columns. The same picture, with a legend, goes to
SVG (no extra dependency) or PNG (needs matplotlib). Whatever the schedule, the drawing asks
it only for its programs, its name, its legend and its bubble.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from relaytrain.strategies.pipeline.schedule import Op, Schedule
from relaytrain.strategies.pipeline.validate import Timeline, check_schedule
from relaytrain.utils.errors import ConfigError

LABEL = 9  # characters of the "stage N  " column before the timeline
TICK = 5  # time units between two labels of the time axis
# (forward, backward) colours for even and odd weight versions
STYLES = {0: ("bold white on blue", "bold black on green"),
          1: ("bold white on magenta", "bold black on yellow")}
SVG_FILL = {0: ("#3b6fd8", "#4caf50"), 1: ("#b04cc8", "#e6c229")}
PARITY = {0: "even", 1: "odd"}
SWITCH_NOTE = "black bar: new weight version (optimizer step)"
SWITCH_FILL = "#000000"  # the legend's bar: black, yet not counted among the grid's fill="black" switch bars


def show(schedule: Schedule, out: Path | None = None, notes: list[str] | None = None) -> None:
    """Print the schedule's grid and what it shows in words (and `notes`); with `out`, write the image too."""
    if out is not None:
        check_image_path(out)  # before anything is printed: a failure leaves only its one line
    timeline = check_schedule(schedule)
    console = Console()
    console.print(render_grid(schedule, timeline, console.width, plain=is_plain(console)), highlight=False)
    for line in [*describe(schedule, timeline), *(notes or [])]:
        console.print(line, highlight=False)
    if out is not None:
        console.print(f"wrote {write_image(schedule, timeline, out)}", highlight=False)


# ----------------------------------------------------------------------- boxes


@dataclass(frozen=True)
class Box:
    """One forward or backward of the replay: what every rendering draws."""

    stage: int
    start: float
    end: float
    microbatch: int  # 1-based, as in the figures
    forward: bool
    odd: bool  # the second shade: an odd weight version (an odd model chunk, interleaved): the figures' colour switch
    chunk_mark: str = ""  # the model chunk's letter, where a stage holds several

    @property
    def fill(self) -> str:
        return SVG_FILL[self.odd][0 if self.forward else 1]

    @property
    def style(self) -> str:
        return STYLES[self.odd][0 if self.forward else 1]

    @property
    def code(self) -> str:
        """The box without colour: F/B for forward/backward, lower case in the second shade."""
        letter = "F" if self.forward else "B"
        return (letter.lower() if self.odd else letter) + str(self.microbatch) + self.chunk_mark


def layout_line(cls, cfg) -> str:
    """The blocks each stage of pipeline strategy `cls` holds under `cfg`: the split a run uses
    (`model_chunks`, whatever `strategy.layout` says), the embeddings on stage 0 and the head on the last."""
    d = cfg.strategy.stages

    def blocks(r: range) -> str:
        return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"

    stages = []
    for stage in range(d):
        held = cls.stage_blocks(cfg, stage)
        word = "block" if sum(len(r) for r in held) == 1 else "blocks"
        ends = " + embeddings" if stage == 0 else " + head" if stage == d - 1 else ""
        stages.append(f"stage {stage}: {word} {', '.join(blocks(r) for r in held)}{ends}")
    counts = cls.state_layout(cfg)["stages"]
    return f"layout {cfg.strategy.layout} {counts}: " + "; ".join(stages)


def shaded_by(schedule: Schedule) -> str:
    """What the two shades tell apart: weight versions, or (several chunks a stage) model chunks."""
    return "model chunk" if schedule.chunks > 1 else "weight version"


def boxes(schedule: Schedule, timeline: Timeline) -> list[Box]:
    chunked = schedule.chunks > 1
    return [
        Box(stage, e.start, e.end, e.action.microbatch + 1, forward=e.action.op is Op.FORWARD,
            odd=(e.action.chunk if chunked else e.action.version) % 2 == 1,
            chunk_mark=chr(ord("a") + e.action.chunk) if chunked else "")
        for stage, events in enumerate(timeline.events)
        for e in events
        if e.action.op in (Op.FORWARD, Op.BACKWARD)
    ]


def version_switches(timeline: Timeline) -> list[tuple[int, float]]:
    """(stage, time) of every optimizer step: where a stage's new weight version appears."""
    return [(stage, e.start) for stage, events in enumerate(timeline.events) for e in events
            if e.action.op is Op.OPTIMIZER_STEP]


# ----------------------------------------------------------------------- terminal


def is_plain(console: Console) -> bool:
    """No colour reaches the reader (a pipe, a file, NO_COLOR, a dumb terminal): boxes must read as text."""
    return console.color_system is None or console.no_color


def cell_width(schedule: Schedule) -> int:
    """Characters per time unit: the largest id plus two (three with a chunk's letter), so even a
    one-unit forward keeps a separator and a letter (plain) or a space on each side (colour)
    around its id."""
    return len(str(schedule.total_microbatches)) + 2 + (schedule.chunks > 1)


def render_grid(schedule: Schedule, timeline: Timeline, width: int | None = None,
                plain: bool = False) -> Text:
    """The timeline as text, split into bands of time columns that fit in `width` characters
    (one band if None), so a narrow terminal never wraps a row into the next one."""
    cell, span = cell_width(schedule), math.ceil(timeline.makespan)
    per_band = span if width is None else _band_units(width, cell)
    rows = [[b for b in boxes(schedule, timeline) if b.stage == stage] for stage in range(schedule.stages)]
    chunks = f" of {schedule.chunks} model chunks" if schedule.chunks > 1 else ""
    text = Text(f"{schedule.name}: {schedule.stages} stages{chunks}, {schedule.num_microbatches} micro-batches "
                f"per update, {schedule.num_batches} updates\ntime units: forward = 1, backward = 2\n")
    for first in range(0, span, per_band):
        if first:
            text.append("\n")
        text.append_text(_band(rows, first, min(first + per_band, span), cell, plain))
    shade = shaded_by(schedule)
    text.append_text(_plain_legend(span > per_band, shade) if plain else _colour_legend(shade))
    return text


def _band_units(width: int, cell: int) -> int:
    """Time units per band: as many as fit, rounded down to whole axis ticks when possible."""
    units = max(1, (width - LABEL) // cell)
    return units - units % TICK if units >= TICK else units


def _band(rows: list[list[Box]], first: int, end: int, cell: int, plain: bool) -> Text:
    """Time units [first, end): a time axis, then one line per stage."""
    axis = [" "] * ((end - first) * cell)
    for t in range(first + (-first) % TICK, end, TICK):
        label, at = str(t), (t - first) * cell
        if at + len(label) <= len(axis):
            axis[at:at + len(label)] = label
    text = Text().append(" " * LABEL + "".join(axis).rstrip() + "\n", style="dim")
    for stage, row in enumerate(rows):
        text.append(f"stage {stage:<2} ", style="bold")
        text.append_text(_row(row, first, end, cell, plain))
        text.append("\n")
    return text


def _row(row: list[Box], first: int, end: int, cell: int, plain: bool) -> Text:
    """One stage's boxes clipped to the band; idle time is dotted so it never reads as a box."""
    idle = "." if plain else "·"
    text, cursor = Text(), first
    for box in row:
        start, stop = max(round(box.start), first), min(round(box.end), end)
        if stop <= start:
            continue
        text.append(idle * ((start - cursor) * cell), style="dim")
        text.append_text(_box_text(box, (stop - start) * cell, box.start < first, plain))
        cursor = stop
    text.append(idle * ((end - cursor) * cell), style="dim")
    return text


def _box_text(box: Box, chars: int, continued: bool, plain: bool) -> Text:
    """A box `chars` wide. Plain: a separator (`~` when the box began in the band before), its
    code, padding. Colour: the id centred on the box's colour, a space at least on each side."""
    if plain:
        return Text(f"{'~' if continued else '|'}{box.code}".ljust(chars))
    return Text(f"{box.microbatch:^{chars}}", style=box.style)


def _colour_legend(shade: str) -> Text:
    text = Text("legend: ", style="dim")
    for parity, (forward_style, backward_style) in STYLES.items():
        text.append(" forward ", style=forward_style).append(" ").append(" backward ", style=backward_style)
        text.append(f" {PARITY[parity]} {shade}   ", style="dim")
    return text.append("\n        numbers: micro-batch ids; · idle", style="dim")


def _plain_legend(banded: bool, shade: str) -> Text:
    mark = "a" if shade == "model chunk" else ""
    lines = [f"legend: |F7{mark} forward, |B7{mark} backward of micro-batch 7, even {shade}",
             f"        |f7{'b' if mark else ''} forward, |b7{'b' if mark else ''} backward, odd {shade}; . idle"]
    if mark:
        lines.append("        a, b, ...: the stage's model chunk (its first, second, ...)")
    if banded:
        lines.append("        ~B7 continues a box from the band above")
    return Text("\n".join(lines))


def describe(schedule: Schedule, timeline: Timeline) -> list[str]:
    """The figures the grid shows, in words: bubble, and when each stage's versions change."""
    lines = [schedule.legend,
             f"bubble (idle share of stage time): {timeline.bubble_fraction():.3f} in this replay; formula: "
             f"{schedule.bubble_words(schedule.stages, schedule.num_microbatches, schedule.chunks)}"]
    for stage, events in enumerate(timeline.events):
        changes = [_version_change(e, events) for e in events if e.action.op is Op.OPTIMIZER_STEP]
        lines.append(f"stage {stage}: " + "; ".join(changes))
    return lines


def _version_change(step, events) -> str:
    version = step.action.version
    first_use = next((e for e in events if e.action.op is Op.FORWARD and e.action.version == version), None)
    used = (f", first used by micro-batch {first_use.action.microbatch + 1} at t={first_use.start:g}"
            if first_use else "")
    return f"v{version} made at t={step.start:g}{used}"


# ----------------------------------------------------------------------- images


def legend_entries(shade: str = "weight version") -> list[tuple[str, str]]:
    """(fill, text) for each colour of the images, the version-switch bar last."""
    entries = [(SVG_FILL[parity][i], f"{what}, {PARITY[parity]} {shade}")
               for parity in SVG_FILL for i, what in enumerate(("forward", "backward"))]
    return [*entries, (SWITCH_FILL, SWITCH_NOTE)]


def check_image_path(path: Path) -> None:
    """Refuse an image `write_image` cannot write, before the command draws anything."""
    if path.suffix.lower() == ".png":
        _figure_class(path)
    elif path.suffix.lower() != ".svg":
        raise ConfigError(f"--out {path}: write .svg (no extra dependency) or .png (needs matplotlib)")


def write_image(schedule: Schedule, timeline: Timeline, path: Path) -> Path:
    check_image_path(path)
    if path.suffix.lower() == ".svg":
        path.write_text(render_svg(schedule, timeline))
    else:
        png_figure(schedule, timeline).savefig(path, dpi=120, bbox_inches="tight")
    return path


def render_svg(schedule: Schedule, timeline: Timeline, unit: int = 18, row: int = 28) -> str:
    """The grid as SVG, with the legend below the boxes so it covers none of them."""
    left, top = 70, 30
    grid_bottom = top + schedule.stages * row
    legend, legend_width, legend_height = _svg_legend(grid_bottom + 8, shaded_by(schedule))
    width = max(left + int(timeline.makespan * unit) + 10, legend_width)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{grid_bottom + 8 + legend_height}" '
        f'font-family="monospace" font-size="11">',
        f'<text x="4" y="16">{schedule.name}: d={schedule.stages}, m={schedule.num_microbatches}, '
        f'{schedule.num_batches} updates (black bars: new weight version)</text>',
    ]
    for stage in range(schedule.stages):
        parts.append(f'<text x="4" y="{top + stage * row + row * 0.6:.0f}">stage {stage}</text>')
    for box in boxes(schedule, timeline):
        x, y, w = left + box.start * unit, top + box.stage * row, (box.end - box.start) * unit
        parts.append(f'<rect x="{x:.0f}" y="{y}" width="{w:.0f}" height="{row - 4}" '
                     f'fill="{box.fill}" stroke="white"/>')
        parts.append(f'<text x="{x + w / 2:.0f}" y="{y + row * 0.6:.0f}" '
                     f'text-anchor="middle" fill="white">{box.microbatch}</text>')
    for stage, time in version_switches(timeline):
        x, y = left + time * unit, top + stage * row
        parts.append(f'<rect x="{x - 1:.0f}" y="{y - 2}" width="3" height="{row}" fill="black"/>')
    parts += [*legend, "</svg>"]
    return "\n".join(parts) + "\n"


def _svg_legend(top: int, shade: str, line: int = 16, column: int = 250) -> tuple[list[str], int, int]:
    """Legend items two to a line (forward, backward of one version; then the bar), and its size."""
    parts = []
    entries = legend_entries(shade)
    for i, (fill, label) in enumerate(entries):
        x, y = 4 + (i % 2) * column, top + (i // 2) * line
        swatch = (f'<path d="M{x + 5} {y}h3v12h-3z" fill="{fill}"/>' if label == SWITCH_NOTE else
                  f'<path d="M{x} {y}h14v12h-14z" fill="{fill}"/>')
        parts += [swatch, f'<text x="{x + 20}" y="{y + 10}">{label}</text>']
    lines = math.ceil(len(entries) / 2)
    return parts, 4 + 2 * column, lines * line + 4


def _figure_class(path: Path):
    """matplotlib's Figure, or the one-line error naming the fix (matplotlib is an optional extra)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ConfigError(
            f"--out {path.name} needs matplotlib: pip install matplotlib (or relaytrain[plot]); "
            f"--out {path.with_suffix('.svg').name} needs nothing extra"
        ) from err
    return Figure


def png_figure(schedule: Schedule, timeline: Timeline):
    """The grid as a matplotlib Figure (no pyplot, so no global state or GUI backend), with
    the legend outside the axes, below them, so it covers no box."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure_class = _figure_class(Path("schedule.png"))
    size = (max(7.0, timeline.makespan * 0.25), 0.6 * schedule.stages + 2)  # + 1 inch for the legend
    fig = figure_class(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    for box in boxes(schedule, timeline):
        ax.barh(box.stage, box.end - box.start, left=box.start, color=box.fill, edgecolor="white")
        ax.text((box.start + box.end) / 2, box.stage, str(box.microbatch), ha="center", va="center",
                color="white", fontsize=8)
    for stage, time in version_switches(timeline):
        ax.plot([time, time], [stage - 0.45, stage + 0.45], color="black", linewidth=2)
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1, backward = 2)")
    ax.set_title(f"{schedule.name}: d={schedule.stages}, m={schedule.num_microbatches} "
                 "(black: new weight version)")
    handles = [Line2D([], [], color=fill, linewidth=2, label=label) if label == SWITCH_NOTE
               else Patch(color=fill, label=label) for fill, label in legend_entries(shaded_by(schedule))]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig
