"""Pipeline schedules as data: invariants for many (stages, micro-batches), no processes, no torch."""

import dataclasses
import gc
import io
import re
import subprocess
import sys

import pytest
from rich.console import Console

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import fill_and_drain_bubble as bubble_formula
from relaytrain.strategies.pipeline.schedule import (
    COMPUTE,
    Action,
    Op,
    SlicePlan,
    TwoBWSchedule,
    build_schedule,
    schedules,
)
from relaytrain.strategies.pipeline.validate import (
    ScheduleError,
    StageInvariants,
    check_message_driven,
    check_schedule,
)
from relaytrain.strategies.pipeline.view import (
    legend_entries,
    png_figure,
    render_grid,
    render_svg,
)
from relaytrain.utils.errors import ConfigError

SHAPES = [(d, m) for d in range(1, 7) for m in range(1, 11)]


def shapes_for(kind):
    return [(d, m) for d, m in SHAPES if kind != "pipe_2bw" or m >= d]


def stash_peaks(schedule, stage):
    """Most activations a stage holds at once (forwards whose backward has not run)."""
    in_flight, peak = set(), 0
    for a in schedule.actions(stage):
        if a.op is Op.FORWARD:
            in_flight.add(a.microbatch)
            peak = max(peak, len(in_flight))
        elif a.op is Op.BACKWARD:
            in_flight.remove(a.microbatch)
    return peak


@pytest.mark.parametrize("kind", ["pipe_flush", "pipe_2bw", "pipe_gpipe"])
def test_every_shape_validates_and_runs_each_microbatch_once(kind):
    for d, m in shapes_for(kind):
        schedule = build_schedule(kind, d, m, num_batches=3)
        check_schedule(schedule)
        for stage in range(d):
            actions = schedule.actions(stage)
            for op in COMPUTE:
                assert sorted(a.microbatch for a in actions if a.op is op) == list(range(3 * m))
            assert [a.batch for a in actions if a.op is Op.OPTIMIZER_STEP] == [0, 1, 2]


@pytest.mark.parametrize("kind", sorted(schedules()))
def test_last_backward_names_each_stages_last_backward_of_a_batch(kind):
    """The runtime posts the tied-gradient receive at the unit `last_backward` names."""
    cls = schedules()[kind]
    for d, m in [(2, 2), (2, 4), (3, 3), (4, 4), (4, 8)]:
        for v in (1, 2):
            if cls.refusal(d, m, v):
                continue
            schedule = cls.build(d, m, num_batches=3, first_batch=1, chunks=v)
            for stage in range(d):
                last = {a.batch: a.unit for a in schedule.actions(stage) if a.op is Op.BACKWARD}
                assert last == {b: cls.last_backward(b, m) for b in (1, 2)}, (d, m, v, stage)


@pytest.mark.parametrize("kind", ["pipe_flush", "pipe_2bw"])
def test_one_f_one_b_stashes_at_most_d_minus_i_activations(kind):
    for d, m in shapes_for(kind):
        schedule = build_schedule(kind, d, m, num_batches=2)
        assert [stash_peaks(schedule, i) for i in range(d)] == [min(d - i, m if kind == "pipe_flush" else 2 * m)
                                                                 for i in range(d)]


def test_gpipe_stashes_every_microbatch():
    schedule = build_schedule("pipe_gpipe", 3, 5)
    assert [stash_peaks(schedule, i) for i in range(3)] == [5, 5, 5]


@pytest.mark.parametrize("kind", ["pipe_flush", "pipe_gpipe"])
def test_flushed_schedules_idle_exactly_as_the_bubble_formula_says(kind):
    for d, m in SHAPES:
        timeline = check_schedule(build_schedule(kind, d, m, num_batches=1))
        assert timeline.bubble_fraction() == pytest.approx(bubble_formula(d, m)), (d, m)


