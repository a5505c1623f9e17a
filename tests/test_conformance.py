"""One suite every strategy passes, taken from the registry rather than listed by hand: a new
strategy (or preset) is held to it the moment it is registered.

Each `strategy=` option appears in `relaytrain --help` and in `relaytrain plan` with a cost and
a memory figure, has a closed-form device memory within the planner's pruning factor of its dry
run's on every model family, and refuses in one line what it cannot honour. What it trains (the
weights against the plain loop or its delayed rule, evaluation, resuming bit for bit, LoRA,
replicas, host offload, on every model family) is tests/conformance/, one matrix of cells.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.model import CostModel
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.models import build_model, families
from relaytrain.planner.candidates import PRUNE_FACTOR, candidate_config
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.plan import make_plan
from relaytrain.run.compose import compose_config, validate
from relaytrain.strategies import Capabilities, Strategy, choices, register, registry, strategy_class
from relaytrain.strategies.base import StepResult
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_BERT, TINY_GPT2, TINY_LLAMA, tiny_cfg, train_plain_loop

STEPS = 2
# What each capability a strategy may lack asks for, and the override that asks for it.
ASKS = {"grad_clip": "optim.grad_clip=1.0", "fp16": "precision=amp_fp16", "cross_precision": "precision=cmp_bf16"}
# An encoder, and a Llama-layout decoder (its per-micro-batch context of masks and rotary tables,
# grouped-query attention, untied head).
FAMILIES = {"bert": TINY_BERT, "llama": TINY_LLAMA}
# Every model family, for the checks cheap enough to run on all: the two above and GPT-2 (tied head).
EVERY_FAMILY = {**FAMILIES, "gpt2": TINY_GPT2}


def conformance_cfg(name: str, *overrides: str, family: str = "bert"):
    """A tiny model of four blocks, four micro-batches of 8: every strategy's defaults fit it;
    dropout on (the models' default 0.1), which every strategy draws alike."""
    return compose_config([*EVERY_FAMILY[family], f"strategy={name}", "model.num_layers=4", f"train.steps={STEPS}",
                           "train.untimed_steps=0", "train.checkpoint_every=1", "train.keep_checkpoints=0",
                           "train.save_model=true", "data.eval_fraction=0.25", "strategy.num_microbatches=4",
                           "optim=sgd", "optim.lr=0.05", "model.dropout=0.1", *overrides])


def saved_weights(run_dir, cfg) -> torch.nn.Module:
    """The model a run saved with train.save_model, loaded back."""
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return build_model(saved.model).hf_model


def plain_reference(cfg, delay: int, device: str = "cpu") -> torch.nn.Module:
    """One process over the whole minibatch: the plain loop, or the delayed rule (2BW's, the one
    strategy whose rule differs on purpose), each replica's rows with that replica's masks; on
    `device` (where its dropout masks are drawn), returned on the CPU."""
    single = copy.deepcopy(cfg)
    replicas = strategy_class(cfg.strategy.name).replicas(cfg)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * replicas)
    return train_plain_loop(single, STEPS, delay=delay, replicas=replicas, device=device).hf_model.cpu()


