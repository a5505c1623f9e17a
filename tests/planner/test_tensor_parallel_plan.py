"""The planner and tensor parallelism (`strategy.tensor_parallel=T`): every placement is offered
through one door (`CostModel.degrees`, `placed_shapes`, the planner's `spreads`); which strategies
and models it offers split blocks for; the command and description of a split shape; the line a
plan prints when it does not choose one or offers none; and Llama 3 70B on eight H100s, offered
split blocks none of which fits."""

from __future__ import annotations

import pytest

from relaytrain.cost.formulas import ModelFacts, StepCost
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.cost.shape import Shape
from relaytrain.planner.candidates import (
    CUDA_HEADROOM,
    Candidate,
    GiB,
    Request,
    candidate_config,
    enumerate_shapes,
    offer,
    spreads,
)
from relaytrain.planner.output import placement_notes, print_plan, write_plan
from relaytrain.planner.plan import DECODER_ON_A_GPU, Plan, make_plan, precision_for
from relaytrain.run.compose import compose_config
from relaytrain.run.resolve import choose
from relaytrain.strategies import strategy_class
from relaytrain.strategies.whole_model_cost import split_refusal
from tests.conftest import TINY_BERT, TINY_GPT2, TINY_LLAMA

WHOLE_MODEL = ("baseline", "fsdp")
# Whether a run takes strategy.tensor_parallel > 1 at all (strategies/whole_model.py's check): until
# it does the planner offers no split, and the tests of what it offers then wait for it.
RUNS_SPLITS = strategy_class("baseline").cost_model.refusal(compose_config(TINY_LLAMA), choose(compose_config(
    TINY_LLAMA)).family, tensor_parallel=2) is None
needs_split_runs = pytest.mark.skipif(not RUNS_SPLITS, reason="the run refuses strategy.tensor_parallel > 1 so far")


def degrees(overrides: list[str], workers: int, strategy: str = "baseline") -> dict[str, list[int]]:
    cfg = compose_config(overrides)
    return strategy_class(strategy).cost_model.degrees(cfg, workers, choose(cfg).family)


def splittable(overrides: list[str], sizes=(2, 4)) -> list[int]:
    """The sizes the model's blocks split over, as a run checks them (whatever the run's config checks say)."""
    cfg = compose_config(overrides)
    return [size for size in sizes if split_refusal(cfg, choose(cfg).family, size) is None]


def split_shapes(overrides: list[str], workers: int = 4, strategies=(*WHOLE_MODEL, "l2l", "pipe_flush")) -> list[Shape]:
    request = Request(workers, GiB, 8, "this", tuple(strategies), 1)
    return [s for s in enumerate_shapes(request, compose_config(overrides)) if s.tensor_parallel > 1]


# --------------------------------------------------------------------------- which shapes


def test_every_placement_comes_through_one_door():
    """A cost model names each placement it takes with its sizes; the planner combines them, each
    unused or at one size, their product dividing the workers. A split is offered at the sizes
    the model's blocks take (2 key/value heads: not 4)."""
    assert degrees(TINY_LLAMA, 4) == {"sequence_parallel": [2], "tensor_parallel": [2]}
    assert degrees(TINY_LLAMA, 4, "l2l") == {"sequence_parallel": [2]}
    assert degrees(TINY_LLAMA, 4, "pipe_flush") == {}
    assert spreads({"sequence_parallel": [2], "tensor_parallel": [2, 4]}, 4) == [
        {}, {"tensor_parallel": 2}, {"tensor_parallel": 4}, {"sequence_parallel": 2},
        {"sequence_parallel": 2, "tensor_parallel": 2}]
    assert spreads({}, 4) == [{}]


@needs_split_runs
def test_split_shapes_are_offered_by_the_whole_model_strategies_alone():
    shapes = split_shapes(TINY_LLAMA)
    assert {s.strategy for s in shapes} == set(WHOLE_MODEL)
    assert {(s.replicas, s.tensor_parallel) for s in shapes if s.strategy == "baseline" and s.sequence_parallel == 1} \
        == {(1, 2), (2, 2)}
    # FSDP shards among the replicas: two of them at least where sequences are not cut too
    assert {s.replicas for s in shapes if s.strategy == "fsdp" and s.sequence_parallel == 1} == {2}
    # cut and split at once only where the run takes the two together
    cfg = compose_config(TINY_LLAMA)
    together = strategy_class("baseline").cost_model.refusal(cfg, choose(cfg).family, sequence_parallel=2,
                                                              tensor_parallel=2) is None
    assert any(s.sequence_parallel > 1 for s in shapes) == together
    assert all(s.batch == 8 and s.workers <= 4 for s in shapes)
    assert {s.tensor_parallel for s in split_shapes(TINY_BERT)} == {2, 4}  # 4 heads, no grouped key/values
    # what the run's checks refuse of a shape's other keys is not offered: FSDP's host offload with split blocks
    assert {s.options for s in shapes if s.strategy == "fsdp"} and not any(
        ("offload", "host") in s.options for s in shapes)


