"""A preference pair planned as what it is: two sequences (`Objective.rows_per_item`), and a
reference pass before training (`cost.reference`). The closed forms count 2b sequences for a
micro-batch of b pairs, the dry run of objective=dpo agrees with them, the reference pass's
closed form agrees with the pass itself, and a run's throughput counts both rows of a pair."""

from __future__ import annotations

import csv
import dataclasses

import pytest
import torch

from relaytrain.cost.formulas import ModelFacts, Shape, microbatch_rows
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.cost.reference import block_forward_bytes, head_forward_bytes, hidden_bytes, reference_cost
from relaytrain.data import build_datasets
from relaytrain.dryrun.memory import DeviceMemory
from relaytrain.models import build_model
from relaytrain.planner.candidates import GiB, Request, candidate_config, check_candidate
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.reference import streamed_logps
from relaytrain.run.resolve import choose
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from tests.conftest import TINY_LLAMA

DPO = [*TINY_LLAMA, "objective=dpo"]
H100 = load_spec("h100_80gb")
# A shape of each kind of cost model: whole model, sharded, relayed (its stash both ways), pipelined;
# three in the default suite (a host stash's estimate from the config alone among them).
SLOW = pytest.mark.slow
SHAPES = [Shape("baseline", 2, 2, recompute="block", options=(("stash", "host"),)),
          Shape("l2l", 2, 2, recompute="always", options=(("stash", "host"),)),
          Shape("pipe_flush", 2, 4, stages=2, recompute="block"),
          pytest.param(Shape("baseline", 2, 2), marks=SLOW), pytest.param(Shape("fsdp", 2, 2, replicas=2), marks=SLOW),
          pytest.param(Shape("l2l", 2, 2, recompute="always"), marks=SLOW)]


def _as_sequences(facts: ModelFacts) -> ModelFacts:
    """The same model and head with one sequence an item: what b pairs must cost as 2b of."""
    return dataclasses.replace(facts, rows_per_item=1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.strategy}-{s.describe()}")
def test_a_microbatch_of_b_pairs_is_priced_as_2b_sequences(shape):
    """Device bytes, host state and estimate, and step time of b pairs are those of 2b sequences
    of the same model (whose head DPO does not cut into chunks)."""
    base = compose_config([*DPO, f"strategy={shape.strategy}"])
    pairs, model = candidate_config(base, shape), strategy_class(shape.strategy).cost_model
    doubled = candidate_config(base, dataclasses.replace(shape, microbatch_size=2 * shape.microbatch_size))
    facts = ModelFacts.of(pairs)
    assert facts.rows_per_item == 2 and facts.rows(shape.microbatch_size) == 4 and facts.loss_chunks is None
    profile = from_spec(H100, pairs, [4])
    assert model.device_bytes(pairs, facts) == model.device_bytes(doubled, _as_sequences(facts))
    assert model.host_state_bytes(pairs, facts) == model.host_state_bytes(doubled, _as_sequences(facts))
    # From the config alone (a host stash's estimate): as many as 2b sequences of SFT.
    sequences = candidate_config(compose_config([*TINY_LLAMA, f"strategy={shape.strategy}"]),
                                 dataclasses.replace(shape, microbatch_size=2 * shape.microbatch_size))
    assert microbatch_rows(pairs) == microbatch_rows(sequences) == 4
    assert model.estimate_host_bytes(pairs, 10**6, "cuda") == model.estimate_host_bytes(sequences, 10**6, "cuda")
    assert model.step_cost(pairs, facts, profile).step_s == pytest.approx(
        model.step_cost(doubled, _as_sequences(facts), profile).step_s, rel=1e-12)


@pytest.mark.parametrize("strategy", [pytest.param("baseline", marks=SLOW), "l2l"])  # 2 to 3 s each
def test_the_dry_run_of_dpo_agrees_with_its_closed_form_and_holds_twice_the_stash(strategy):
    """As for SFT (within 10 %): the dry run runs 2b rows a micro-batch of b pairs, and the
    closed form counts as many; a relay's stash of b pairs is that of 2b sequences."""
    keys = [f"strategy={strategy}", "strategy.microbatch_size=4", "strategy.num_microbatches=2"]
    pairs, sequences = compose_config([*DPO, *keys]), compose_config([*TINY_LLAMA, *keys])
    simulated = simulate(pairs, steps=2).per_process[0]
    closed = strategy_class(strategy).cost_model.device_bytes(pairs, ModelFacts.of(pairs))
    assert 0.9 <= closed / simulated.peak_bytes <= 1.1, closed / simulated.peak_bytes
    if strategy == "l2l":
        assert simulated.by_kind["stash"] == 2 * simulate(sequences, steps=2).per_process[0].by_kind["stash"] > 0


