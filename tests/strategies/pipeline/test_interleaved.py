"""Interleaved 1F1B (`strategy=pipe_interleaved`): its schedule as data, and real gloo runs.

The schedule: every shape validates, idles exactly (d - 1)/(v m + d - 1) of stage time in the
dry run, holds at most its declared units in flight, equals PipeDream-Flush with one chunk, and
refuses m that is not a multiple of d. The runs: a tied GPT-2 whose embedding and head sit on
different stages' chunks equals the plain loop, with replicas, stage recompute and host
offload; message-driven execution is refused in one line; the dry run and the view take it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.commands.cli import main
from relaytrain.models import build_model
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.strategies.pipeline.schedule import COMPUTE, FlushSchedule, InterleavedSchedule, Op
from relaytrain.strategies.pipeline.validate import check_schedule
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_GPT2, tiny_cfg, train_plain_loop

SHAPES = [(d, v, m) for d in (2, 3, 4) for v in (1, 2, 3) for m in (d, 2 * d, 3 * d)]
STEPS = 3


def units_in_flight(schedule, stage) -> int:
    held, peak = set(), 0
    for a in schedule.actions(stage):
        if a.op is Op.FORWARD:
            held.add(a.unit)
            peak = max(peak, len(held))
        elif a.op is Op.BACKWARD:
            held.remove(a.unit)
    return peak


@pytest.mark.parametrize(("d", "v", "m"), SHAPES)
def test_every_shape_validates_idles_as_its_formula_and_keeps_its_stash_bound(d, v, m):
    schedule = InterleavedSchedule.build(d, m, num_batches=2, chunks=v)
    timeline = check_schedule(InterleavedSchedule.build(d, m, num_batches=1, chunks=v))
    assert timeline.bubble_fraction() == pytest.approx((d - 1) / (v * m + d - 1))
    assert InterleavedSchedule.bubble(d, m, v) == pytest.approx(timeline.bubble_fraction())
    check_schedule(schedule)
    for stage in range(d):
        assert units_in_flight(schedule, stage) == InterleavedSchedule.in_flight(d, m, stage, v)
        for chunk in range(v):  # each chunk runs every micro-batch once each way
            for op in COMPUTE:
                assert sorted(a.microbatch for a in schedule.actions(stage) if a.op is op and a.chunk == chunk) \
                    == list(range(2 * m))


def test_with_one_chunk_it_is_pipedream_flush():
    for d, m in ((2, 4), (3, 6), (4, 4)):
        assert InterleavedSchedule.build(d, m, 3).programs == FlushSchedule.build(d, m, 3).programs


def test_micro_batches_must_be_a_multiple_of_the_stages():
    with pytest.raises(ConfigError, match="multiple of strategy.stages"):
        InterleavedSchedule.build(2, 3, chunks=2)
    with pytest.raises(ConfigError, match="one model chunk per stage"):
        FlushSchedule.build(2, 4, chunks=2)


def test_the_last_stage_feeds_the_first_stages_next_chunk():
    schedule = InterleavedSchedule.build(2, 2, chunks=2)
    first = schedule.actions(0)
    assert [a for a in first if a.op is Op.RECV_ACT] and all(a.chunk == 1 for a in first if a.op is Op.RECV_ACT)
    last = schedule.actions(1)
    assert all(a.chunk == 0 for a in last if a.op is Op.SEND_ACT)  # chunk 1 of the last stage ends the model


# ----------------------------------------------------------------------------- real runs


def interleaved_cfg(*overrides: str):
    return tiny_cfg("gpt2", "strategy=pipe_interleaved", "model.num_layers=4", f"train.steps={STEPS}",
                    "train.save_model=true", "strategy.microbatch_size=2", "optim=sgd", "optim.lr=0.05",
                    "strategy.timeout_s=60", *overrides)


@pytest.mark.parametrize("overrides", [
    [],
    pytest.param(["strategy.replicas=2", "strategy.recompute=stage"], marks=pytest.mark.slow),  # ~4 s: the slow step
    ["strategy.offload=host", "strategy.recompute=block"],
])
def test_tied_gpt2_on_two_stages_of_two_chunks_equals_the_plain_loop(overrides, tmp_path):
    cfg = interleaved_cfg(*overrides)
    results = run(cfg, tmp_path / "run")
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(tmp_path / "run" / "model"))
    single = copy.deepcopy(cfg)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * cfg.strategy.replicas)
    reference = train_plain_loop(single, STEPS).hf_model
    for (name, a), (_, b) in zip(build_model(saved.model).hf_model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
    report = results["strategy_report"]
    assert report["layout"] == [1, 1, 1, 1] and "2 chunks each" in report["summary"]["pipeline"]
    assert report["bubble_fraction_formula"] == pytest.approx(1 / (2 * 4 + 1))


def test_message_driven_execution_and_a_bad_layout_are_refused_in_one_line(capsys):
    for overrides, words in ((["strategy.execution=message_driven"], "use strategy.execution=static"),
                             (["strategy.layout=[2,2]"], "one per model chunk"),
                             (["strategy.chunks=3"], "strategy.chunks=3 exceeds model.num_layers=4")):
        assert main(["train", *TINY_GPT2, "model.num_layers=4", "strategy=pipe_interleaved", *overrides]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert words in line, line


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_the_dry_run_holds_fewer_units_in_flight_per_chunk_than_gpipe():
    cfg = [*TINY_GPT2, "model.num_layers=4", "strategy.microbatch_size=4", "strategy.num_microbatches=8"]
    interleaved = simulate(compose_config([*cfg, "strategy=pipe_interleaved"]))
    gpipe = simulate(compose_config([*cfg, "strategy=pipe_gpipe"]))
    assert len(interleaved.per_process) == 2 and interleaved.peak_bytes < gpipe.peak_bytes


def test_the_schedule_view_draws_chunks(capsys):
    assert main(["schedule", "strategy=pipe_interleaved", "strategy.stages=4", "strategy.chunks=2",
                 "strategy.num_microbatches=8"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the console wraps long lines
    assert "pipe_interleaved: 4 stages of 2 model chunks" in flat and "m+d-1) = 0.158 per flush" in flat


def test_the_planner_tries_two_and_four_chunks():
    cls = strategy_class("pipe_interleaved")
    variants = {shape.options for shape in cls.cost_model.shapes(workers=2, batch=16, num_layers=8)}
    assert variants == {(), (("chunks", "4"),)}  # 2 is the default: its command does not repeat it
    assert {shape.options for shape in cls.cost_model.shapes(workers=2, batch=16, num_layers=4)} == {()}
