"""The objective registry, and a new loss as nothing but its module, its config and its tests.

`SequenceMargin` below is registered from this test module (under its import path, which is
what `model.task` then says) and trains under every strategy to the plain loop's weights, no
strategy touched: a spawned worker imports this module by that path and finds it there.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn

from relaytrain.models import families
from relaytrain.models.layered import MicroBatch
from relaytrain.models.pretrained import checkpoint_task
from relaytrain.objectives import objective, objective_of_architecture, objectives, register_objective
from relaytrain.objectives.base import LossTerms
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.run.train import run
from relaytrain.strategies import choices, strategy_class
from relaytrain.utils.errors import ConfigError
from tests.test_conformance import conformance_cfg, plain_reference, saved_weights


@register_objective
class SequenceMargin(CausalLM):
    """A preference-style loss on a causal LM's head: per sequence, the mean log-likelihood
    margin of each labelled token over a rejected one (the next id), -log sigmoid(beta * margin).
    Its items are sequences, not tokens: the minibatch's mean is over sequences."""

    beta = 2.0

    def loss(self, logits: torch.Tensor, mb) -> LossTerms:
        logprobs = self.predictions(logits).float().log_softmax(-1)
        targets = self.targets(mb.labels)
        valid = targets != -100
        chosen = targets.clamp(min=0).unsqueeze(-1)
        rejected = (chosen + 1) % logprobs.shape[-1]
        margin = (logprobs.gather(-1, chosen) - logprobs.gather(-1, rejected)).squeeze(-1)
        per_sequence = (margin * valid).sum(-1) / valid.sum(-1).clamp(min=1)
        return LossTerms((-nn.functional.logsigmoid(self.beta * per_sequence) * valid.any(-1)).sum())

    def items(self, mb) -> int:
        return int((self.targets(mb.labels) != -100).any(-1).sum())


MARGIN = SequenceMargin.name  # its import path: tests.objectives.test_objectives:SequenceMargin


# --------------------------------------------------------------------------- the registry


def test_the_built_in_objectives_answer_what_the_program_asks():
    classification, masked, causal = (objective(name) for name in ("classification", "masked_lm", "causal_lm"))
    assert classification.classifies and not causal.classifies and not masked.classifies
    assert causal.predicts_next_token and not masked.predicts_next_token and masked.masks_tokens
    assert (classification.metric, masked.metric, causal.metric) == ("accuracy", "accuracy", "perplexity")
    assert objective_of_architecture("LlamaForCausalLM") is causal
    assert objective_of_architecture("BertForPreTraining") is masked
    assert objective_of_architecture("BertModel") is None


def test_an_unknown_objective_is_one_line_naming_those_there_are():
    with pytest.raises(ConfigError) as err:
        objective("ranking")
    message = str(err.value)
    assert "\n" not in message and "model.task=ranking" in message
    assert all(name in message for name in ("classification", "masked_lm", "causal_lm"))
    with pytest.raises(ConfigError, match="cannot import"):
        objective("tests.objectives.no_such_module:Nothing")


def test_a_registered_objective_is_found_by_its_import_path_and_trained_by_the_families_of_its_head():
    assert MARGIN == f"{__name__}:SequenceMargin" and objective(MARGIN) is objectives()[MARGIN]
    trains = {name for name, family in families().items() if family.trains(objective(MARGIN))}
    assert trains == {name for name, family in families().items() if family.trains(objective("causal_lm"))}
    # A checkpoint's causal-LM head still maps to the built-in, not to an objective inheriting its head.
    assert objective_of_architecture("GPT2LMHeadModel").name == "causal_lm"


def _name_in_a_fresh_process(path: str, answer) -> None:
    answer.put(type(objective(path)).__qualname__)


@pytest.mark.slow  # about 10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_spawned_worker_finds_an_objective_registered_outside_relaytrain():
    """Pipelines and replicas spawn their workers: a fresh interpreter, which knows the objective
    only by the name the config carries."""
    context = multiprocessing.get_context("spawn")
    answer = context.Queue()
    worker = context.Process(target=_name_in_a_fresh_process, args=(MARGIN, answer))
    worker.start()
    worker.join(240)  # a bound that only catches a hang: a fresh interpreter on a loaded machine takes its time
    assert worker.exitcode == 0 and answer.get(timeout=5) == "SequenceMargin"


def test_the_margin_is_not_cross_entropy_and_its_items_are_sequences():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 5, 11, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    labels[2] = -100  # a padding row: no item
    mb = MicroBatch(labels.clamp(min=0), labels)
    margin, causal = objective(MARGIN), objective("causal_lm")
    assert margin.items(mb) == 2 and causal.items(mb) == 8
    assert not torch.allclose(margin.loss(logits, mb).total, causal.loss(logits, mb).total)
    assert margin.loss(logits, mb).total.dtype == torch.float32


# --------------------------------------------------------------------------- every strategy trains it


def strategy_cases() -> list:
    """Every strategy: l2l (one process) and pipe_flush (a spawned process per stage) by default,
    the rest `slow` (each spawns processes: several seconds a strategy)."""
    default = {"l2l", "pipe_flush"}
    return [pytest.param(name, marks=() if name in default else pytest.mark.slow) for name in choices()]


@pytest.mark.parametrize("name", strategy_cases())
def test_a_new_objective_trains_under_every_strategy_to_the_plain_loops_weights(name, tmp_path):
    cfg = conformance_cfg(name, f"model.task={MARGIN}", family="llama")
    results = run(cfg, tmp_path / "run")
    ours = saved_weights(tmp_path / "run", cfg)
    reference = plain_reference(cfg, strategy_class(name).capabilities.update_delay)
    for (key, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=key)
    assert torch.isfinite(torch.tensor(results["loss"])).all()


def test_a_checkpoints_head_still_names_a_built_in_objective():
    class Config:
        architectures = ["Qwen3ForCausalLM"]

    assert checkpoint_task(Config()) == "causal_lm"