def test_the_reference_pass_s_closed_form_is_what_the_pass_holds():
    """The pass itself on the CPU, every tensor it makes followed (the model's weights were made
    before): a group's hidden states and the head's logits and their fp32 log-softmax, within 2 %
    (left out: the rotary tables and masks each micro-batch's blocks share, small beside a head
    whose vocabulary is a hundred times the width, as a decoder's is)."""
    cfg = compose_config([*DPO, "data.seq_len=32", "data.num_samples=16", "model.vocab_size=4096"])
    chosen = choose(cfg)
    model = build_model(cfg.model, objective=chosen.objective, family=chosen.family)
    train, _ = build_datasets(cfg, None, chosen.source, chosen.objective, chosen.family)
    assert train.rows_per_item == 2 and len(train) == 16  # generated pairs: two rows an item
    tracker = DeviceMemory(torch.device("cpu"))
    with torch.no_grad(), tracker:
        logps = streamed_logps(model, train, 2, 8, torch.device("cpu"))
    assert logps.shape == (32,)
    facts = ModelFacts.of(cfg)
    closed = hidden_bytes(facts, 8) + max(block_forward_bytes(facts, 2), head_forward_bytes(facts, 2))
    assert closed == pytest.approx(tracker.peak, rel=0.02)
    parts = max(facts.built_part_bytes(part) for part in range(3))
    assert reference_cost(facts, from_spec(H100, cfg, [4]), 2, 8).device_bytes == parts + closed


def test_the_planner_prices_the_reference_pass_and_holds_it_against_the_card_and_the_host():
    """A candidate of objective=dpo carries its reference pass: once before training, the model as
    built on the host (fp32), its seconds a pair; a pass over the card's memory does not fit."""
    base = compose_config([*DPO, "strategy=l2l", "plan.device=h100_80gb"])
    facts, shape = ModelFacts.of(base), Shape("l2l", 2, 4, recompute="always")
    profile = from_spec(H100, base, [4])
    asked = Request(1, 80 * GiB, 8, "h100_80gb", ("l2l",), 1, None, 16, rows_per_item=2, needs_reference=True)
    c = check_candidate(shape, base, facts, profile, asked, None)
    assert c.reference is not None and c.reference.host_bytes == facts.build_peak_bytes(compact_base=False)
    assert c.reference.group == 8 and c.reference.seconds(16) == pytest.approx(16 * c.reference.seconds_per_item)
    assert c.tokens_per_s == pytest.approx(2 * 16 * c.samples_per_s)  # both rows of every pair
    assert c.to_json()["reference_pass"]["device_memory_gb"] == pytest.approx(c.reference.device_bytes / GiB)
    small = dataclasses.replace(asked, memory_bytes=c.reference.device_bytes / 2)
    refused = check_candidate(shape, base, facts, profile, small, None)
    assert refused.fits is False and refused.why_not.startswith("its reference pass needs")
    sft = check_candidate(shape, compose_config([*TINY_LLAMA, "strategy=l2l"]), facts, profile,
                          dataclasses.replace(asked, rows_per_item=1, needs_reference=False), None)
    assert sft.reference is None


def test_a_dpo_run_s_throughput_counts_both_rows_of_a_pair(tmp_path):
    """results.json's samples are pairs; its tokens (and metrics.csv's) are both rows' of each."""
    cfg = compose_config([*DPO, "train.steps=3", "train.untimed_steps=1", "strategy.microbatch_size=2",
                          "strategy.num_microbatches=2", "data.num_samples=16", "objective.ref_cache=false"])
    results = run(cfg, tmp_path, quiet=True)
    seq_len, pairs = cfg.data.seq_len, results["samples_per_step"]
    assert pairs == 4 and results["tokens_per_step"] == 2 * pairs * seq_len
    t = results["throughput"]
    assert t["tokens_per_s"] == pytest.approx(2 * seq_len * t["samples_per_s"])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(float(r["tokens_per_s"]) == pytest.approx(2 * seq_len * float(r["samples_per_s"])) for r in rows)