def test_2bw_follows_the_version_rule_action_by_action():
    for d, m in shapes_for("pipe_2bw"):
        schedule = build_schedule("pipe_2bw", d, m, num_batches=4)
        for stage in range(d):
            made = 0  # versions this stage has made so far (version 0 is the initial weights)
            last_backward_of = {}
            for i, a in enumerate(schedule.actions(stage)):
                if a.op in COMPUTE:
                    assert a.version == max(a.microbatch // m - 1, 0), (d, m, stage, a)
                    assert a.version in (made, made - 1), "only the two newest versions exist"
                    if a.op is Op.BACKWARD:
                        last_backward_of[a.batch] = i
                elif a.op is Op.OPTIMIZER_STEP:
                    assert a.version == a.batch + 1 == made + 1
                    assert a.batch in last_backward_of and last_backward_of[a.batch] < i
                    made += 1
            assert made == 4


def test_2bw_keeps_at_most_two_versions_live():
    for d, m in shapes_for("pipe_2bw"):
        schedule = build_schedule("pipe_2bw", d, m, num_batches=4)
        for stage in range(d):
            latest, in_flight = 0, {}
            for a in schedule.actions(stage):
                if a.op is Op.OPTIMIZER_STEP:
                    latest = a.version
                elif a.op is Op.FORWARD:
                    in_flight[a.microbatch] = a.version
                elif a.op is Op.BACKWARD:
                    assert in_flight.pop(a.microbatch) == a.version, "forward and backward share a version"
                assert len(set(in_flight.values()) | {latest}) <= 2


def test_2bw_pipeline_never_drains_between_updates():
    flush = check_schedule(build_schedule("pipe_flush", 4, 4, num_batches=8)).bubble_fraction()
    two_bw = check_schedule(build_schedule("pipe_2bw", 4, 4, num_batches=8)).bubble_fraction()
    assert flush == pytest.approx(bubble_formula(4, 4))
    assert two_bw < flush / 3  # only the run's start and end idle


def test_2bw_needs_at_least_as_many_microbatches_as_stages():
    with pytest.raises(ConfigError, match="num_microbatches >= strategy.stages"):
        build_schedule("pipe_2bw", 4, 3)


# ----------------------------------------------------------------- broken schedules are caught


def edit(schedule, stage, change):
    """A copy of `schedule` whose stage program is change(flat action list), one action per step."""
    programs = list(schedule.programs)
    programs[stage] = tuple((a,) for a in change(schedule.actions(stage)))
    return dataclasses.replace(schedule, programs=tuple(programs))


def swap(actions, first, second):
    i, j = actions.index(first), actions.index(second)
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def test_the_registry_finds_a_refined_schedule_and_refuses_one_without_its_own_name():
    def names_with(attrs):
        refined = type("Refined", (TwoBWSchedule,), attrs)  # held: the registry sees it until collected
        try:
            return list(schedules())
        except TypeError as err:
            return str(err)
        finally:
            del refined

    assert "pipe_refined" in names_with({"name": "pipe_refined"})
    gc.collect()
    assert names_with({}) == "schedule Refined does not set its own `name` (its strategy's name)"
    gc.collect()
    assert "pipe_refined" not in schedules()


def test_a_strategy_must_run_the_schedule_named_as_it():
    from relaytrain.strategies import register, registry
    from relaytrain.strategies.pipeline.flush import Flush

    with pytest.raises(TypeError, match="named 'pipe_flush'; a schedule's name is its strategy's"):
        register("pipe_renamed")(type("Renamed", (Flush,), {}))
    assert "pipe_renamed" not in registry()


def test_validator_catches_a_backward_before_its_forward():
    schedule = build_schedule("pipe_flush", 1, 2)
    broken = edit(schedule, 0, lambda a: swap(a, Action(Op.FORWARD, 1, 0, 0), Action(Op.BACKWARD, 1, 0, 0)))
    with pytest.raises(ScheduleError, match="before its forward"):
        check_schedule(broken)


def test_validator_catches_a_missing_send():
    schedule = build_schedule("pipe_flush", 2, 2)
    broken = edit(schedule, 0, lambda a: [x for x in a if x != Action(Op.SEND_ACT, 1, 0)])
    with pytest.raises(ScheduleError, match="send_act"):
        check_schedule(broken)


def test_validator_catches_receives_out_of_send_order():
    schedule = build_schedule("pipe_gpipe", 2, 2)
    broken = edit(schedule, 1, lambda a: swap(a, Action(Op.RECV_ACT, 0, 0), Action(Op.RECV_ACT, 1, 0)))
    with pytest.raises(ScheduleError, match="sent micro-batch 0 first"):
        check_schedule(broken)


def test_validator_catches_a_deadlock():
    # Stage 0 waits for a gradient before sending the activation that would produce it.
    schedule = build_schedule("pipe_flush", 2, 1)
    deadlocked = edit(schedule, 0, lambda a: [Action(Op.RECV_GRAD, 0, 0)] + [x for x in a if x.op is not Op.RECV_GRAD])
    with pytest.raises(ScheduleError, match="deadlocks"):
        check_schedule(deadlocked)


def test_validator_catches_a_wrong_version():
    schedule = build_schedule("pipe_2bw", 2, 2, num_batches=3)
    wrong = Action(Op.FORWARD, 4, 2, 0)  # batch 2 must use version 1
    broken = edit(schedule, 1, lambda a: [wrong if x == Action(Op.FORWARD, 4, 2, 1) else x for x in a])
    with pytest.raises(ScheduleError, match="version rule"):
        check_schedule(broken)


def test_validator_catches_2bw_needing_a_third_version():
    # m < d: stage 0 would start batch b+2 before finishing batch b (build_schedule refuses it).
    d, m, n = 4, 2, 4
    programs = tuple(tuple(tuple(step) for step in TwoBWSchedule.stage_program(d, m, s, n)) for s in range(d))
    with pytest.raises(ScheduleError, match="stashed activations exceed|version"):
        check_schedule(TwoBWSchedule(d, m, n, programs))


# ----------------------------------------------------------------- message-driven execution


# pipe_2bw's over 5 s on 2 cores: the slow step (the default suite stays within 8 minutes)
@pytest.mark.parametrize("kind", ["pipe_flush", pytest.param("pipe_2bw", marks=pytest.mark.slow), "pipe_gpipe"])
def test_every_order_message_driven_execution_may_choose_keeps_the_rules_and_never_deadlocks(kind):
    """All states the stages reach together when each runs whichever permitted unit has its
    message, under every order of arrival (resumed programs too): every action replayed through
    the validator's invariants, and some stage can always move until all are done."""
    for d in range(1, 5):
        for m in range(d if kind == "pipe_2bw" else 1, 5):
            for first in (0, 2):
                check_message_driven(build_schedule(kind, d, m, first + 3, first))


def test_the_exploration_covers_orders_the_program_does_not_take(monkeypatch):
    """Three 1F1B stages: the middle one may run a backward before the forward its program puts
    first. Held to the program's order, the stages reach fewer states together."""
    schedule = build_schedule("pipe_flush", 3, 4, 2)
    reordering = check_message_driven(schedule)
    monkeypatch.setattr(SlicePlan, "candidates", lambda plan: [plan.static_next()])
    assert reordering > check_message_driven(schedule)


def test_the_exploration_catches_an_executor_that_ignores_the_rules(monkeypatch):
    monkeypatch.setattr(StageInvariants, "allows", lambda self, actions: True)
    with pytest.raises(ScheduleError, match=r"stage \d: .*(before its forward|stashed activations|version)"):
        check_message_driven(build_schedule("pipe_2bw", 2, 2, 3))


def test_the_exploration_catches_a_deadlock():
    schedule = build_schedule("pipe_flush", 2, 2)
    broken = edit(schedule, 0, lambda a: [x for x in a if x != Action(Op.SEND_ACT, 1, 0)])
    with pytest.raises(ScheduleError, match="can deadlock: .*stage 1 in batch 0 after 1 forwards and 1 backwards"):
        check_message_driven(broken)


# ----------------------------------------------------------------- the viewer


def test_schedule_command_prints_the_grid_and_writes_svg(tmp_path, capsys):
    out = tmp_path / "2bw.svg"
    code = main(["schedule", "strategy=pipe_2bw", "strategy.stages=4", "strategy.num_microbatches=8",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "pipe_2bw: 4 stages, 8 micro-batches" in printed
    assert all(f"stage {s}" in printed for s in range(4))
    assert "v1 made at" in printed and "first used by micro-batch 17" in printed
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.count("<rect") > 4 * 2 * 24


def test_schedule_command_refuses_bad_input_in_one_line(capsys):
    assert main(["schedule", "strategy=pipe_2bw", "strategy.stages=4", "strategy.num_microbatches=2"]) == 2
    assert main(["schedule", "strategy=pipe_flush", "strategy.stagez=2"]) == 2
    assert main(["schedule", "strategy=pipe_flush", "--out", "plot.gif"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("relaytrain: error: ") for line in errors)
    assert "did you mean strategy.stages" in errors[1]


def test_png_needs_matplotlib_or_names_the_fix(tmp_path, capsys):
    out = tmp_path / "flush.png"
    code = main(["schedule", "strategy=pipe_flush", "--out", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "pip install matplotlib" in capsys.readouterr().err
    else:
        assert code == 0 and out.stat().st_size > 0


def test_svg_marks_every_version_switch():
    schedule = build_schedule("pipe_flush", 2, 3, num_batches=2)
    svg = render_svg(schedule, check_schedule(schedule))
    assert svg.count('fill="black"') == 2 * 2  # one optimizer step per stage per batch


def grid_text(kind, d, m, n, width=None, plain=True):
    """What a console of `width` columns prints for the grid: no colour when `plain`."""
    schedule = build_schedule(kind, d, m, n)
    console = Console(file=io.StringIO(), width=width or 100_000, force_terminal=not plain,
                      color_system=None if plain else "standard")
    console.print(render_grid(schedule, check_schedule(schedule), width, plain=plain))
    return schedule, console.file.getvalue()


def stage_rows(text, stage):
    return [line[9:] for line in text.splitlines() if line.startswith(f"stage {stage:<2} ")]


def test_schedule_help_lists_every_option_and_exits_0(capsys):
    for flag in ("--help", "-h"):
        assert main(["schedule", flag]) == 0
        printed = capsys.readouterr().out
        for word in ("usage: relaytrain schedule", "--schedule", "--batches", "--out", "strategy.stages",
                     "strategy.num_microbatches", "strategy=", "examples"):
            assert word in printed, word


@pytest.mark.parametrize("kind, d, m", [("pipe_gpipe", 2, 12), ("pipe_flush", 3, 40), ("pipe_2bw", 2, 4)])
def test_plain_grid_separates_ids_and_tells_forward_backward_and_version(kind, d, m):
    schedule, text = grid_text(kind, d, m, 3)
    assert "\x1b[" not in text and "|F1" in text and "legend:" in text
    for stage in range(d):
        (row,) = stage_rows(text, stage)
        boxes = re.findall(r"\|([FBfb])(\d+)", row)
        assert re.sub(r"\|[FBfb]\d+", "", row).strip(" .") == "", "nothing but boxes and idle dots"
        for letter in "FB":
            found = sorted(int(k) for op, k in boxes if op.upper() == letter)
            assert found == list(range(1, schedule.total_microbatches + 1)), (stage, letter)
        for op, k in boxes:  # upper case: even weight version, lower case: odd
            assert op.islower() == (schedules()[kind].weight_version(int(k) - 1, m) % 2 == 1), (op, k)


def test_colour_grid_never_merges_ids():
    schedule, text = grid_text("pipe_gpipe", 2, 40, 3, plain=False)
    assert "\x1b[" in text
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    for stage in range(2):
        (row,) = stage_rows(plain, stage)
        ids = sorted(int(k) for k in re.findall(r"\d+", row))
        assert ids == sorted(2 * list(range(1, schedule.total_microbatches + 1)))


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_piped_command_prints_plain_boxes():
    command = ["schedule", "strategy=pipe_2bw", "strategy.stages=2", "strategy.num_microbatches=4"]
    script = f"import sys; from relaytrain.commands.cli import main; sys.exit(main({command!r}))"
    env = {"PATH": "", "COLUMNS": "80", "TERM": "xterm-256color"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert "\x1b[" not in done.stdout
    assert "|F1 |F2 " in done.stdout and "|f9 " in done.stdout and "|b12" in done.stdout
    assert not re.search(r"\d \d|\d{4}", "".join(stage_rows(done.stdout, 0)))


@pytest.mark.parametrize("width", [40, 60, 80])
def test_narrow_console_gets_bands_that_fit(width):
    schedule, text = grid_text("pipe_2bw", 4, 8, 3, width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    bands = len(stage_rows(text, 0))
    assert bands > 1 and all(len(stage_rows(text, s)) == bands for s in range(4))
    axes = [line for line in lines if re.fullmatch(r" {9}\d[\d ]*", line)]
    assert len(axes) == bands, "each band has its own time axis"
    ids = re.findall(r"\|([FBfb])(\d+)", "".join(stage_rows(text, 0)))
    assert len(ids) == 2 * schedule.total_microbatches, "every box is drawn once, cut boxes go on with ~"


def test_svg_has_a_legend_below_the_boxes():
    schedule = build_schedule("pipe_2bw", 2, 2, num_batches=3)
    svg = render_svg(schedule, check_schedule(schedule))
    for _, label in legend_entries():
        assert f">{label}</text>" in svg
    assert "forward, even weight version" in svg and "new weight version" in svg
    grid_bottom = 30 + 2 * 28
    legend_ys = [int(y) for y in re.findall(r'<path d="M\d+ (\d+)', svg)]
    assert legend_ys and min(legend_ys) >= grid_bottom
    height = int(re.search(r'height="(\d+)"', svg).group(1))
    assert max(legend_ys) + 12 <= height


def test_png_has_a_legend(tmp_path):
    pytest.importorskip("matplotlib")
    schedule = build_schedule("pipe_2bw", 2, 2, num_batches=3)
    figure = png_figure(schedule, check_schedule(schedule))
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [label for _, label in legend_entries()]
    out = tmp_path / "2bw.png"
    assert main(["schedule", "strategy=pipe_2bw", "strategy.stages=2", "strategy.num_microbatches=2",
                 "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_png_without_matplotlib_fails_before_printing(tmp_path, capsys, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "flush.png"
    assert main(["schedule", "strategy=pipe_flush", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    (error,) = captured.err.strip().splitlines()
    assert "pip install matplotlib" in error and "flush.svg" in error
