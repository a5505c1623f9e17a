"""What a run shows its user: progress while it trains, and its summary table at the end
(`relaytrain report` compares runs; that is `report/command.py`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from relaytrain.utils.units import duration, gib, si

console = Console(stderr=False)


class StepProgress:
    """A rich progress bar on an interactive terminal; plain periodic lines otherwise (CI, pipes).

    Long steps show progress inside them (`inside`: the L2L relay's block and phase, a
    pipeline's micro-batches): in the bar on a terminal, and as a plain line at most every
    `QUIET_S` seconds otherwise, so a run is never silent for long. Each time figure says what
    it is: the last step's time, and an ETA from the mean of the steps so far (or, before the
    first one, from the estimate made before the run).
    """

    QUIET_S = 15.0  # plain mode: the longest stretch without a line while a step runs

    def __init__(self, total: int, log_every: int, title: str, enabled: bool = True, first: int = 0,
                 estimate_s: float | None = None):
        self.total, self.log_every, self.title = total, max(log_every, 1), title
        self.enabled = enabled  # one process shows progress: the one that knows the loss
        self.interactive = console.is_terminal and not os.environ.get("CI")
        self.first, self.step = first, first
        self.estimate_s = estimate_s
        self.times: list[float] = []
        self.step_started = self.last_line = time.monotonic()
        self._bar = None

    def __enter__(self) -> StepProgress:
        if not self.enabled:
            return self
        if self.interactive:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[inside]}"),
                TextColumn("ETA {task.fields[eta]}"), console=console, transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=self.total, completed=self.first, loss="-",
                                            inside="", eta=self.eta())
        else:
            console.print(f"{self.title}: {self.total} steps", highlight=False)
        return self

    def eta(self) -> str:
        per_step = sum(self.times) / len(self.times) if self.times else self.estimate_s
        if per_step is None:
            return "?"
        return duration(per_step * (self.total - self.step))

    def update(self, step: int, loss: float | None, step_time: float, skipped: bool = False, aside: str = "") -> None:
        """`aside`: what the line shows besides the loss (an online objective's reward and the
        time its rollouts took, which `step_time` includes)."""
        self.step, self.step_started = step, time.monotonic()
        self.times.append(step_time)
        if not self.enabled:
            return
        note = " (skipped: fp16 overflow)" if skipped else ""
        shown = ("n/a" if loss is None else f"{loss:.4f}") + (f"  {aside}" if aside else "")  # a dry run has no values
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{shown}{note}", inside="", eta=self.eta())
        elif step % self.log_every == 0 or step == self.total or step == self.first + 1:
            self._line(f"step {step}/{self.total}  loss {shown}  {step_time:.3f} s last step{note}  "
                       f"ETA {self.eta()}")

    def inside(self, text: str) -> None:
        """Where the step in flight is (e.g. 'backward: block 7/24')."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, inside=text)
        elif time.monotonic() - self.last_line >= self.QUIET_S:
            into = duration(time.monotonic() - self.step_started)
            self._line(f"step {self.step + 1}/{self.total}: {text}, {into} into the step  ETA {self.eta()}")

    def evaluated(self, step: int, figures: dict) -> None:
        """One line per evaluation, on a terminal above the bar."""
        if self.enabled:
            self._line(f"eval after step {step}: {format_eval(figures)}")

    def _line(self, text: str) -> None:
        console.print(text, highlight=False)
        self.last_line = time.monotonic()

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def format_eval(figures: dict) -> str:
    shown = [f"{name} {value:.4f}" for name, value in figures.items() if name not in ("step", "items") and value is not None]
    return "  ".join(shown) + f"  ({figures.get('items', 0)} items)"


def compile_rows(compiled: dict | None) -> list[tuple[str, str]]:
    """train.compile's row: the first step's compile time (in its step time) and the whole run's."""
    if not compiled:
        return []
    first = "n/a" if compiled["first_step_s"] is None else f"{compiled['first_step_s']:.1f} s"
    return [("compile (torch.compile)", f"{first} in the first step, {compiled['total_s']:.1f} s in all; "
                                        f"{compiled['graphs']} graph(s), {compiled['compiles']} compile(s)")]


def data_rows(data: dict | None) -> list[tuple[str, str]]:
    """What preparing the data took: records, tokens, what was cut or dropped, and whether the
    tokenize cache had it (with a mixture, each part's drawn records)."""
    if not data or "cache" not in data:
        return []
    if data.get("streaming"):
        return [("data", f"{data['source']}: streamed, read and tokenized as it trains; cache off")]
    line = (f"{data['source']}: {data['records']} records, {si(data['tokens']).replace('.00', '')} tokens, "
            f"{data['truncated']} truncated, {data['dropped']} dropped; cache {data['cache']}, "
            f"prepared in {duration(data['prepare_s'])}")
    parts = [f"{Path(part['path']).name} {part['drawn']} of {part['records']}" for part in data.get("mix", [])]
    return [("data", line), *([("  mixture (drawn of held)", ", ".join(parts))] if parts else [])]


def adapter_rows(adapter: dict | None) -> list[tuple[str, str]]:
    """What trained under adapters: their kind and rank, the base's 4 bits, the parameters that
    train, and on a mixture the experts the adapters leave frozen, with the key that adapts them."""
    if not adapter:
        return []
    base = f" over a 4-bit base ({adapter['quantize']})" if adapter.get("quantize") else ""
    rows = [("adapters", f"{adapter['name']} r={adapter['r']}{base}: {si(adapter['trained_parameters'])} "
                         f"parameters train")]
    experts = adapter.get("experts")
    if experts and experts["frozen"]:
        rows.append(("  experts", escape(f"not adapted: {', '.join(experts['frozen'])} stay frozen; "
                                         f"{experts['adapted_by']} adapts them")))  # its [...] is no markup
    elif experts:
        rows.append(("  experts", f"adapted: {', '.join(experts['names'])}"))
    return rows


