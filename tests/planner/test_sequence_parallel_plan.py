"""The planner and sequence parallelism (`strategy.sequence_parallel=S`): which strategies and
models it offers cut shapes for, how a cut shape is priced (a worker's share of the tokens,
attention's all-to-alls, every worker's gradient sums), how many workers the host checks count,
the pre-run estimate of a cut run, and a plan at a long sequence that only a cut shape fits."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch

from relaytrain.cost.formulas import ModelFacts, Shape
from relaytrain.cost.profile import PartTimes, Profile, Timings
from relaytrain.models import count_parameters
from relaytrain.planner.candidates import (
    PRUNE_FACTOR,
    GiB,
    Request,
    candidate_config,
    enumerate_shapes,
    host_bytes,
)
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.estimate import estimate
from relaytrain.planner.output import print_plan
from relaytrain.planner.plan import make_plan
from relaytrain.run.compose import compose_config, validate
from relaytrain.schema.config import SequenceParallelConfig
from relaytrain.strategies import registry, strategy_class
from tests.conftest import TINY_BERT, TINY_LLAMA

# The strategies that can cut sequences: those with the strategy.sequence_parallel key.
CUTTING = tuple(name for name, cls in registry().items() if issubclass(cls.Config, SequenceParallelConfig))
LONG = ["model.max_seq_len=4096", "data.seq_len=4096"]  # TINY_LLAMA's activations dwarf its weights here


def cut_shapes(overrides: list[str], workers: int = 2, strategies=(*CUTTING, "pipe_flush")) -> list[Shape]:
    request = Request(workers, GiB, 8, "this", tuple(strategies), 1)
    return [s for s in enumerate_shapes(request, compose_config(overrides)) if s.sequence_parallel > 1]


def cut(shape: Shape, size: int = 2) -> Shape:
    return dataclasses.replace(shape, sequence_parallel=size)


def profile(device_type: str = "cuda", bandwidth: float = 1e9, latency: float = 1e-5) -> Profile:
    """A block forward of 10 ms and backward of 20 ms at b=1, only 1.5 times that at b=2 (a
    device that one sequence does not fill), ends and optimizer free, links at `bandwidth` with
    `latency` a message."""
    zero = PartTimes(0.0, 0.0)
    timings = Timings({1: PartTimes(0.01, 0.02), 2: PartTimes(0.015, 0.03)}, {1: zero, 2: zero}, {1: zero, 2: zero},
                      0.0, 0.0)
    return Profile("synthetic", "test device", device_type, "synthetic", 8, 16 * GiB,
                   None if device_type == "cpu" else 1e10, bandwidth, bandwidth, bandwidth, 8, latency, 0.0,
                   {0: timings})


# --------------------------------------------------------------------------- which shapes


def test_a_llama_layout_decoder_on_two_workers_is_offered_cut_shapes_by_every_strategy_that_cuts():
    shapes = cut_shapes(TINY_LLAMA)
    assert {(s.strategy, s.replicas, s.sequence_parallel, s.workers) for s in shapes} == {
        (name, 1, 2, 2) for name in CUTTING}  # no pipeline: it cannot cut
    assert all(s.batch == 8 for s in shapes)  # the S workers of a replica share its sequences
    overrides = shapes[0].overrides()
    assert "strategy.sequence_parallel=2" in overrides and "strategy.replicas=1" in overrides
    assert "sp=2" in shapes[0].describe()


def test_only_sizes_that_divide_the_workers_and_the_heads_are_offered():
    shapes = cut_shapes(TINY_LLAMA, workers=4)  # 4 query heads, 2 key/value heads: S=4 cannot be
    assert {s.sequence_parallel for s in shapes} == {2}
    assert {s.replicas for s in shapes} == {1, 2} and max(s.workers for s in shapes) == 4
    assert not cut_shapes(TINY_LLAMA, workers=3)  # 2 does not divide 3 workers


@pytest.mark.parametrize("overrides", [
    TINY_BERT,  # an encoder: its family cannot be cut
    [*TINY_LLAMA, "model.num_kv_heads=1"],  # one key/value head: two workers cannot share it
    [*TINY_LLAMA, "model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=48"],  # 3 heads: not halved
    [*TINY_LLAMA, "train.compile=true"],  # refused by a cut run
    ["model=olmoe_1b_7b", "model.num_layers=2"],  # a mixture of experts: refused by a cut run
], ids=["bert", "one-kv-head", "three-heads", "compiled", "moe"])
def test_no_cut_shape_where_a_cut_run_would_be_refused(overrides):
    assert cut_shapes(overrides) == []


# --------------------------------------------------------------------------- how a cut shape is priced


def priced(shape: Shape, overrides: list[str], prof: Profile):
    cfg = candidate_config(compose_config([*overrides, f"strategy={shape.strategy}"]), shape)
    model = strategy_class(shape.strategy).cost_model
    facts = ModelFacts.of(cfg)
    return model.step_cost(cfg, facts, prof), model.device_bytes(cfg, facts)


@pytest.mark.parametrize("strategy", CUTTING)
def test_a_cut_shapes_closed_form_memory_is_about_half_at_a_long_sequence(strategy):
    whole = Shape(strategy, 1, 2, recompute="always" if strategy == "l2l" else "none")
    _, whole_bytes = priced(whole, [*TINY_LLAMA, *LONG], profile())
    _, cut_bytes = priced(cut(whole), [*TINY_LLAMA, *LONG], profile())
    assert 0.45 < cut_bytes / whole_bytes < 0.55


@pytest.mark.parametrize("strategy", CUTTING)
def test_a_cut_shapes_closed_form_is_within_the_pruning_factor_of_its_dry_run(strategy):
    """As for every whole shape (tests/test_conformance.py): a cut shape is pruned by its closed
    form before it is dry-run, so the two must agree."""
    shape = cut(Shape(strategy, 1, 2, recompute="always" if strategy == "l2l" else "none"))
    cfg = candidate_config(compose_config([*TINY_LLAMA, "model.max_seq_len=1024", "data.seq_len=1024",
                                           f"strategy={strategy}"]), shape)
    closed = strategy_class(strategy).cost_model.device_bytes(cfg, ModelFacts.of(cfg))
    assert 1 / PRUNE_FACTOR <= closed / simulate(cfg).peak_bytes <= PRUNE_FACTOR


def test_a_worker_of_a_cut_block_keeps_and_stashes_half_the_tokens():
    facts = ModelFacts.of(compose_config([*TINY_LLAMA, *LONG]))
    half = facts.cut(2)
    assert half.tokens == 2048
    assert half.block_activation_bytes(2) == facts.block_activation_bytes(2) / 2
    assert half.boundary_bytes(2) == facts.boundary_bytes(2) / 2


def test_a_cut_step_is_half_the_compute_plus_attentions_all_to_alls_and_every_workers_gradient_sums():
    """Hand count: TINY_LLAMA's 4 heads of 8 (32 query values a token) and 2 key/value heads (16
    each); per block and micro-batch each worker sends (S-1)/S of its tokens' q, k, v and output
    (96 fp32 values a token) forward and again backward, in 4 calls each way."""
    prof = profile()
    whole, cut_ = Shape("baseline", 1, 2), cut(Shape("baseline", 1, 2))
    whole_cost, _ = priced(whole, [*TINY_LLAMA, *LONG], prof)
    cut_cost, _ = priced(cut_, [*TINY_LLAMA, *LONG], prof)
    assert cut_cost.parts["compute"] == pytest.approx(whole_cost.parts["compute"] / 2)
    blocks, microbatches, passes, tokens = 3, 2, 2, 2048
    one_call = (2 - 1) / 2 * tokens * 96 * 4 / 1e9 + (2 - 1) * 1e-5 * 4
    assert cut_cost.parts["attention all-to-alls"] == pytest.approx(blocks * microbatches * passes * one_call)
    assert "gradient sums (exposed)" in cut_cost.parts and "gradient sums (exposed)" not in whole_cost.parts
    # Two sequences cut in two: a worker's work is one whole sequence's, timed as one (not half of two's)
    two_cut, _ = priced(cut(Shape("baseline", 2, 1)), [*TINY_LLAMA, *LONG], prof)
    assert two_cut.parts["compute"] == pytest.approx(whole_cost.parts["compute"] / 2)
    # ... and in four: half a sequence's tokens a worker, half of one whole sequence's time (not a quarter of two's)
    quarter, _ = priced(cut(Shape("baseline", 2, 1), 4), [*TINY_LLAMA, *LONG, "model.num_kv_heads=4"], prof)
    assert quarter.parts["compute"] == pytest.approx(whole_cost.parts["compute"] / 4)
    recomputing, _ = priced(dataclasses.replace(cut_, recompute="block"), [*TINY_LLAMA, *LONG], prof)
    assert recomputing.parts["attention all-to-alls"] == pytest.approx(1.5 * cut_cost.parts["attention all-to-alls"])


# --------------------------------------------------------------------------- host memory


def preflight_host_bytes(cfg, cls, device_type: str) -> int:
    """The host memory the run's pre-launch check (`preflight.check_can_start`) holds against the machine."""
    return cls.cost_model.estimate_host_bytes(cfg, count_parameters(cfg.model), device_type)


