"""`relaytrain schedule`: a schedule's timeline as in the paper's Figures 1-3.

    relaytrain schedule strategy=pipe_2bw strategy.stages=4 strategy.num_microbatches=8
    relaytrain schedule strategy=pipe_flush --batches 2 --out flush.svg
    relaytrain schedule strategy=pipe_gpipe strategy.stages=2

Rows are stages, columns time units from the schedule's dry run with a backward costing
twice a forward (the papers' convention). Each cell shows the micro-batch id, 1-based as in
the figures; forwards and backwards have their own colours, and the colours switch with the
weight version the work uses, so 2BW's version changes show as colour changes. `--out`
writes the same picture as SVG (no extra dependency) or PNG (needs matplotlib).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text

from relaytrain.errors import ConfigError
from relaytrain.strategies import registry, strategy_class
from relaytrain.strategies.pipeline.schedule import KINDS, Op, Schedule, build_schedule
from relaytrain.strategies.pipeline.validate import Timeline, bubble_formula, check_schedule

CELL = 2  # characters per time unit
# (forward, backward) colours for even and odd weight versions
STYLES = {0: ("bold white on blue", "bold black on green"), 1: ("bold white on magenta", "bold black on yellow")}
SVG_FILL = {0: ("#3b6fd8", "#4caf50"), 1: ("#b04cc8", "#e6c229")}
USAGE = "relaytrain schedule [KEY=VALUE ...] [--schedule pipe_flush|pipe_2bw|gpipe] [--batches N] [--out FILE.svg|.png]"


def schedule_command(args: list[str], compose) -> int:
    """`compose(overrides)` gives the config `relaytrain train` would compose (a ConfigError if it cannot)."""
    options, overrides = _parse_args(args)
    s = compose(overrides).strategy
    kind = options.get("--schedule") or getattr(strategy_class(s.name), "schedule", None)
    if kind not in KINDS:
        pipelines = [n for n, c in registry().items() if getattr(c, "schedule", None)]
        raise ConfigError(f"strategy={s.name} has no pipeline schedule; use strategy={' or '.join(pipelines)} "
                          f"(or --schedule {'|'.join(KINDS)})")
    # 2BW's first new version is used from batch 3 on: show enough batches to see it.
    batches = _positive_int(options.get("--batches", "3" if kind == "pipe_2bw" else "2"), "--batches")
    schedule = build_schedule(kind, s.stages, s.num_microbatches, batches)
    timeline = check_schedule(schedule)
    console = Console()
    console.print(render_grid(schedule, timeline), soft_wrap=True)
    for line in describe(schedule, timeline):
        console.print(line, highlight=False)
    if "--out" in options:
        path = write_image(schedule, timeline, Path(options["--out"]))
        console.print(f"wrote {path}", highlight=False)
    return 0


def _parse_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    options, overrides = {}, []
    items = iter(args)
    for arg in items:
        if arg in ("--out", "--batches", "--schedule"):
            value = next(items, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value; usage: {USAGE}")
            options[arg] = value
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}; usage: {USAGE}")
        else:
            overrides.append(arg)
    return options, overrides


def _positive_int(value: str, name: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value} must be a positive integer")
    return int(value)


# ----------------------------------------------------------------------- terminal


def render_grid(schedule: Schedule, timeline: Timeline) -> Text:
    width = int(timeline.makespan)
    text = Text(f"{schedule.kind}: {schedule.stages} stages, {schedule.num_microbatches} micro-batches "
                f"per update, {schedule.num_batches} updates (forward = 1 unit, backward = 2)\n")
    text.append(" " * 9 + "".join(f"{t:<{CELL * 5}}" for t in range(0, width, 5)) + "\n", style="dim")
    for stage, events in enumerate(timeline.events):
        text.append(f"stage {stage:<2} ", style="bold")
        cursor = 0.0
        for event in events:
            if event.action.op not in (Op.FORWARD, Op.BACKWARD):
                continue
            text.append("·" * int((event.start - cursor) * CELL), style="dim")
            cells = int((event.end - event.start) * CELL)
            forward_style, backward_style = STYLES[event.action.version % 2]
            style = forward_style if event.action.op is Op.FORWARD else backward_style
            text.append(f"{event.action.microbatch + 1:^{cells}}", style=style)
            cursor = event.end
        text.append("\n")
    text.append("legend: ", style="dim")
    for version, (forward_style, backward_style) in STYLES.items():
        text.append(" forward ", style=forward_style).append(" backward ", style=backward_style)
        text.append(f" weight version {'even' if version == 0 else 'odd'}   ", style="dim")
    return text


def describe(schedule: Schedule, timeline: Timeline) -> list[str]:
    """The figures the grid shows, in words: bubble, and when each stage's versions change."""
    lines = [f"bubble (idle share of stage time): {timeline.bubble_fraction():.3f} in this dry run"]
    if schedule.kind != "pipe_2bw":
        formula = bubble_formula(schedule.stages, schedule.num_microbatches)
        lines[0] += f"; (d-1)/(m+d-1) = {formula:.3f} per flush"
    for stage, events in enumerate(timeline.events):
        changes = [_version_change(e, events) for e in events if e.action.op is Op.OPTIMIZER_STEP]
        lines.append(f"stage {stage}: " + "; ".join(changes))
    return lines


