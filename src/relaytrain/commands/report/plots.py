"""The plots of `relaytrain report`, with matplotlib (an optional dependency: `relaytrain[plot]`):
PNGs of throughput against memory, loss curves and throughput against each numeric swept key,
each written only when it has something to show. Every label stays inside its figure: a legend
of many or long entries goes beside the axes, its entries wrapped, and the figure grows to hold it.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from relaytrain.commands.report.runs import GIB, Run, numeric_key, short_keys, swept_keys, to_number
from relaytrain.records import runlog

PLOT_STYLE = {
    "font.size": 11, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 9,
    "legend.title_fontsize": 10, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False,
}
MARKERS = "osD^vP*X"
LEGEND_INSIDE = 6  # entries a legend may have inside the axes, where it covers little
LABEL_WIDTH = 40  # characters of a legend entry's line; a longer entry wraps (beside the axes)
POINT_LABEL_WIDTH = 30  # a point's label longer than this is only the run's name (the legends say the rest)
FIGURE_SIZE = (9, 5.5)  # inches; taller where a legend beside the axes needs it
LEGEND_MARGIN = 0.3  # inches above and below a legend beside the axes
_SAFE_NAME = re.compile(r"[^\w.=-]")  # what a swept key may keep in a file name


def write_plots(runs: list[Run], out: Path) -> list[Path] | None:
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
              for key in varying if numeric_key(runs, key)]
    written = []
    with matplotlib.rc_context(PLOT_STYLE):
        for name, draw in plots:
            figure = Figure(figsize=FIGURE_SIZE, layout="constrained")
            FigureCanvasAgg(figure)
            if draw(figure.subplots()):
                _make_room_for_the_legends(figure)
                figure.savefig(out / name, dpi=130)
                written.append(out / name)
    return written


def _make_room_for_the_legends(figure) -> None:
    """Grow the figure where a legend beside the axes is taller than it: constrained layout makes
    room beside the axes for it, but cannot make the figure taller."""
    if not figure.legends:
        return
    renderer = figure.canvas.get_renderer()
    needed = max(legend.get_window_extent(renderer).height / figure.dpi for legend in figure.legends)
    if needed + LEGEND_MARGIN > figure.get_figheight():
        figure.set_figheight(needed + LEGEND_MARGIN)


def _plot_label(run: Run, varying: list[str], omit: tuple[str, ...] = ()) -> str:
    """A run as a plot names it: a Hydra job's number says little there, so its swept values follow it."""
    values = _swept_values(run, [k for k in varying if k not in omit])
    is_job_number = run.label.rpartition("/")[2].isdigit()
    return f"{run.label}: {', '.join(values)}" if values and is_job_number else run.label


def _swept_values(run: Run, keys: list[str]) -> list[str]:
    names = short_keys(keys)
    return [f"{names[k]}={run.overrides[k]}" for k in keys if k in run.overrides]


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
        label = _plot_label(run, varying, omit=("strategy",))
        ax.annotate(label if len(label) <= POINT_LABEL_WIDTH else run.label, (x, run.row["samples_per_s"]),
                    xytext=(-7 if x > middle else 7, 5), textcoords="offset points",
                    ha="right" if x > middle else "left", fontsize=8, color="0.3")
    ax.set(title=f"Throughput against {what}", xlabel=f"{what} (GiB)", ylabel="throughput (samples/s)")
    _legend(ax, "strategy")
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
    _legend(ax, "run")
    return True


def _throughput_vs_key(ax, runs: list[Run], key: str, varying: list[str]) -> bool:
    """samples/s against one numeric swept key; a line joins runs that differ only in that key."""
    others = [k for k in varying if k not in (key, "strategy")]
    series: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        x = to_number(run.overrides.get(key))
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
    _legend(ax, ", ".join(["strategy", *short_keys(others).values()]))
    return True


def _legend(ax, title: str) -> None:
    """Inside the axes while it is short and narrow; else beside them, in the figure's margin that
    constrained layout keeps for it, its entries wrapped at LABEL_WIDTH."""
    handles, labels = ax.get_legend_handles_labels()
    if len(labels) <= LEGEND_INSIDE and all(len(label) <= LABEL_WIDTH for label in [title, *labels]):
        ax.legend(title=title)
        return
    wrapped = [textwrap.fill(label, LABEL_WIDTH, break_on_hyphens=False) for label in labels]
    ax.figure.legend(handles, wrapped, title=textwrap.fill(title, LABEL_WIDTH), loc="outside right upper")