@pytest.mark.parametrize("name", choices())
def test_refuses_in_one_line_what_it_cannot_honour(name, capsys):
    can = strategy_class(name).capabilities
    for capability, ask in ASKS.items():
        if getattr(can, capability):
            validate(tiny_cfg("bert", f"strategy={name}", "model.num_layers=4", ask))  # honoured: no complaint
            continue
        assert main(["train", *TINY_BERT, "model.num_layers=4", f"strategy={name}", ask]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("relaytrain: error: ") and ask.split("=")[0] in err[0], err


def test_every_strategy_is_listed_in_the_help(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in choices():
        assert name in listed


@pytest.mark.parametrize("name", registry())
def test_every_strategy_has_shapes_a_cost_and_a_closed_form_memory(name):
    """On a spec-sheet GPU profile, with no measurement: every shape the strategy offers for two
    workers has a positive predicted step and a positive closed-form device memory."""
    cls = strategy_class(name)
    base = tiny_cfg("bert", f"strategy={name}", "model.num_layers=4")
    facts = ModelFacts.of(base)
    shapes = cls.cost_model.shapes(workers=2, batch=8, num_layers=base.model.num_layers)
    assert shapes and all(s.strategy == name and s.batch == 8 and s.workers <= 2 for s in shapes)
    profile = from_spec(load_spec("v100_16gb"), base, sorted({s.microbatch_size for s in shapes}))
    for shape in shapes:
        cfg = candidate_config(base, shape)
        assert cls.cost_model.step_cost(cfg, facts, profile).step_s > 0, shape
        assert cls.cost_model.device_bytes(cfg, facts) > 0, shape


def closed_form_cases() -> list:
    """Every strategy on every family; each strategy on one family (in turn) in the default suite,
    so that it sees every strategy and every family, the rest in the slow step (~2.5 s a case)."""
    families = list(EVERY_FAMILY)
    return [pytest.param(name, family, marks=() if family == families[i % len(families)] else pytest.mark.slow)
            for i, name in enumerate(choices()) for family in families]


@pytest.mark.parametrize(("name", "family"), closed_form_cases())
def test_the_closed_form_memory_is_within_the_pruning_factor_of_the_dry_run(name, family):
    """The planner dry-runs no shape whose closed-form memory exceeds PRUNE_FACTOR budgets: a closed
    form over PRUNE_FACTOR x the simulated peak would prune shapes that fit, and one under
    1 / PRUNE_FACTOR of it would rank (and show beside the dry run) a figure that far off."""
    cfg = conformance_cfg(name, family=family)
    closed = strategy_class(name).cost_model.device_bytes(cfg, ModelFacts.of(cfg))
    simulated = simulate(cfg, steps=2).peak_bytes
    assert 1 / PRUNE_FACTOR <= closed / simulated <= PRUNE_FACTOR, (
        f"{name} on {family}: closed form {closed} B, dry run {simulated} B, ratio {closed / simulated:.3f}")


def test_the_memory_check_runs_over_every_model_family():
    assert {conformance_cfg(choices()[0], family=f).model.family for f in EVERY_FAMILY} == set(families())


@pytest.fixture(scope="module")
def plan_of_everything():
    return make_plan([*TINY_BERT, "model.num_layers=4", "train.threads=1", "plan.workers=2", "plan.batch_size=8",
                      "plan.device_memory_gb=4"])


# The slow step: the plan of every strategy takes ~18 s on 2 cores (tests/planner plans and runs
# every strategy dry in the default suite).
@pytest.mark.slow
@pytest.mark.parametrize("name", choices())
def test_every_strategy_is_planned_with_a_time_and_a_dry_run(name, plan_of_everything):
    cls, keys = strategy_class(name), tiny_cfg("bert", f"strategy={name}", "model.num_layers=4").strategy
    mine = [c for c in plan_of_everything.candidates if c.shape.strategy == cls.name]
    varied = {key for c in mine for key, _ in c.shape.options}
    wanted = cls.cost_model.shape_options(**{key: keys[key] for key in varied})  # a preset's own variant
    ours = [c for c in mine if c.shape.options == wanted]
    assert ours, f"{name} is missing from the plan"
    assert all(c.cost is not None and c.cost.step_s > 0 and c.closed_form_bytes > 0 for c in ours)
    assert any(c.memory_bytes for c in ours), f"no {name} candidate was dry-run"


def test_a_strategy_without_a_cost_model_is_refused_when_registered():
    """A strategy names its cost model once (`cost_model`); registering refuses one that names
    none, and one whose cost model leaves the planner's questions unanswered."""

    class Incomplete(Strategy):
        def step(self, minibatch, lr) -> StepResult: ...
        def evaluate(self, batches): ...
        def parameter_names(self): ...
        def state_dict(self): ...
        def load_state_dict(self, state): ...
        def weights(self): ...

    with pytest.raises(TypeError, match="names no cost model"):
        register("incomplete")(Incomplete)

    class Unanswered(CostModel):
        def host_state_bytes(self, cfg, facts) -> int:
            return 0

    class HalfPlanned(Incomplete):
        cost_model = Unanswered

    with pytest.raises(TypeError, match="device_bytes, shapes, step_cost"):
        register("incomplete")(HalfPlanned)
    assert "incomplete" not in registry()


def test_each_strategy_class_has_its_own_cost_model_bound_to_it():
    """One cost model class may serve several strategies (the pipelines'): each class gets an
    instance bound to itself, so the model asks the right class for its schedule and chunks."""
    for cls in registry().values():
        assert isinstance(cls.cost_model, CostModel) and cls.cost_model.strategy is cls
    assert strategy_class("pipe_flush").cost_model is not strategy_class("pipe_2bw").cost_model


def test_capabilities_declare_the_update_rule():
    assert Capabilities().update_delay == 0 and Capabilities(weight_versions=2).update_delay == 1
    with pytest.raises(ConfigError, match="not a known strategy"):
        strategy_class("no_such_strategy")
