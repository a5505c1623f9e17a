"""The planner's answer: step 6 of `relaytrain plan` (the steps are listed in full in
`relaytrain.planner.plan`), from a finished `Plan`.

6. **Answer**: a table, the best candidate that fits, the `relaytrain train` command that runs
   it, and plan.json. Every time figure is a prediction and says so. A placement that spreads a
   replica over several workers (cut sequences, split blocks) which was offered and which the
   best does not use gets one line saying why not (`placement_notes`). When nothing fits, one
   line says what came closest and where every candidate is (`infeasible_line`).
"""

from __future__ import annotations

from pathlib import Path

from relaytrain.cost.shape import DEGREES
from relaytrain.planner.candidates import Candidate, GiB, Request, variant
from relaytrain.planner.plan import CHECKPOINT, Plan
from relaytrain.utils.files import write_json

TABLE_ROWS = 24
WIDE = 160  # columns of the table when the output is not a terminal (a file, a pipe)


def write_plan(plan: Plan, out_dir: Path) -> Path:
    return write_json(Path(out_dir) / "plan.json", {**plan.to_json(), "placements": placement_notes(plan)}, indent=2)


def print_plan(plan: Plan, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    # No markup: a printed command's list values (adapter.target_modules=[q_proj,v_proj]) would read as tags
    console = Console(markup=False) if Console().is_terminal else Console(width=WIDE, markup=False)
    r, p = plan.request, plan.profile
    _print_header(plan, console)
    best = plan.best
    host = "unlimited" if r.host_memory_bytes is None else f"{r.host_memory_bytes / GiB:g} GiB"
    table = Table(title=f"relaytrain plan: {r.workers} worker(s) x {r.memory_bytes / GiB:g} GiB, host {host} a machine, "
                        f"batch {r.batch} x {r.seq_len} tokens (times predicted; memory simulated, host memory "
                        f"estimated)")
    for column in ("", "strategy", "shape", "step s", "samples/s", "memory GiB", "closed form GiB", "host GiB", "fits",
                   "why not"):
        table.add_column(column, overflow="fold")
    shown = _rows_to_show(plan)
    for c in shown:
        table.add_row("*" if c is best else "", c.shape.strategy, c.shape.describe(),
                      _fmt(c.cost.step_s if c.cost else None, ".3g"), _fmt(c.samples_per_s, ".3g"),
                      _fmt(None if c.memory_bytes is None else c.memory_bytes / GiB, ".2f"),
                      f"{c.closed_form_bytes / GiB:.2f}", f"{c.host_bytes / GiB:.1f}",
                      {True: "yes", False: "no", None: "?"}[c.fits],
                      c.why_not or "")
    console.print(table)
    if len(shown) < len(plan.candidates):
        console.print(f"{len(plan.candidates) - len(shown)} more candidates in {path}", highlight=False)
    notes = placement_notes(plan)
    for name, why in _refused_variants(plan, folded=set(notes)).items():
        console.print(f"not considered: {name} ({why})", highlight=False)
    for note in notes.values():
        console.print(note, highlight=False)
    if p.device_type == "cpu":
        console.print("CPU: no host<->device transfer; workers share the cores; a row's memory adds the state "
                      "its strategy keeps on the host (an eager param server's: the same memory)", highlight=False)
    console.print(f"best (predicted): {best.shape.strategy} {best.shape.describe()}: {best.cost.step_s:.3g} s a step, "
                  f"{best.samples_per_s:.3g} samples/s ({best.tokens_per_s:,.0f} tokens/s), "
                  f"{best.memory_bytes / GiB:.2f} GiB of device memory (simulated)", highlight=False)
    if best.reference is not None:
        console.print(reference_line(best), highlight=False)
    if plan.request.sampled:
        console.print(sampling_line(best, plan.request), highlight=False)
    console.print(f"run it: {plan.command(best)}", highlight=False, soft_wrap=True)
    if plan.checkpoint_needed:
        console.print(f"{CHECKPOINT}: your copy of the checkpoint of this shape, a Hugging Face directory (or a hub "
                      f"id); the plan read only its shape, as published", highlight=False)
    console.print(f"wrote {path}", highlight=False)


def _print_header(plan: Plan, console) -> None:
    """What was planned for, before the table: the request (its batch and sequence length decide
    the answer as much as the model does), the profile, the precision and what the planner changed."""
    r, p = plan.request, plan.profile
    console.print(request_line(r), highlight=False)
    console.print(f"profile: {p.device}; {p.source.split(': ')[0]} (details in plan.json)", highlight=False)
    console.print(precision_line(plan), highlight=False)
    if plan.ignored_overrides:
        console.print(f"ignored (the planner decides these): {' '.join(plan.ignored_overrides)}", highlight=False)
    if plan.batch_note:
        console.print(f"batch: {plan.batch_note}", highlight=False)
    if plan.positions_note:
        console.print(f"positions: {plan.positions_note}", highlight=False)


def request_line(r: Request) -> str:
    rows = f" ({r.rows_per_item} sequences each: {r.batch * r.rows_per_item})" if r.rows_per_item > 1 else ""
    return (f"planned for: a batch of {r.batch} samples{rows} of {r.seq_len} tokens ({r.tokens_per_step:,} tokens "
            f"a step; plan.batch_size, data.seq_len) on {r.workers} worker(s) of {r.memory_bytes / GiB:g} GiB")


def sampling_line(c: Candidate, r: Request) -> str:
    """What sampling the best candidate's completions holds, and what the figures leave out."""
    sequences = c.shape.microbatch_size * r.rows_per_item
    said = next((note for note in (c.cost.notes if c.cost else []) if note.startswith("sampling: ")), None)
    timed = ("the step above includes its share of " + said.removeprefix("sampling: ") if said
             else "sampling's time is not in the step above")
    return (f"sampling: a micro-batch's {sequences} sequences hold up to {c.kv_cache_bytes / GiB:.2f} GiB of keys and "
            f"values at {r.seq_len} tokens (closed form), where the policy samples, beside its weights; {timed} "
            f"(predicted; a run reports it as rollout_s)")


def reference_line(c: Candidate) -> str:
    """What the best candidate's reference pass costs, once before training (then cached)."""
    r = c.reference
    return (f"reference pass (once before training, then cached): about {1000 * r.seconds_per_item:.3g} s per 1,000 "
            f"samples (predicted), {r.device_bytes / GiB:.2f} GiB of device memory (closed form), "
            f"{r.host_bytes / GiB:.1f} GiB of host memory for the model as built (estimate)")


def precision_line(plan: Plan) -> str:
    """Which precision the plan prices, why where the planner chose it, and which strategies run
    it as what (cmp_* where a strategy has an eager param server, amp_* where not)."""
    by_precision: dict[str, list[str]] = {}
    for c in plan.candidates:
        names = by_precision.setdefault(c.precision, [])
        if c.shape.strategy not in names:
            names.append(c.shape.strategy)
    runs = "; ".join(f"{', '.join(names)} in {name}" for name, names in by_precision.items())
    said = plan.precision.note or f"precision={plan.precision.name}"
    return f"{said}: {runs} (compute at the profile's rate for that dtype, masters and optimizer in fp32)"


def _rows_to_show(plan: Plan) -> list[Candidate]:
    """Every candidate whose memory was decided by a dry run, and each variant's fastest of those
    the checks let through (a variant refused whole is one line below the table), fastest first.
    Past TABLE_ROWS the dry-run ones stay, the best among them: with cut sequences a plan has
    dozens of variants, whose fastest rows would otherwise push every dry run off the table."""
    fastest = {}
    for c in plan.candidates:
        if c.cost is not None:
            fastest.setdefault(variant(c.shape), c)
    simulated = [c for c in plan.candidates if c.simulated_bytes is not None]
    others = [c for c in plan.candidates if c.simulated_bytes is None and fastest.get(variant(c.shape)) is c]
    shown = {id(c) for c in [*simulated, *others][:TABLE_ROWS]}
    return [c for c in plan.candidates if id(c) in shown]


def _refused_variants(plan: Plan, folded: set[str] = frozenset()) -> dict[str, str]:
    """The variants none of whose candidates passed the checks, with the first reason; but those
    of a placement in `folded` none of whose candidates passed (its note says so, once)."""
    timed = {variant(c.shape) for c in plan.candidates if c.cost is not None}
    placed_and_timed = {key for c in plan.candidates if c.cost is not None for key in c.shape.placement}
    refused: dict[str, str] = {}
    for c in plan.candidates:
        said = (folded - placed_and_timed) & c.shape.placement.keys()
        if variant(c.shape) not in timed and not said:
            refused.setdefault(variant(c.shape), c.why_not)
    return refused


def placement_notes(plan: Plan) -> dict[str, str]:
    """By strategy key, one line for each placement (`cost.shape.DEGREES`) that the strategies
    take and the best does not use: its fastest candidate that fits and how much slower it is
    predicted, or why none of them fits or was tried, or why it was offered at no size."""
    notes, best = {}, plan.best
    for key in DEGREES:
        offered = [c for c in plan.candidates if key in c.shape.placement]  # fastest first
        if best is None or key in best.shape.placement:
            continue
        if offered:
            notes[key] = f"strategy.{key} not chosen: {_why_not_placed(offered, best)}"
        elif key in plan.unplaced:
            notes[key] = f"strategy.{key} not offered: {plan.unplaced[key]}"
    return notes


def _why_not_placed(offered: list[Candidate], best: Candidate) -> str:
    timed = [c for c in offered if c.cost is not None]
    if not timed:
        return f"every candidate with it was refused ({offered[0].why_not})"
    fitting = [c for c in timed if c.fits]
    if fitting:
        c = fitting[0]
        return (f"its fastest candidate that fits, {c.shape.strategy} {c.shape.describe()}, is predicted "
                f"{c.cost.step_s:.3g} s a step, {c.cost.step_s / best.cost.step_s:.2f} x the best's")
    refused = [c for c in timed if c.fits is False]
    if refused:  # the closest to fitting says most: even it does not
        c = min(refused, key=lambda c: c.closed_form_bytes if c.memory_bytes is None else c.memory_bytes)
        return f"none of its candidates fits; the smallest, {c.shape.strategy} {c.shape.describe()}: {c.why_not}"
    c = timed[0]
    return (f"none of its candidates was found to fit; the fastest, {c.shape.strategy} {c.shape.describe()} "
            f"({c.cost.step_s:.3g} s a step, predicted): {c.why_not or 'not simulated'}")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def infeasible_line(plan: Plan, where: Path) -> str:
    r = plan.request
    asked = f"nothing fits {r.workers} x {r.memory_bytes / GiB:g} GiB for a batch of {r.batch} x {r.seq_len} tokens"
    simulated = [c for c in plan.candidates if c.memory_bytes is not None]
    over_host = [c for c in plan.candidates if c.over_host]
    reasons = []
    if simulated:
        c = min(simulated, key=lambda c: c.memory_bytes)
        reasons.append(f"the smallest dry run, {c.shape.strategy} {c.shape.describe()}, needs "
                       f"{c.memory_bytes / GiB:.2f} GiB")
    if over_host:
        c = min(over_host, key=lambda c: c.host_bytes)
        reasons.append(f"{len(over_host)} candidate(s) need more host memory than plan.host_memory_gb="
                       f"{r.host_memory_bytes / GiB:g}, the least {c.shape.strategy} {c.shape.describe()} "
                       f"with {c.host_bytes / GiB:.1f} GiB (an estimate)")
    if not reasons:
        refusals = sorted({c.why_not for c in plan.candidates if c.why_not})
        reasons.append(f"every candidate was refused ({refusals[0] if refusals else 'no candidate'})")
    if plan.batch_note:
        reasons.append(plan.batch_note)
    return (f"{asked}: {'; '.join(reasons)}; raise plan.device_memory_gb, plan.host_memory_gb or plan.workers, "
            f"or lower plan.batch_size (every candidate in {where / 'plan.json'})")
