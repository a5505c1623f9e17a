"""The four pipelines train a mixture of experts with the router's balancing loss, exactly.

A micro-batch's routing sums travel forward with its activations to the last stage, which
computes Hugging Face's load-balancing term; the fractions and the loss's scale travel back with
the gradients, so each stage's routed blocks add their own share (`strategies/pipeline/routing.py`).
Tiny Qwen3-MoE (a dense layer among routed ones) and Qwen2-MoE (a shared expert) checkpoints,
`output_router_logits` on with a coefficient of 0.5 (the term is a third of the loss): a run ends
with the weights of the plain Hugging Face loop `tests/models/test_moe.py` checks the other
strategies against (2BW: its delayed rule), reports the term beside the loss, ends with the
baseline's weights with dropout on. LoRA on the fused experts under pipe_flush is one of
tests/models/test_moe.py's adapter cells.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import tiny_moe
from tests.conformance.references import (
    assert_same_weights,
    decay_groups,
    plain_loop,
    update_delay,
)
from tests.conformance.references import hf_saved as saved
from tests.models.test_moe import RUN_KEYS, hf_moe_reference, moe_loop

LAYERS = 4  # two stages of two chunks (pipe_interleaved) need four blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def of(arch: str):
        if arch not in made:
            made[arch] = tiny_moe(tmp_path_factory.mktemp(arch) / "checkpoint", arch, layers=LAYERS)
        return made[arch]

    return of


class Delayed:
    """PipeDream-2BW's rule around an optimizer of `model`: `moe_loop` takes each minibatch's
    gradients at `stale`, the weights one update older, W(b+1) = W(b) - step(grad f_b(W(max(b-1, 0))))."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, stale: torch.nn.Module):
        self.optimizer, self.model, self.stale = optimizer, model, stale
        self.param_groups = optimizer.param_groups

    def step(self) -> None:
        previous = copy.deepcopy(self.model.state_dict())
        for p, q in zip(self.model.parameters(), self.stale.parameters(), strict=True):
            p.grad, q.grad = q.grad, None
        self.optimizer.step()
        self.stale.load_state_dict(previous)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def reference(pretrained, cfg) -> tuple[torch.nn.Module, list[float], list[float]]:
    """The plain Hugging Face loop the other strategies' mixture tests use (2BW: its delayed rule);
    the model, each step's loss and each step's `router_aux_loss_coef * aux`."""
    if not update_delay(cfg):
        return hf_moe_reference(pretrained, cfg)
    o = cfg.optim
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, output_router_logits=True)
    stale = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(decay_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return model, *moe_loop(stale, Delayed(optimizer, model, stale), cfg)


PIPELINES = {"pipe_flush": ["strategy=pipe_flush"], "pipe_2bw": ["strategy=pipe_2bw"],
             "pipe_gpipe": ["strategy=pipe_gpipe"], "pipe_interleaved": ["strategy=pipe_interleaved", "strategy.chunks=2"]}
# Around them: a recomputed stage makes its tally again inside the backward; replicas each route
# their own rows; message-driven execution reorders forwards and backwards; host offload computes
# with copies of the stage (as 2BW's second version is), whose head reports the term.
VARIANTS = {**PIPELINES, "pipe_gpipe_recompute_stage": ["strategy=pipe_gpipe", "strategy.recompute=stage"],
            "pipe_flush_replicas": ["strategy=pipe_flush", "strategy.replicas=2"],
            "pipe_gpipe_message_driven": ["strategy=pipe_gpipe", "strategy.execution=message_driven"],
            "pipe_flush_offload": ["strategy=pipe_flush", "strategy.offload=host", "strategy.recompute=block"]}
DEFAULT = {("qwen3_moe", "pipe_flush"), ("qwen2_moe", "pipe_flush")}


def matrix() -> list:
    cells = [(arch, pipeline) for arch in ("qwen3_moe", "qwen2_moe") for pipeline in PIPELINES]
    cells += [("qwen3_moe", variant) for variant in VARIANTS if variant not in PIPELINES]
    return [pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if (arch, variant) in DEFAULT else pytest.mark.slow)
            for arch, variant in cells]


@pytest.mark.parametrize(("arch", "variant"), matrix())
def test_a_pipeline_trains_the_balancing_loss_as_a_plain_hugging_face_loop(arch, variant, checkpoints, tmp_path):
    pretrained = checkpoints(arch)
    cfg = compose_config([f"model.pretrained={pretrained}", *VARIANTS[variant], *RUN_KEYS])
    results = run(cfg, tmp_path / "run", table=False)
    model, losses, terms = reference(pretrained, cfg)
    assert_same_weights(saved(tmp_path / "run"), model, f"{arch} under {variant} with the balancing loss")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert min(terms) > 0.1 * min(losses)  # the term is a real part of the loss: a wrong one shows
    assert results["loss_terms"]["router_aux"] == pytest.approx(terms, rel=1e-5)  # beside the loss


@pytest.mark.parametrize("pipeline", ["pipe_flush", *(pytest.param(p, marks=pytest.mark.slow) for p in PIPELINES
                                                      if p != "pipe_flush")])
def test_with_dropout_a_pipeline_ends_with_the_baselines_weights(pipeline, checkpoints, tmp_path):
    dropout = "model.dropout=0.1"
    keys = [f"model.pretrained={checkpoints('qwen3_moe')}", *PIPELINES[pipeline], *RUN_KEYS, dropout]
    cfg = resolve(compose_config(keys), [dropout])
    run(cfg, tmp_path / "run", table=False)
    baseline = plain_loop(cfg)  # one process, each micro-batch's masks keyed as every strategy keys them (2BW: delayed)
    assert_same_weights(saved(tmp_path / "run"), baseline, f"{pipeline} with dropout and the balancing loss")
    still, _, _ = hf_moe_reference(checkpoints("qwen3_moe"), cfg)  # no dropout
    differ = max((p - q).abs().max() for p, q in zip(baseline.parameters(), still.parameters(), strict=True))
    assert differ > 1e-3, "the dropout drew nothing"
