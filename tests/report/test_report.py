"""`relaytrain report` on run and sweep directories written by hand, as a run and a sweep leave them."""

import csv
import io
import json
import sys

import pytest
import yaml
from rich.console import Console

from relaytrain.commands.cli import main
from relaytrain.commands.report import command as report
from relaytrain.commands.report import table
from relaytrain.commands.report.command import compare_runs as summarize
from relaytrain.commands.report.runs import COLUMNS, swept_keys
from relaytrain.records import runlog

GIB = 2**30
SWEPT = ["strategy.num_microbatches", "strategy.stages"]


def results(strategy="baseline", *, num_microbatches=2, microbatch_size=4, replicas=1, processes=1,
            samples_per_s=100.0, device="cpu", device_peak=None, simulated=False, host_rss=400 * 2**20,
            losses=(0.70, 0.66, 0.61, 0.58), evaluation=None, overrides=(), model="bert_tiny", seq_len=32):
    """A results.json as `relaytrain train` writes it (the keys the report reads, and some it does not)."""
    samples = num_microbatches * microbatch_size * replicas
    note = "CPU run: no separate device memory (see host peak RSS)" if device_peak is None else ""
    device_memory = {"peak_allocated_bytes": device_peak, "peak_reserved_bytes": device_peak, "note": note}
    if simulated:
        device_memory["simulated"] = True
    return {
        "strategy": strategy,
        "model": {"name": model, "family": "bert", "task": "classification", "parameters": 137026,
                  "num_layers": 2, "hidden_size": 64, "pretrained": None},
        "device": device, "precision": "fp32", "processes": processes, "replicas": replicas,
        "steps": len(losses), "measured_steps": len(losses) - 1, "microbatch_size": microbatch_size,
        "num_microbatches": num_microbatches, "samples_per_step": samples,
        "tokens_per_step": samples * seq_len,
        "loss": list(losses), "eval": evaluation or [], "skipped_steps": 0,
        "step_times_s": [samples / samples_per_s] * len(losses),
        "throughput": {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * seq_len,
                       "step_time_s": samples / samples_per_s, "model_flops_per_s": samples_per_s * 2.5e7},
        "memory": {"device": device_memory, "host_peak_rss_bytes": host_rss,
                   "host_peak_rss_total_bytes": host_rss * processes},
        "strategy_report": {}, "threads": 2, "overrides": list(overrides),
        "versions": {"torch": "2.13.0+cpu", "python": "3.11.7"}, "finished_at": "2025-01-31T10:00:05+0000",
    }