@pytest.mark.parametrize("overrides", [
    TINY_GPT2,  # no tensor-parallel plan
    [*TINY_LLAMA, "model.num_kv_heads=1"],  # one key/value head: two ranks cannot share it
    [*TINY_LLAMA, "model.intermediate_size=63"],  # an MLP width two ranks cannot share
    [*TINY_LLAMA, "adapter=lora"],  # adapter-wrapped layers are not split
    ["model=olmoe_1b_7b", "model.num_layers=2"],  # a mixture of experts (its replicas share the experts instead)
], ids=["gpt2", "one-kv-head", "odd-mlp", "lora", "moe"])
def test_no_split_where_a_run_would_refuse_the_split(overrides):
    assert splittable(overrides) == []
    assert split_shapes(overrides) == []


def test_the_models_blocks_split_where_heads_key_value_heads_and_mlp_divide():
    assert splittable(TINY_LLAMA) == [2]  # 2 key/value heads
    assert splittable(TINY_BERT) == [2, 4]  # 4 heads, no grouped key/values, an MLP of 64
    assert splittable(["model=llama3_70b"], (2, 4, 8, 16)) == [2, 4, 8]  # 8 key/value heads


def test_a_split_shape_runs_as_its_command_says():
    shape = Shape("fsdp", 2, 2, 2, tensor_parallel=2)
    assert shape.workers == 4 and shape.batch == 8 and "tp=2" in shape.describe()
    args = shape.overrides()
    assert "strategy.tensor_parallel=2" in args and "strategy.replicas=2" in args
    cfg = compose_config([*TINY_LLAMA, *args])
    cls = strategy_class(cfg.strategy.name)
    assert (cfg.strategy.tensor_parallel, cls.processes(cfg), cls.replicas(cfg)) == (2, 4, 2)
    alone = Shape("fsdp", 2, 4, 1, tensor_parallel=2).overrides()
    assert "strategy.replicas=1" in alone  # FSDP's default is 2 replicas: a spread shape names its own


# --------------------------------------------------------------------------- what the plan says


def _timed(shape: Shape, step_s: float, fits: bool | None, why_not: str | None = None) -> Candidate:
    return Candidate(shape, cost=StepCost(step_s, {}), fits=fits, why_not=why_not)


def test_a_plan_says_in_one_line_why_it_did_not_split_the_blocks():
    best = _timed(Shape("fsdp", 1, 4, 2), 1.0, True)
    slower = _timed(Shape("baseline", 1, 8, tensor_parallel=2), 1.5, True)
    too_big = _timed(Shape("baseline", 2, 4, tensor_parallel=2), 0.5, False, "needs 9 GiB (simulated), over 8 GiB")
    plan = Plan(Request(2, 8 * GiB, 8, "this", WHOLE_MODEL, 1), None, [too_big, best, slower], [], [])
    note = placement_notes(plan)["tensor_parallel"]
    assert note.startswith("strategy.tensor_parallel not chosen: its fastest candidate that fits, baseline tp=2 b=1")
    assert "1.50 x the best's" in note
    plan.candidates = [too_big, best]
    assert placement_notes(plan)["tensor_parallel"] == ("strategy.tensor_parallel not chosen: none of its candidates "
                                                        "fits; the smallest, baseline tp=2 b=2 m=4 rc=none: needs 9 GiB "
                                                        "(simulated), over 8 GiB")
    plan.candidates = [_timed(too_big.shape, 0.5, None, "not simulated: the dry-run budget was spent"), best]
    assert "none of its candidates was found to fit; the fastest" in placement_notes(plan)["tensor_parallel"]
    plan.candidates = [Candidate(too_big.shape, fits=False, why_not="refused for a reason"), best]
    assert placement_notes(plan)["tensor_parallel"].endswith("was refused (refused for a reason)")
    plan.candidates, plan.unplaced = [best], {"tensor_parallel": "baseline: a reason"}
    assert placement_notes(plan) == {"tensor_parallel": "strategy.tensor_parallel not offered: baseline: a reason"}
    plan.candidates = [slower, best]
    best.shape = Shape("baseline", 1, 8, tensor_parallel=2)  # the best splits the blocks: nothing to say
    assert placement_notes(plan) == {}