SAVED_FORMS = {"model": "a Hugging Face model directory", "adapter": "a peft adapter over {base}",
               "merged": "the adapter merged into its base (peft's merge_and_unload)"}


def saved_model_rows(saved: dict | None) -> list[tuple[str, str]]:
    """Where train.save_model wrote the model, and in what form and dtype."""
    if not saved:
        return []
    return [("saved model", escape(f"{saved['path']}: {SAVED_FORMS[saved['form']].format(base=saved['base'])}, "
                                   f"{saved['dtype']}"))]


def saved_model_line(saved: dict | None) -> str:
    """The line after the summary: where the model went, and the command that tries it."""
    if not saved:
        return ""
    line = f"model saved to {saved['path']}"
    if saved["generates"]:
        line += f"; try: relaytrain generate model.pretrained={saved['path']} prompt=Hello"
    if saved["form"] == "adapter":
        line += f"; merge it into its base: relaytrain export model.pretrained={saved['path']} out=DIR"
    return line


def rollout_rows(terms: dict) -> list[tuple[str, str]]:
    """An online objective's sampling and scoring time (its `rollout_s`), which the step time
    above leaves out: the mean over the rollout batches the run made."""
    times = [s for s in terms.get("rollout_s", []) if s is not None]
    if not times:
        return []
    return [("rollouts (mean per batch)", f"{sum(times) / len(times):.3f} s sampling and scoring {len(times)} "
                                          f"batches, beside the step time")]


def print_results_table(results: dict, path: Path) -> None:
    t = results["throughput"]
    table = Table(title=f"relaytrain · {results['strategy']} · {results['model']['name']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a key or path longer than the column is wrapped whole, never cut short
    losses = [loss for loss in results["loss"] if loss is not None]
    rows = [
        ("parameters", si(results["model"]["parameters"])),
        *adapter_rows(results.get("adapter")),
        ("device", results["device"]),
        ("precision", results["precision"]),
        *data_rows(results.get("data")),
        ("steps", f"{results['steps']} (throughput over the last {results['measured_steps']})"),
        ("loss first → last", f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "n/a"),
        *([("evaluation (held out)", f"after step {results['eval'][-1]['step']}: {format_eval(results['eval'][-1])}")]
          if results.get("eval") else []),
        *([("started from", results["model"]["pretrained"])] if results["model"].get("pretrained") else []),
        *saved_model_rows(results.get("saved_model")),
        ("samples/s", si(t["samples_per_s"]) if t["samples_per_s"] is not None else "n/a (a dry run times nothing)"),
        ("tokens/s", si(t["tokens_per_s"])),
        ("step time (mean)", "n/a" if t["step_time_s"] is None else f"{t['step_time_s']:.3f} s"),
        *rollout_rows(results.get("loss_terms") or {}),
        ("model FLOP/s (estimate)", si(t["model_flops_per_s"], "FLOP/s")),
        *compile_rows(results.get("compile")),
        *memory_rows(results["memory"]),
    ]
    dry = bool(results["memory"]["device"].get("simulated"))
    for key, value in results.get("strategy_report", {}).get("summary", {}).items():
        if not (dry and _is_timing(f"{key} {value}")):  # a dry run's clock measures nothing a real run would take
            rows.append((key, str(value)))
    rows.append(("results", str(path)))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if saved := saved_model_line(results.get("saved_model")):
        console.print(saved, highlight=False, markup=False, soft_wrap=True)  # one line to copy, however narrow


def _is_timing(key: str) -> bool:
    return any(unit in key for unit in ("s/step", "samples/s", "params/s"))


def memory_rows(memory: dict) -> list[tuple[str, str]]:
    """Device memory (the CUDA allocator's peak, or a dry run's simulated one with its kinds)
    and host memory (peak RSS, or a dry run's estimate), each saying which it is."""
    device = memory["device"]
    if device["peak_allocated_bytes"] is None:
        rows = [("peak device memory", device["note"])]
    elif device.get("simulated"):
        kinds = ", ".join(f"{kind} {gib(size)}" for kind, size in device["by_kind"].items() if size)
        rows = [("peak device memory (simulated)", gib(device["peak_allocated_bytes"])), ("  by kind at the peak", kinds)]
        rows += [(f"  {p['process']}", gib(p["device"]["peak_allocated_bytes"])) for p in memory.get("per_process", [])]
    else:
        rows = [("peak device memory", gib(device["peak_allocated_bytes"]))]
    if memory.get("host_estimate_bytes") is not None:
        return [*rows, ("host memory (estimate)", gib(memory["host_estimate_bytes"]))]
    return [*rows, ("peak host RSS", gib(memory["host_peak_rss_bytes"]))]


def print_one_line(results: dict, path: Path) -> None:
    """A sweep job's summary (the sweep ends with one table of every job: `relaytrain report`)."""
    t, losses = results["throughput"], [loss for loss in results["loss"] if loss is not None]
    loss = f"loss {losses[0]:.4f} → {losses[-1]:.4f}" if losses else "no loss"
    rate = "n/a" if t["samples_per_s"] is None else si(t["samples_per_s"])
    saved = results.get("saved_model")
    model = f"; model saved to {saved['path']}" if saved else ""
    console.print(f"{results['strategy']} · {results['model']['name']}: {loss}, {rate} samples/s; {path}{model}",
                  highlight=False)
