"""`relaytrain plan`: the profile, the cost models, the planner's choice against its own dry run,
the printed command, plan.json, GPU profile files, and the one-line refusal."""

from __future__ import annotations

import dataclasses
import json
import shlex
import time

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import ModelFacts, Shape
from relaytrain.cost.profile import PartTimes, Profile, Timings, load_spec, measure, spec_names
from relaytrain.planner.candidates import GiB, candidate_config
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.plan import make_plan, predict
from relaytrain.run.compose import compose_config, validate
from relaytrain.strategies import strategy_class
from relaytrain.strategies.l2l_cost import paper_step_s as l2l_paper_step_s
from relaytrain.strategies.l2l_cost import paper_transfer_overhead as l2l_transfer_overhead
from tests.conftest import TINY_BERT

TINY = [*TINY_BERT, "train.threads=1"]
BERT_LARGE = ["model=bert_large", "data.seq_len=128", "optim=lamb", "plan.device=v100_16gb"]


@pytest.fixture(scope="module")
def tiny_plan():
    """A plan for a tiny BERT on this CPU with two workers and room for everything."""
    return make_plan([*TINY, "plan.workers=2", "plan.batch_size=16", "plan.device_memory_gb=4"])


# --------------------------------------------------------------------------- the profile


def test_this_machines_profile_has_positive_times_growing_with_the_microbatch():
    cfg = compose_config(TINY)
    profile = measure(cfg, [1, 4, 16], [1], torch.device("cpu"))
    timings = profile.for_workers(1, 1)
    for part in ("block", "embed", "head"):
        for b in (1, 4, 16):
            times = timings.part(part, b)
            assert times.forward_s > 0 and times.backward_s > 0
    block = [timings.part("block", b) for b in (1, 16)]
    assert block[1].forward_s + block[1].backward_s > block[0].forward_s + block[0].backward_s
    assert timings.optimizer_block_s > 0 and timings.optimizer_ends_s > 0
    assert profile.host_to_device_bytes_per_s is None  # a CPU: nothing crosses a link
    assert profile.source.startswith("measured on this machine")


def test_shipped_gpu_profiles_say_they_are_spec_sheets_not_measurements():
    assert {"v100_16gb", "a100_40gb"} <= set(spec_names())
    for name in spec_names():
        spec = load_spec(name)
        assert spec["source"].startswith("spec sheet, not measured")
        assert "assumption" in spec["source"]