def test_a_placement_offered_at_no_size_is_explained_in_the_runs_own_words():
    """GPT-2 has no tensor-parallel plan, and BERT cannot cut its sequences: the plan's request
    says so with the line the run would stop with (the run's check of GPT-2's blocks, word for word)."""
    request = Request(2, GiB, 8, "this", WHOLE_MODEL, 1)
    cfg = compose_config(TINY_GPT2)
    gpt2 = offer(request, cfg)
    assert not any(s.tensor_parallel > 1 for s in gpt2.shapes)
    assert gpt2.unplaced["tensor_parallel"] == f"baseline: {split_refusal(cfg, choose(cfg).family, 2)}"
    assert gpt2.unplaced["tensor_parallel"].startswith("baseline: strategy.tensor_parallel")
    assert "model.family=bert" in offer(request, compose_config(TINY_BERT)).unplaced["sequence_parallel"]
    assert offer(Request(1, GiB, 8, "this", WHOLE_MODEL, 1), compose_config(TINY_GPT2)).unplaced == {}


@pytest.mark.slow
@needs_split_runs
def test_a_tiny_plan_on_two_cpu_workers_offers_split_blocks_and_says_why_it_did_not_choose_them(tmp_path, capsys):
    """Two CPU workers sharing the cores, room for everything: the two replicas sum their
    gradients once a step, two tensor ranks all-reduce four times a block and micro-batch, so
    the plan runs replicas and its one line says why not the split (slower, or refused by the
    run's checks); plan.json says it too, and the command runs what the best says."""
    plan = make_plan([*TINY_LLAMA, "train.threads=1", "plan.workers=2", "plan.batch_size=8",
                      "plan.strategies=[baseline]", "plan.device_memory_gb=4"])
    assert any(c.shape.tensor_parallel == 2 for c in plan.candidates)
    assert plan.best.shape.tensor_parallel == 1
    assert "strategy.tensor_parallel" not in plan.command(plan.best)
    print_plan(plan, write_plan(plan, tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if "strategy.tensor_parallel" in line]
    assert len(lines) == 1 and lines[0].startswith("strategy.tensor_parallel not chosen: ")
    assert lines[0].removeprefix("strategy.tensor_parallel not chosen: ") in (tmp_path / "plan.json").read_text()


# --------------------------------------------------------------------------- Llama 3 70B on eight H100s


@pytest.mark.slow
@needs_split_runs
def test_llama3_70b_on_eight_h100s_is_offered_split_blocks_none_of_which_fits():
    """Full fine-tuning in amp_bf16 holds 16 bytes a parameter, 1.1 TB, over 8 x 80 GB. Blocks
    split at every T dividing the heads (64), key/value heads (8), MLP (28,672) and the workers
    are offered, but a split divides the blocks among a replica's tensor ranks, not the state
    among every worker: a tensor rank's share, sharded by FSDP over the remaining replicas, still
    needs more than a GPU (146 GiB at the least). Only shapes that keep the state on the host fit,
    and FSDP's host offload does not take split blocks yet (the run refuses it, so the plan does
    not offer it): the fastest whose closed-form memory fits keeps its blocks whole."""
    spec = load_spec("h100_80gb")
    request = Request(8, spec["memory_gb"] * GiB, 32, "h100_80gb", ("baseline", "fsdp", "l2l"), 0)
    bases = {name: compose_config(["model=llama3_70b", f"strategy={name}",
                                   f"precision={precision_for(strategy_class(name), DECODER_ON_A_GPU)}"])
             for name in request.strategies}  # as the plan prices them: L2L in cmp_bf16, the others in amp_bf16
    shapes = enumerate_shapes(request, bases["fsdp"])
    split = [s for s in shapes if s.tensor_parallel > 1]
    assert {s.tensor_parallel for s in split} == {2, 4, 8} and {s.strategy for s in split} == {"baseline", "fsdp"}
    assert not any(("offload", "host") in s.options for s in split)
    profile = from_spec(spec, bases["fsdp"], sorted({s.microbatch_size for s in shapes}))
    budget = CUDA_HEADROOM * request.memory_bytes
    priced = []
    for shape in shapes:
        shape_cfg = candidate_config(bases[shape.strategy], shape)
        model, facts = strategy_class(shape.strategy).cost_model, ModelFacts.of(shape_cfg)
        priced.append((model.device_bytes(shape_cfg, facts), shape, model.step_cost(shape_cfg, facts, profile).step_s))
    assert min(nbytes for nbytes, shape, _ in priced if shape.tensor_parallel > 1) > 140 * GiB
    fitting = [(step_s, shape) for nbytes, shape, step_s in priced if nbytes <= budget]
    assert min(fitting, key=lambda found: found[0])[1].tensor_parallel == 1