def write_run(run_dir, *, result=None, status="finished", error=None, step=None, losses=(), overrides=(),
              strategy="baseline", num_microbatches=2):
    """A run directory: .hydra/ (config and overrides), status.json, metrics.csv and, when it finished,
    results.json."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    config = {"model": {"name": "bert_tiny", "num_layers": 2}, "precision": {"name": "fp32"},
              "strategy": {"name": strategy, "microbatch_size": 4, "num_microbatches": num_microbatches}}
    (hydra / "config.yaml").write_text(yaml.safe_dump(config))
    record = {"status": status, "step": step if step is not None else len(losses),
              "started_at": "2025-01-31T10:00:00+0000", "updated_at": "2025-01-31T10:00:05+0000"}
    if error:
        record["error"] = error
    (run_dir / runlog.STATUS).write_text(json.dumps(record))
    with open(run_dir / runlog.METRICS, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=runlog.COLUMNS)
        writer.writeheader()
        for i, loss in enumerate(losses, start=1):
            writer.writerow({"step": i, "loss": loss, "lr": 3e-4, "step_time_s": 0.05, "samples_per_s": 160.0,
                             "host_rss_bytes": 400 * 2**20})
    if result is not None:
        (run_dir / "results.json").write_text(json.dumps(result, indent=2))
    return run_dir


def job_overrides(strategy, num_microbatches, *extra):
    return ["+exp=tiny_baseline", f"strategy={strategy}", f"strategy.num_microbatches={num_microbatches}",
            *extra]


@pytest.fixture
def sweep(tmp_path):
    """multirun/DATE/TIME as a sweep over strategies and strategy.num_microbatches leaves it when
    one job failed and the last one was interrupted (Ctrl-C)."""
    root = tmp_path / "multirun" / "2025-01-31" / "10-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    finished = [("baseline", 1, 400.0, 0.58), ("baseline", 4, 500.0, 0.55), ("l2l", 1, 150.0, 0.58)]
    for number, (strategy, mb, speed, last_loss) in enumerate(finished):
        overrides = job_overrides(strategy, mb)
        losses = (0.70, 0.66, 0.61, last_loss)
        write_run(root / f"{number}_{','.join(sorted(overrides))}", overrides=overrides, losses=losses,
                  strategy=strategy, num_microbatches=mb,
                  result=results(strategy, num_microbatches=mb, samples_per_s=speed, losses=losses,
                                 overrides=overrides, evaluation=[{"step": 4, "loss": 0.41, "items": 26,
                                                                   "accuracy": 0.91}]))
    failed = job_overrides("l2l", 4)
    write_run(root / f"3_{','.join(sorted(failed))}", status="failed", overrides=failed, strategy="l2l",
              num_microbatches=4, losses=(0.70, 0.67),
              error="RuntimeError: pinned host memory exhausted at step 3")
    interrupted = job_overrides("pipe_flush", 4, "strategy.stages=2")
    write_run(root / f"4_{','.join(sorted(interrupted))}", status="interrupted", overrides=interrupted,
              strategy="pipe_flush", num_microbatches=4, losses=(0.70, 0.65, 0.63),
              error="SIGINT at step 3: checkpoint saved to checkpoints/step-00000003; "
                    "continue with train.resume=checkpoints/step-00000003")
    return root


def by_run(rows):
    return {row["run"].split("_")[0]: row for row in rows}


def test_a_sweep_gives_one_row_per_job_failed_and_interrupted_ones_included(sweep, capsys):
    rows = summarize([sweep])
    assert len(rows) == 5
    jobs = by_run(rows)
    assert [jobs[n]["status"] for n in "01234"] == ["finished"] * 3 + ["failed", "interrupted"]
    assert jobs["0"]["strategy"] == "baseline" and jobs["0"]["samples_per_s"] == 400.0
    assert jobs["0"]["peak_host_rss"] == 400 * 2**20 and jobs["0"]["peak_device_memory"] is None
    assert jobs["0"]["eval_accuracy"] == 0.91 and jobs["0"]["eval_step"] == 4
    failed = jobs["3"]
    assert failed["error"] == "RuntimeError: pinned host memory exhausted at step 3"
    assert failed["final_loss"] == 0.67  # metrics.csv's last row
    assert failed["strategy"] == "l2l" and failed["num_microbatches"] == 4  # from .hydra/config.yaml
    assert failed["samples_per_s"] is None and failed["steps"] == 2
    assert jobs["4"]["error"].startswith("SIGINT at step 3") and jobs["4"]["final_loss"] == 0.63
    assert jobs["4"]["strategy.stages"] == "2" and jobs["0"]["strategy.stages"] is None

    out = capsys.readouterr().out
    assert out.count("relaytrain report · 5 runs") == 1  # one table for the whole sweep
    for text in ("failed", "interrupted", "RuntimeError: pinned host", "acc 0.91 @ step 4", "n/a (CPU)",
                 "samples/s", "FLOP/s"):
        assert text in out
    lines = out[:out.index("wrote summary.csv")].splitlines()
    assert max(map(len, lines)) <= table.WIDE  # not a terminal: fitted to WIDE columns
    assert "wrote summary.csv, throughput_vs_memory.png, loss_curves.png" in out


def test_summary_csv_has_every_row_in_plain_numbers_and_the_swept_keys(sweep):
    summarize([sweep])
    with open(sweep / "summary.csv", newline="") as f:
        table = list(csv.reader(f))
    header, rows = table[0], [dict(zip(table[0], row, strict=True)) for row in table[1:]]
    assert header == COLUMNS + SWEPT
    assert [row["status"] for row in rows] == ["finished"] * 3 + ["failed", "interrupted"]
    first = rows[0]
    assert int(first["peak_host_rss"]) == 400 * 2**20 and float(first["samples_per_s"]) == 400.0
    assert float(first["tokens_per_s"]) == 400.0 * 32 and first["peak_device_memory"] == ""
    assert first["device_memory_simulated"] == "false" and first["strategy.num_microbatches"] == "1"
    assert rows[3]["samples_per_s"] == "" and float(rows[3]["final_loss"]) == 0.67
    assert rows[4]["strategy.stages"] == "2"


def test_plots_are_written_as_pngs(sweep):
    summarize([sweep])
    for name in ("throughput_vs_memory.png", "loss_curves.png",
                 "throughput_vs_strategy.num_microbatches.png"):
        data = (sweep / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name
    # strategy.stages varies (only the interrupted job sets it) but no finished run has two values of it
    assert not (sweep / "throughput_vs_strategy.stages.png").exists()
    # strategy varies too, but is not a number: it groups the lines instead of getting a plot
    assert not (sweep / "throughput_vs_strategy.png").exists()


def test_swept_keys_are_the_overrides_whose_values_differ():
    runs = [{"exp": "tiny", "strategy": "baseline", "optim.lr": "1e-4"},
            {"exp": "tiny", "strategy": "l2l", "optim.lr": "1e-4", "strategy.stages": "2"},
            {"exp": "tiny", "strategy": "l2l", "optim.lr": "1e-4"}]
    assert swept_keys(runs) == ["strategy", "strategy.stages"]  # a key some runs lack differs too
    assert swept_keys(runs[:1]) == []


def test_override_prefixes_do_not_split_a_key(tmp_path, capsys):
    a = write_run(tmp_path / "a", result=results(overrides=["+exp=tiny", "optim.lr=1e-4"]))
    b = write_run(tmp_path / "b", result=results(overrides=["++exp=tiny", "optim.lr=3e-4"]))
    rows = summarize([a, b], out=tmp_path / "out")
    assert [row["optim.lr"] for row in rows] == ["1e-4", "3e-4"] and "exp" not in rows[0]


def test_sort_orders_by_a_column_and_puts_missing_values_last(sweep):
    assert [r["samples_per_s"] for r in summarize([sweep], sort="-samples_per_s")] == [500.0, 400.0, 150.0,
                                                                                         None, None]
    assert [r["run"][0] for r in summarize([sweep], sort="samples_per_s")] == ["2", "0", "1", "3", "4"]
    assert [r["run"][0] for r in summarize([sweep], sort="final_loss")] == ["1", "0", "2", "4", "3"]


def test_sort_by_run_is_natural_job_order(tmp_path):
    root = tmp_path / "sweep"
    for number in (10, 9, 2):
        write_run(root / f"{number}_train.seed={number}", overrides=[f"train.seed={number}"],
                  result=results(overrides=[f"train.seed={number}"]))
    assert [r["run"] for r in summarize([root])] == ["2_train.seed=2", "9_train.seed=9", "10_train.seed=10"]
    assert [r["run"] for r in summarize([root], sort="-run")][0] == "10_train.seed=10"


def test_filters_select_rows_by_csv_columns(sweep):
    assert {r["strategy"] for r in summarize([sweep], filters=["strategy=l2l"])} == {"l2l"}
    assert len(summarize([sweep], filters=["strategy=l2l", "status=finished"])) == 1
    unfinished = summarize([sweep], filters=["status!=finished"])
    assert {r["status"] for r in unfinished} == {"failed", "interrupted"}
    assert [r["samples_per_s"] for r in summarize([sweep], filters=["samples_per_s>300"])] == [400.0, 500.0]
    assert [r["samples_per_s"] for r in summarize([sweep], filters=["samples_per_s<300"])] == [150.0]
    assert len(summarize([sweep], filters=["strategy.num_microbatches=4"])) == 3  # a swept key's column
    assert len(summarize([sweep], filters=["num_microbatches=4.0"])) == 3  # numbers compare as numbers
    with open(sweep / "summary.csv") as f:
        assert len(f.read().splitlines()) == 1 + 3  # the CSV holds the rows selected


def test_json_prints_the_rows_and_still_writes_the_csv(sweep, capsys):
    assert main(["report", str(sweep), "--json", "--filter", "status=finished", "--sort=-samples_per_s"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)  # stdout is the JSON alone
    assert [r["samples_per_s"] for r in rows] == [500.0, 400.0, 150.0]
    assert set(COLUMNS + SWEPT) == set(rows[0])
    assert "wrote summary.csv" in captured.err and "relaytrain report ·" not in captured.out
    assert (sweep / "summary.csv").is_file()


def test_run_directories_from_anywhere_write_to_the_current_directory(tmp_path, monkeypatch, capsys):
    gpu = write_run(tmp_path / "outputs" / "2025-01-31" / "10-00-00_l2l_bert_large",
                    result=results("l2l", device="cuda:0", device_peak=3 * GIB, simulated=True, replicas=2,
                                   processes=2, num_microbatches=8, microbatch_size=4, evaluation=[
                                       {"step": 100, "loss": 2.51, "items": 4096, "perplexity": 12.3}]))
    cpu = write_run(tmp_path / "runs" / "baseline", result=results(
        evaluation=[{"step": 50, "loss": 0.41, "items": 26, "accuracy": 0.5, "matthews_correlation": 0.12}]))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    rows = summarize([gpu, cpu])
    assert [r["run"] for r in rows] == ["10-00-00_l2l_bert_large", "baseline"]
    assert rows[0]["device_memory_simulated"] is True and rows[0]["peak_device_memory"] == 3 * GIB
    assert (here / "summary.csv").is_file() and (here / "loss_curves.png").is_file()
    out = capsys.readouterr().out
    for text in ("8x4 x2 replicas", "3.00 (simulated)", "n/a (CPU)", "ppl 12.3 @ step 100",
                 "acc 0.50, mcc 0.12 @ step 50", "outputs/2025-01-31/10-00-00_l2l_bert_large",
                 "runs/baseline"):
        assert text in out, text


def test_reporting_a_sweep_twice_reads_only_its_runs(sweep):
    assert len(summarize([sweep])) == len(summarize([sweep])) == 5  # summary.csv and the PNGs are not runs


def test_help_lists_the_options(capsys):
    assert main(["report", "--help"]) == 0
    usage = capsys.readouterr().out
    for option in ("--sort", "--filter", "--json", "--out", "PATH..."):
        assert option in usage
    assert main(["--help"]) == 0
    assert "relaytrain report PATH..." in capsys.readouterr().out


@pytest.mark.parametrize("args, fix", [
    ([], "give at least one run or sweep directory"),
    (["{tmp}/nowhere"], "is not a directory"),
    (["{tmp}/empty"], "holds no run"),
    (["{sweep}", "--frobnicate"], "unknown option --frobnicate"),
    (["{sweep}", "--sort"], "--sort needs a value"),
    (["{sweep}", "--sort", "throughput"], "--sort: no column 'throughput'"),
    (["{sweep}", "--filter", "strategy~l2l"], "is not COLUMN=VALUE"),
    (["{sweep}", "--filter", "stratgy=l2l"], "did you mean strategy?"),
    (["{sweep}", "--filter", "samples_per_s>fast"], "> compares numbers"),
    (["{sweep}", "--out", "{sweep}/multirun.yaml"], "is a file; give a directory"),
])
def test_bad_input_is_refused_with_one_line(sweep, tmp_path, capsys, args, fix):
    (tmp_path / "empty").mkdir()
    code = main(["report", *(a.format(tmp=tmp_path, sweep=sweep) for a in args)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("relaytrain: error: ") and captured.err.count("\n") == 1
    assert fix in captured.err
    assert captured.out == ""
    assert not (sweep / "summary.csv").exists()


def test_without_matplotlib_the_table_and_csv_come_with_one_line(sweep, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    rows = summarize([sweep])
    out = capsys.readouterr().out
    assert len(rows) == 5 and "relaytrain report · 5 runs" in out
    assert out.count("plots need matplotlib: pip install 'relaytrain[plot]'") == 1
    assert (sweep / "summary.csv").is_file()
    assert not list(sweep.glob("*.png"))


def test_a_narrow_terminal_gets_the_table_fitted(sweep, monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    monkeypatch.setattr(report, "console", terminal)
    summarize([sweep])
    text = terminal.file.getvalue()
    table = text[:text.index("wrote summary.csv")]
    assert max(len(line) for line in table.splitlines()) <= 120
    assert "every run: model bert_tiny · precision fp32" in text  # what no run differs in
    assert "left out to fit the terminal (summary.csv has them): tokens/s" in text
    for kept in ("run", "status", "strategy", "samples/s", "error", "interrupted", "pinned host memory"):
        assert kept in text