def test_a_profile_file_given_by_path_is_read_and_a_bad_one_refused_in_one_line(tmp_path, capsys):
    spec = load_spec("v100_16gb")
    (tmp_path / "mine.json").write_text(json.dumps({**spec, "name": "mine"}))
    assert load_spec(str(tmp_path / "mine.json"))["name"] == "mine"
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad"}))
    assert main(["plan", *TINY, f"plan.device={tmp_path / 'bad.json'}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lacks" in err


# --------------------------------------------------------------------------- cost models


def _synthetic_profile(forward_s: float, upload_bytes_per_s: float | None) -> Profile:
    """One micro-batch size (1): a block's forward C, backward 2C; nothing else costs time."""
    zero = PartTimes(0.0, 0.0)
    timings = Timings({1: PartTimes(forward_s, 2 * forward_s)}, {1: zero}, {1: zero}, 0.0, 0.0)
    return Profile("synthetic", "test device", "cuda", "synthetic", 8, 16 * GiB, upload_bytes_per_s,
                   1e12, 1e12, 1e12, 8, 0.0, 0.0, {0: timings})


def _bare(*overrides: str):
    """A tiny BERT's facts without embeddings or head (nothing but blocks costs time), and its config."""
    cfg = compose_config([*TINY_BERT, *overrides])
    return dataclasses.replace(ModelFacts.of(cfg), embed_params=0, head_params=0), cfg


def step_cost(shape: Shape, facts: ModelFacts, profile: Profile, cfg):
    """`shape`'s step by its strategy's cost model, on `cfg` with the shape's keys set."""
    return strategy_class(shape.strategy).cost_model.step_cost(candidate_config(cfg, shape), facts, profile)


def closed_form_bytes(shape: Shape, facts: ModelFacts, cfg) -> int:
    return strategy_class(shape.strategy).cost_model.device_bytes(candidate_config(cfg, shape), facts)


def test_l2l_without_prefetch_is_the_papers_equation_4_and_its_overhead_falls_with_u():
    facts, cfg = _bare("strategy=l2l", "strategy.prefetch=false")
    c = 0.01
    bandwidth = facts.block_params * facts.weight_bytes / c  # X = C
    profile = _synthetic_profile(c, bandwidth)
    for u in (1, 2, 4, 10):
        predicted = step_cost(Shape("l2l", 1, u), facts, profile, cfg).step_s
        assert predicted == pytest.approx(l2l_paper_step_s(facts.num_layers, u, c, c), rel=1e-9)
    overheads = [l2l_transfer_overhead(u, c, c) for u in (1, 2, 4, 10, 100)]
    assert overheads == sorted(overheads, reverse=True)
    assert overheads[0] == pytest.approx(c / (2 * c + c))  # u = 1: X / (2C + X)
    assert overheads[3] < 0.05  # the paper: X = C, u = 10 leaves under 10 %
    assert l2l_transfer_overhead(10**6, c, c) < 1e-5 and l2l_transfer_overhead(1, 0.0, c) == 1.0


def test_l2l_prefetch_hides_transfers_behind_compute():
    facts, cfg = _bare("strategy=l2l")
    c = 0.01
    profile = _synthetic_profile(c, facts.block_params * facts.weight_bytes / c)
    with_prefetch = step_cost(Shape("l2l", 1, 4), facts, profile, cfg).step_s
    assert with_prefetch == pytest.approx(facts.num_layers * 4 * 4 * c)  # transfers fully hidden at u = 4
    assert with_prefetch < l2l_paper_step_s(facts.num_layers, 4, c, c)


def test_deeper_pipelines_hold_less_per_stage_and_2bw_is_at_least_as_fast_as_flush():
    cfg = compose_config([*BERT_LARGE[:3], "strategy=pipe_flush"])
    facts = ModelFacts.of(cfg)
    memory = [closed_form_bytes(Shape("pipe_flush", 4, 8, 1, d, "stage"), facts, cfg) for d in (2, 4, 8)]
    assert memory == sorted(memory, reverse=True) and memory[0] > memory[2]
    profile = from_v100(cfg, [4])
    for d, m in ((2, 2), (4, 4), (4, 16)):
        flush = step_cost(Shape("pipe_flush", 4, m, 2, d), facts, profile, cfg).step_s
        twobw = step_cost(Shape("pipe_2bw", 4, m, 2, d), facts, profile, cfg).step_s
        assert twobw <= flush
    # the flush's bubble is (d - 1) / (m + d - 1) of the pipeline for equal stages
    cost = step_cost(Shape("pipe_flush", 4, 8, 1, 4), facts, profile, cfg)
    assert cost.parts["bubble"] / (cost.parts["bubble"] + cost.parts["compute"]) == pytest.approx(3 / 11, rel=0.05)


def test_l2l_with_the_stash_on_the_host_is_predicted_exactly_as_its_preset():
    """One rule decides where the stash lives (`stash.stash_on_host`): the preset and the key are one
    run, predicted alike on a GPU profile, and the stash's transfers are what sets them apart."""
    spelled = [compose_config([*BERT_LARGE[:3], *keys]) for keys in (["strategy=l2l", "strategy.stash=host"],
                                                                      ["strategy=l2l_stash_cpu"],
                                                                      ["strategy=l2l"])]
    facts = ModelFacts.of(spelled[0])
    profile = from_v100(spelled[0], [spelled[0].strategy.microbatch_size])
    l2l = strategy_class("l2l_stash_cpu").cost_model
    on_host, preset, on_device = (l2l.step_cost(cfg, facts, profile) for cfg in spelled)
    assert on_host == preset and on_host.step_s >= on_device.step_s  # prefetch may hide the stash
    assert on_host.parts["transfers"] > on_device.parts["transfers"]
    assert l2l.device_bytes(spelled[0], facts) == l2l.device_bytes(spelled[1], facts) < l2l.device_bytes(spelled[2], facts)
    assert l2l.host_state_bytes(spelled[0], facts) == l2l.host_state_bytes(spelled[1], facts)


def from_v100(cfg, sizes):
    from relaytrain.cost.profile import from_spec

    return from_spec(load_spec("v100_16gb"), cfg, sizes)


# --------------------------------------------------------------------------- the planner


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_the_chosen_configuration_fits_by_its_own_dry_run(tiny_plan):
    best = tiny_plan.best
    assert best is not None and best.fits
    assert best.simulated_bytes <= tiny_plan.request.memory_bytes
    again = simulate(candidate_config(compose_config([*TINY, f"strategy={best.shape.strategy}"]), best.shape))
    assert again.peak_bytes == best.simulated_bytes
    decided = [c for c in tiny_plan.candidates if c.fits is not None and c.cost is not None]
    assert all(best.cost.step_s <= c.cost.step_s for c in decided if c.fits)


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_tight_budget_is_respected_by_the_dry_run():
    loose = make_plan([*TINY, "plan.batch_size=16", "plan.strategies=[baseline]", "plan.device_memory_gb=4"])
    sizes = sorted(c.simulated_bytes for c in loose.candidates if c.simulated_bytes)
    budget_gb = (sizes[0] + 1) / GiB  # the smallest dry run fits, barely
    tight = make_plan([*TINY, "plan.batch_size=16", "plan.strategies=[baseline]", f"plan.device_memory_gb={budget_gb}"])
    assert tight.best is not None and tight.best.simulated_bytes <= budget_gb * GiB


def test_the_printed_command_composes_and_validates(tiny_plan):
    args = shlex.split(tiny_plan.command(tiny_plan.best))
    assert args[:2] == ["relaytrain", "train"]
    cfg = compose_config(args[2:])
    validate(cfg)
    s = cfg.strategy
    assert s.name == tiny_plan.best.shape.strategy
    assert s.microbatch_size * s.num_microbatches * getattr(s, "replicas", 1) == 16
    assert cfg.model.hidden_size == 32  # the model overrides travel with it


def test_plan_command_writes_plan_json_and_prints_the_table(tmp_path, capsys):
    assert main(["plan", *TINY, "plan.workers=2", "plan.batch_size=8", "plan.strategies=[baseline,pipe_2bw,l2l]",
                 "strategy=l2l", "strategy.stash=host", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "relaytrain plan" in out and "run it: relaytrain train" in out and "predicted" in out
    assert "ignored (the planner decides these): strategy=l2l strategy.stash=host" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    best = plan["best"]
    assert best["command"].startswith("relaytrain train ") and "strategy.stash" not in best["command"]
    assert set(best["predicted"]) == {"step_time_s", "samples_per_s", "tokens_per_s", "device_memory_gb"}
    assert best["predicted"]["tokens_per_s"] == pytest.approx(16 * best["predicted"]["samples_per_s"])  # seq 16
    assert best["reference_pass"] is None  # SFT: no reference
    assert best["predicted"]["step_time_s"] > 0 and best["predicted"]["device_memory_gb"] > 0
    assert {c["strategy"] for c in plan["candidates"]} == {"baseline", "pipe_2bw", "l2l"}
    for c in plan["candidates"]:
        assert {"microbatch_size", "num_microbatches", "replicas", "stages", "recompute", "predicted",
                "closed_form_memory_gb", "simulated_memory_gb", "fits", "why_not"} <= set(c)
        assert c["microbatch_size"] * c["num_microbatches"] * c["replicas"] == 8
    assert plan["profile"]["source"].startswith("measured on this machine")
    assert plan["request"]["workers"] == 2


def test_the_printed_command_keeps_a_list_value_as_given(tmp_path, capsys):
    """The command printed is plan.json's, brackets and all (rich read `[q_proj,v_proj]` as a markup
    tag and printed `adapter.target_modules=`, which trains every linear layer instead)."""
    assert main(["plan", "model=llama_tiny", "adapter=lora", "adapter.target_modules=[q_proj,v_proj]",
                 "plan.workers=1", "plan.device=h100_80gb", "--out", str(tmp_path)]) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run it: "))
    command = json.loads((tmp_path / "plan.json").read_text())["best"]["command"]
    assert printed == f"run it: {command}" and "'adapter.target_modules=[q_proj,v_proj]'" in command


def test_an_infeasible_request_says_so_in_one_line_and_exits_2(tmp_path, capsys):
    code = main(["plan", *TINY, "plan.batch_size=8", "plan.device_memory_gb=0.0001", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relaytrain: error: nothing fits 1 x 0.0001 GiB")
    assert "GiB" in lines[0] and "plan.json" in lines[0]


def test_help_prints_the_usage(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: relaytrain plan" in out and "v100_16gb" in out


def test_bad_plan_keys_are_refused_in_one_line(tmp_path, capsys):
    assert main(["plan", *TINY, "plan.strategies=[l2k]", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean strategy=l2l" in err


def test_predict_gives_the_cost_models_step_for_one_config():
    cfg = compose_config([*TINY, "strategy=l2l", "strategy.microbatch_size=4", "strategy.num_microbatches=2"])
    prediction = predict(cfg)
    assert prediction.step_time_s > 0
    assert prediction.samples_per_s == pytest.approx(8 / prediction.step_time_s)
    assert prediction.device_memory_bytes is None  # a CPU has no separate device memory


# --------------------------------------------------------------------------- GPU profiles, BERT-Large


@pytest.mark.slow  # over 8 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_gpu_profile_predicts_from_flops_without_timing_this_machine():
    plan = make_plan(["model=bert_large", "model.num_layers=4", "data.seq_len=128", "plan.device=a100_40gb",
                      "plan.workers=2", "plan.batch_size=16"], max_simulations=6)
    assert plan.profile.source.startswith("spec sheet, not measured") and plan.profile.name == "a100_40gb"
    assert plan.request.memory_bytes == 40 * GiB
    spec = load_spec("a100_40gb")
    block = plan.profile.for_workers(2).part("block", 8)
    flops = 8 * 128 * (2 * (4 * 1024**2 + 2 * 1024 * 4096) + 4 * 128 * 1024)
    filled = 8 * 128 / (8 * 128 + spec["tokens_half_efficiency"])
    rate = spec["peak_tflops"]["fp32"] * 1e12 * spec["compute_efficiency"]["fp32"] * filled
    assert block.forward_s == pytest.approx(flops / rate + spec["kernel_overhead_s_per_block"])
    assert block.backward_s == pytest.approx(2 * block.forward_s)
    assert plan.best is not None and plan.best.simulated_bytes <= 40 * GiB


@pytest.mark.slow  # dry runs of BERT-Large on 8 workers: about a minute on 2 cores
def test_bert_large_on_eight_16gb_v100s_fits_by_its_dry_run():
    plan = make_plan([*BERT_LARGE, "plan.workers=8", "plan.batch_size=64", "plan.strategies=[pipe_2bw,pipe_flush,l2l]"],
                     max_simulations=3)
    best = plan.best
    assert plan.profile.source.startswith("spec sheet, not measured")
    assert plan.request.memory_bytes == 16 * GiB  # the profile's memory when plan.device_memory_gb is not given
    assert best is not None and best.shape.workers > 1
    assert best.simulated_bytes <= 16 * GiB
    assert {c.shape.workers for c in plan.candidates if c.shape.strategy != "l2l"} == {8}


@pytest.mark.slow  # dry runs of 24- and 48-layer BERT-Large: about a minute on 2 cores
def test_bert_large_on_one_16gb_v100_fits_and_twice_as_deep_only_l2l_does():
    one = make_plan([*BERT_LARGE, "plan.workers=1", "plan.batch_size=32"], max_simulations=4)
    assert not [c for c in one.candidates if c.shape.strategy.startswith("pipe")]  # one worker: no pipeline
    assert one.best is not None and one.best.simulated_bytes <= 16 * GiB
    # The L2L paper's Table 4: at 48 layers the baseline no longer fits a 16 GB V100, L2L does.
    deep = make_plan([*BERT_LARGE, "plan.workers=1", "plan.batch_size=8", "model.num_layers=48"], max_simulations=4)
    assert deep.best is not None and deep.best.shape.strategy.startswith("l2l")
    baseline = [c for c in deep.candidates if c.shape.strategy == "baseline"]
    assert any(c.simulated_bytes for c in baseline)
    assert not any(c.fits for c in baseline)


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_plan_writes_where_hydra_run_dir_says(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["plan", *TINY, "plan.workers=1", "plan.batch_size=8", "plan.strategies=[baseline]"]
    assert main([*args, "hydra.run.dir=mine/${now:%Y}"]) == 0
    assert "ignored" not in capsys.readouterr().out  # consumed, not ignored
    assert (tmp_path / "mine" / time.strftime("%Y") / "plan.json").is_file()
    assert main([*args, "hydra.run.dir=mine", "--out", "theirs"]) == 0  # --out, said on the command line, wins
    assert (tmp_path / "theirs" / "plan.json").is_file()
