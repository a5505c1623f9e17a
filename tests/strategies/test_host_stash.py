"""`strategy.stash=host` for the baseline and FSDP (`strategies/stash.py`): with block recompute, each
block's input leaves the device after its forward and comes back before its recompute. The weights
are the plain loop's (dropout on: the recompute draws the forward's masks), the device holds no
block input apart from those in transit (the dry run), and where there is nothing to recompute
from it is refused in one line."""

from __future__ import annotations

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.strategies.stash import HostStash
from relaytrain.strategies.transfers import Transfers
from tests.conftest import TINY_LLAMA, train_plain_loop
from tests.strategies.test_fsdp import assert_same, saved_model

STEPS = 2


def _cfg(strategy: str, *overrides: str):
    return compose_config([*TINY_LLAMA, f"strategy={strategy}", f"train.steps={STEPS}", "train.untimed_steps=0",
                           "train.save_model=true", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
                           "strategy.recompute=block", "strategy.stash=host", *overrides])


def test_the_host_stash_trains_the_plain_loop_s_weights(tmp_path):
    cfg = _cfg("baseline", "model.dropout=0.1")
    run(cfg, tmp_path / "run")
    assert_same(saved_model(cfg, tmp_path / "run"), train_plain_loop(cfg, STEPS).hf_model)


@pytest.mark.slow  # two workers each: spawned, ~10 s a run
@pytest.mark.parametrize("strategy", ["fsdp", "baseline"])
def test_with_two_workers_the_host_stash_trains_the_device_stash_s_weights_bit_for_bit(strategy, tmp_path):
    """FSDP's shards (gathered, reduce-scattered) and DDP's buckets see the same gradients."""
    saved = {}
    for stash in ("device", "host"):
        cfg = _cfg(strategy, "model.dropout=0.1", "strategy.replicas=2", f"strategy.stash={stash}")
        run(cfg, tmp_path / stash)
        saved[stash] = saved_model(cfg, tmp_path / stash)
    assert_same(saved["host"], saved["device"], exact=True)


def test_each_input_comes_back_once_and_the_gradients_are_the_device_stash_s():
    """One micro-batch through three checkpointed blocks: every input is taken back by its own
    recompute, top down, and the gradients equal torch's checkpoint with the inputs kept."""
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)

    def through(stash: HostStash | None):
        hidden = x * 2
        for index, block in enumerate(blocks):
            layer = lambda h, ctx, block=block: torch.tanh(block(h))  # noqa: E731
            if stash is None:
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, {}, use_reentrant=False)
            else:
                hidden = stash.checkpoint(layer, index, hidden, {})
        params = [x, *(p for block in blocks for p in block.parameters())]
        return torch.autograd.grad(hidden.square().sum(), params)

    stash = HostStash(Transfers(torch.device("cpu")))
    ours = through(stash)
    assert not stash.entries.entries and not stash.entries.uploads  # every input went back, none left over
    for got, want in zip(ours, through(None), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("strategy", "precision", "value_bytes"), [
    ("baseline", "fp32", 4), ("fsdp", "fp32", 4),
    ("baseline", "amp_bf16", 4),  # the recompute under the dry run's autocast, as the forward ran
])
def test_the_dry_run_holds_no_block_input_on_the_device(strategy, precision, value_bytes):
    """Eight blocks of a 2,048-token micro-batch: at the top block's recompute the device stash
    still holds the seven inputs below it, the host stash only those in transit."""
    base = [*TINY_LLAMA, f"strategy={strategy}", "model.num_layers=8", "model.hidden_size=128",
            "model.intermediate_size=128", "model.max_seq_len=2048", "data.seq_len=2048", "strategy.replicas=1",
            "strategy.microbatch_size=2", "strategy.num_microbatches=1", "strategy.recompute=block",
            f"precision={precision}"]
    device = simulate(compose_config([*base, "strategy.stash=device"]), steps=1).peak_bytes
    host = simulate(compose_config([*base, "strategy.stash=host"]), steps=1).peak_bytes
    one_input = 2 * 2048 * 128 * value_bytes
    assert device - host >= 4 * one_input


@pytest.mark.parametrize("strategy", ["baseline", "fsdp"])
def test_a_host_stash_without_recompute_is_refused_in_one_line(strategy, capsys):
    assert main(["train", *TINY_LLAMA, f"strategy={strategy}", "strategy.stash=host"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "strategy.stash=host" in line and "strategy.recompute=block" in line


# --------------------------------------------------------------------------- planned


@pytest.mark.parametrize("strategy", ["baseline", "fsdp"])
def test_the_planner_tries_the_host_stash_with_block_recompute_and_counts_it(strategy):
    cls = strategy_class(strategy)
    shapes = cls.cost_model.shapes(2, 8, 4)
    stashes = {(shape.recompute, dict(shape.options).get("stash", "device")) for shape in shapes}
    assert {("none", "device"), ("block", "device"), ("block", "host")} <= stashes
    assert ("none", "host") not in stashes  # nothing to recompute from: refused, so never offered
    host_shape = next(s for s in shapes if dict(s.options).get("stash") == "host")
    assert "strategy.stash=host" in host_shape.overrides() and "strategy.recompute=block" in host_shape.overrides()

    on = {stash: _cfg(strategy, "model.num_layers=8", "strategy.replicas=1", f"strategy.stash={stash}")
          for stash in ("device", "host")}
    facts = ModelFacts.of(on["host"])
    boundary = facts.boundary_bytes(2)
    model = cls.cost_model
    # On the device: two inputs in transit instead of eight; on the host: the eight.
    assert model.device_bytes(on["device"], facts) - model.device_bytes(on["host"], facts) == 6 * boundary
    assert model.host_state_bytes(on["host"], facts) - model.host_state_bytes(on["device"], facts) == 8 * boundary
    profile = from_spec(load_spec("a100_80gb"), on["host"], [2])
    cost = model.step_cost(on["host"], facts, profile)
    assert cost.parts["stash transfers (exposed)"] >= 0
    assert "stash transfers (exposed)" not in model.step_cost(on["device"], facts, profile).parts
