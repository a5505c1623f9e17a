"""`relaytrain report` over a folder of mixed runs (strategies, models, data, optimizers: many keys
that differ): a table that stays readable in an ordinary width, and plots that keep their legends."""

import csv
import io

import pytest
from rich.console import Console

from relaytrain.commands.report import command as report
from relaytrain.commands.report import table
from relaytrain.commands.report.command import compare_runs
from tests.report.test_report import results, write_run

MIXED = [  # six runs' overrides, each differing in its own keys, as a user's folder of tries holds them
    ["train.steps=3"],
    ["train.steps=3", "strategy=l2l", "model=gpt2_tiny", "optim=lamb"],
    ["train.steps=3", "model=llama_tiny", "data=chat", "data.path=/home/someone/data/chat/train-00001.jsonl",
     "optim.lr=1e-3", "strategy.microbatch_size=2"],
    ["train.steps=3", "strategy=pipe_flush", "strategy.stages=2", "data.seq_len=32", "precision=amp_bf16"],
    ["train.steps=3", "strategy=fsdp", "strategy.replicas=2", "optim=sgd", "optim.momentum=0.9"],
    ["train.steps=3", "model=llama_tiny", "adapter=lora", "optim.weight_decay=0.0", "optim.schedule=cosine",
     "train.seed=3", "model.dropout=0.0", "adapter.dropout=0.1", "eval.every=1", "data.eval_fraction=0.1"],
]


def strategy_of(overrides):
    return next((o.split("=")[1] for o in overrides if o.startswith("strategy=")), "baseline")


@pytest.fixture
def mixed(tmp_path):
    """A folder of six finished runs (`hydra.run.dir=DIR/runN`), or, with `sweep`, the same six as
    the numbered jobs of a sweep, whose plots name each job by its overrides."""
    def make(sweep=False):
        root = tmp_path / ("sweep" if sweep else "runs")
        for number, overrides in enumerate(MIXED):
            name = f"{number}_steps=3" if sweep else f"run{number + 1}"  # Hydra's N_KEY=VALUE,... (no paths)
            strategy = strategy_of(overrides)
            write_run(root / name, overrides=overrides, strategy=strategy, losses=(9.0, 8.7, 8.5 - number / 10),
                      result=results(strategy, overrides=overrides, losses=(9.0, 8.7, 8.5 - number / 10),
                                     samples_per_s=10.0 * (number + 1)))
        return root
    return make


def table_lines(text: str) -> list[str]:
    return text[:text.index("wrote summary.csv")].splitlines()


def test_a_log_gets_a_table_at_most_wide_columns_and_the_csv_every_key(mixed, capsys):
    root = mixed()
    compare_runs([root], out=root)
    lines = table_lines(capsys.readouterr().out)
    assert max(map(len, lines)) <= table.WIDE  # was 700 characters a line and more
    text = "\n".join(lines)
    assert "overrides" in text  # the keys that differ, in one wrapped column, each named whole
    for override in ("optim=lamb", "strategy.stages=2", "model.dropout=0.0", "adapter.dropout=0.1"):
        assert override in text
    with open(root / "summary.csv", newline="") as f:
        header = next(csv.reader(f))
    assert {"optim", "data.path", "optim.lr", "strategy.stages", "model.dropout", "adapter.dropout",
            "data.eval_fraction"} <= set(header)  # summary.csv has every key, in its own column


def test_a_narrow_terminal_gets_the_mixed_table_fitted(mixed, monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    monkeypatch.setattr(report, "console", terminal)
    compare_runs([mixed()])
    lines = table_lines(terminal.file.getvalue())
    assert max(map(len, lines)) <= 100
    text = "\n".join(lines)  # the header (its lines depend on how long the runs' paths are) before the rows
    assert "adapter.dropout=0.1" in text and text.index("overrides") < text.index("adapter.dropout=0.1")


def test_legends_and_point_labels_lie_inside_the_saved_figures(mixed, monkeypatch):
    """A sweep's jobs are named by their overrides in the plots: long entries, which used to run off
    the figure. Every legend and label of each saved figure lies inside it."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    outside: dict[str, list[str]] = {}
    save = Figure.savefig

    def checked_savefig(figure, path, **kwargs):
        save(figure, path, **kwargs)
        renderer = figure.canvas.get_renderer()  # the saved layout, at the figure's own dpi
        box = figure.bbox
        artists = [*figure.legends, *(a.get_legend() for a in figure.axes if a.get_legend()),
                   *(text for a in figure.axes for text in a.texts)]
        outside[path.name] = [str(a) for a in artists if not _within(a.get_window_extent(renderer), box)]

    monkeypatch.setattr(Figure, "savefig", checked_savefig)
    compare_runs([mixed(sweep=True)])
    assert set(outside) == {"throughput_vs_memory.png", "loss_curves.png"}
    assert outside == {name: [] for name in outside}


def _within(inner, outer) -> bool:
    return (inner.x0 >= outer.x0 - 1 and inner.y0 >= outer.y0 - 1
            and inner.x1 <= outer.x1 + 1 and inner.y1 <= outer.y1 + 1)
