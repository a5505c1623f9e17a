"""Mixtures balanced by a routing bias, not a loss: DeepSeek-V3 (Kimi K2's architecture), GLM-4.5 and
dots.llm1 train as Hugging Face computes them.

Their routers pick each token's experts by sigmoid scores plus a per-expert bias, within the best
groups of experts, and scale the chosen weights; a shared expert runs for every token and the
first layers are dense; DeepSeek-V3 attends through multi-head latent attention. The blocks run
Hugging Face's own layers, and Hugging Face adds no balancing term to these models' loss (the bias
is a buffer nudged between steps by the expert loads in DeepSeek's own training, never updated by
transformers), so the loss is the cross-entropy alone and the bias rides along unchanged. Tiny
checkpoints written by `save_pretrained`, their bias drawn (`tests.checkpoints.tiny_bias_balanced`):
the layered model's loss and every gradient equal Hugging Face's, and a run from `model.pretrained=DIR`
alone ends on the weights of a plain Hugging Face loop with torch's AdamW, weight decay and warm-up.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.commands.cli import main
from relaytrain.models import build_model, count_parameters
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import BIAS_BALANCED_ARCHITECTURES, tiny_bias_balanced
from tests.conformance.references import assert_same_weights, decay_groups
from tests.conformance.references import hf_saved as saved
from tests.models.equality import assert_layered_equals_hf, padded_batch
from tests.models.test_moe import RUN_KEYS, VARIANTS, moe_loop

BIAS = "e_score_correction_bias"
# DeepSeek-V3 under every kind of strategy (the relay in the default suite); the others once each.
MATRIX = [("deepseek_v3", "l2l"), ("deepseek_v3", "baseline"), ("deepseek_v3", "pipe_flush"),
          ("deepseek_v3", "fsdp_replicas"), ("glm4_moe", "baseline"), ("dots1", "l2l_stash_cpu")]
DEFAULT = {("deepseek_v3", "l2l")}
STRATEGIES = {**VARIANTS, "pipe_flush": ["strategy=pipe_flush"], "fsdp_replicas": ["strategy=fsdp", "strategy.replicas=2"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def of(arch: str):
        if arch not in made:
            made[arch] = tiny_bias_balanced(tmp_path_factory.mktemp(arch) / "checkpoint", arch)
        return made[arch]

    return of


@pytest.mark.parametrize("arch", list(BIAS_BALANCED_ARCHITECTURES))
def test_the_layered_loss_and_every_gradient_are_hugging_faces(arch, checkpoints):
    pretrained = checkpoints(arch)
    cfg = resolve(compose_config([f"model.pretrained={pretrained}", "model.dropout=0.0"]))
    model = build_model(cfg.model)
    reference = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    assert model.routing.layers == 2 and not model.routing.balances  # the first layer is dense; no loss term
    # The cost models' count, from the keys (model.architecture carries the latent ranks and groups)
    assert count_parameters(cfg.model) == sum(p.numel() for p in reference.parameters())
    biases = [b for name, b in reference.named_buffers() if name.endswith(BIAS)]
    assert len(biases) == 2 and all(b.abs().max() > 0.1 for b in biases)
    ids, mask, labels = padded_batch()
    assert_layered_equals_hf(model, reference, ids, mask, labels, arch)


@pytest.mark.parametrize(("arch", "variant"), [
    pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if (arch, variant) in DEFAULT else pytest.mark.slow)
    for arch, variant in MATRIX])
def test_a_strategy_trains_the_mixture_as_a_plain_hugging_face_loop(arch, variant, checkpoints, tmp_path):
    pretrained = checkpoints(arch)
    cfg = compose_config([f"model.pretrained={pretrained}", *STRATEGIES[variant], *RUN_KEYS])
    results = run(cfg, tmp_path / "run", table=False)
    o = cfg.optim
    reference = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    optimizer = torch.optim.AdamW(decay_groups(reference, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, _ = moe_loop(reference, optimizer, cfg)
    ours = saved(tmp_path / "run")
    assert_same_weights(ours, reference, f"{arch} under {variant}")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert "router_aux" not in results.get("loss_terms", {})
    start = dict(AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).named_buffers())
    for name, bias in ours.named_buffers():
        if name.endswith(BIAS):
            assert torch.equal(bias, start[name]), f"{name} changed"


def test_balancing_keys_are_refused_in_one_line(checkpoints, capsys):
    """A loss term the model does not have: refused, not added."""
    pretrained = checkpoints("deepseek_v3")
    assert main(["train", f"model.pretrained={pretrained}", "model.output_router_logits=true", "train.steps=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "relaytrain: error: model.output_router_logits / model.router_aux_loss_coef: a deepseek_v3 model balances its "
        "experts by a routing bias, with no balancing term in its loss (Hugging Face adds none); drop them"]


def test_a_fresh_one_is_refused_in_one_line_naming_what_a_checkpoint_carries(capsys):
    assert main(["train", "model.family=decoder", "model.model_type=deepseek_v3", "model.num_experts=4",
                 "model.experts_per_token=2", "train.steps=1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "latent attention" in line and "model.pretrained=DIR" in line