@pytest.mark.parametrize("strategy", CUTTING)
def test_the_host_checks_count_every_worker_of_a_cut_run(strategy):
    """R x S workers: a cut replica's two workers hold what two replicas' do (on a GPU machine,
    where activations are on the device), in the planner's check and in the run's preflight."""
    base = compose_config([*TINY_LLAMA, f"strategy={strategy}"])
    cls = strategy_class(strategy)
    facts = ModelFacts.of(base)
    recompute = "always" if strategy == "l2l" else "none"
    two_replicas, one, one_cut = (Shape(strategy, 1, 4, 2, 1, recompute), Shape(strategy, 1, 8, 1, 1, recompute),
                                  Shape(strategy, 1, 8, 1, 1, recompute, (), 2))
    cfgs = {shape: candidate_config(base, shape) for shape in (two_replicas, one, one_cut)}
    cfgs[one].strategy.replicas = 1  # a shape leaves out replicas=1, and FSDP's default is 2
    on_cpu = profile("cpu")
    planned = {shape: host_bytes(cls, cfg, facts, on_cpu, shape) for shape, cfg in cfgs.items()}
    assert planned[one_cut] == planned[two_replicas] > planned[one]
    gpu = {shape: preflight_host_bytes(cfg, cls, "cuda") for shape, cfg in cfgs.items()}
    assert gpu[one_cut] == gpu[two_replicas] > gpu[one]
    cpu = {shape: preflight_host_bytes(cfg, cls, "cpu") for shape, cfg in cfgs.items()}
    assert cpu[one_cut] > cpu[one]