def _version_change(step, events) -> str:
    version = step.action.version
    first_use = next((e for e in events if e.action.op is Op.FORWARD and e.action.version == version), None)
    used = f", first used by micro-batch {first_use.action.microbatch + 1} at t={first_use.start:g}" if first_use else ""
    return f"v{version} made at t={step.start:g}{used}"


# ----------------------------------------------------------------------- images


def write_image(schedule: Schedule, timeline: Timeline, path: Path) -> Path:
    if path.suffix.lower() == ".svg":
        path.write_text(render_svg(schedule, timeline))
    elif path.suffix.lower() == ".png":
        _write_png(schedule, timeline, path)
    else:
        raise ConfigError(f"--out {path}: write .svg (no extra dependency) or .png (needs matplotlib)")
    return path


def _boxes(timeline: Timeline):
    """(stage, start, duration, label, fill) per forward/backward, and (stage, time) per version switch."""
    boxes, switches = [], []
    for stage, events in enumerate(timeline.events):
        for e in events:
            if e.action.op is Op.OPTIMIZER_STEP:
                switches.append((stage, e.start))
                continue
            fill = SVG_FILL[e.action.version % 2][0 if e.action.op is Op.FORWARD else 1]
            boxes.append((stage, e.start, e.end - e.start, str(e.action.microbatch + 1), fill))
    return boxes, switches


def render_svg(schedule: Schedule, timeline: Timeline, unit: int = 18, row: int = 28) -> str:
    boxes, switches = _boxes(timeline)
    left, top = 70, 30
    width, height = left + int(timeline.makespan * unit) + 10, top + schedule.stages * row + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="11">',
        f'<text x="4" y="16">{schedule.kind}: d={schedule.stages}, m={schedule.num_microbatches}, '
        f'{schedule.num_batches} updates (black bars: new weight version)</text>',
    ]
    for stage in range(schedule.stages):
        parts.append(f'<text x="4" y="{top + stage * row + row * 0.6:.0f}">stage {stage}</text>')
    for stage, start, duration, label, fill in boxes:
        x, y = left + start * unit, top + stage * row
        parts.append(f'<rect x="{x:.0f}" y="{y}" width="{duration * unit:.0f}" height="{row - 4}" '
                     f'fill="{fill}" stroke="white"/>')
        parts.append(f'<text x="{x + duration * unit / 2:.0f}" y="{y + row * 0.6:.0f}" '
                     f'text-anchor="middle" fill="white">{label}</text>')
    for stage, time in switches:
        x, y = left + time * unit, top + stage * row
        parts.append(f'<rect x="{x - 1:.0f}" y="{y - 2}" width="3" height="{row}" fill="black"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _write_png(schedule: Schedule, timeline: Timeline, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as err:
        raise ConfigError(
            f"--out {path.name} needs matplotlib: pip install matplotlib (or relaytrain[plot]); "
            f"--out {path.with_suffix('.svg').name} needs nothing extra"
        ) from err
    boxes, switches = _boxes(timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, timeline.makespan * 0.25), 0.6 * schedule.stages + 1))
    for stage, start, duration, label, fill in boxes:
        ax.barh(stage, duration, left=start, color=fill, edgecolor="white")
        ax.text(start + duration / 2, stage, label, ha="center", va="center", color="white", fontsize=8)
    for stage, time in switches:
        ax.plot([time, time], [stage - 0.45, stage + 0.45], color="black", linewidth=2)
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1, backward = 2)")
    ax.set_title(f"{schedule.kind}: d={schedule.stages}, m={schedule.num_microbatches} (black: new weight version)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