# --------------------------------------------------------------------------- the estimate line


def test_a_cut_run_gets_its_estimate_line():
    cfg = compose_config([*TINY_LLAMA, "strategy=baseline", "strategy.sequence_parallel=2", "train.threads=1",
                          "strategy.microbatch_size=2", "strategy.num_microbatches=1"])
    guess = estimate(cfg, strategy_class("baseline"))
    assert guess is not None and guess.step_s > 0
    assert "estimate (a prediction)" in guess.line(cfg.train.steps, torch.device("cpu"))


# --------------------------------------------------------------------------- a plan


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_plan_at_a_long_sequence_that_only_a_cut_shape_fits_prints_a_command_that_validates(tmp_path, capsys):
    """The budget sits just above the smallest cut shape's dry run, below the smallest whole one's
    (one micro-batch, block recompute, its inputs on the host): only cut shapes fit, so the plan's
    best is one, whatever the machine's speed."""
    overrides = [*TINY_LLAMA, "model.max_seq_len=2048", "data.seq_len=2048", "train.threads=1"]
    smallest = Shape("baseline", 1, 2, 1, 1, "block", (("stash", "host"),))
    base = compose_config([*overrides, "strategy=baseline"])
    whole, halved = (simulate(candidate_config(base, shape)).peak_bytes for shape in (smallest, cut(smallest)))
    assert halved < 0.75 * whole
    budget = 1.1 * halved
    plan = make_plan([*overrides, "plan.workers=2", "plan.batch_size=2", "plan.strategies=[baseline]",
                      f"plan.device_memory_gb={budget / GiB}"])
    best = plan.best
    assert best is not None and best.shape.sequence_parallel == 2 and best.simulated_bytes <= budget
    assert not any(c.fits for c in plan.candidates if c.shape.sequence_parallel == 1)
    print_plan(plan, tmp_path / "plan.json")
    assert f"run it: {plan.command(best)}" in capsys.readouterr().out
    args = shlex.split(plan.command(best))
    assert "strategy.sequence_parallel=2" in args and "strategy.replicas=1" in args
    cfg = compose_config(args[2:])
    validate(cfg)
    assert strategy_class(cfg.strategy.name).processes(cfg) == 2
