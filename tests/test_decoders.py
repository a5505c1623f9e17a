"""Every strategy trains every decoder checkpoint exactly.

For each architecture of `tests/checkpoints.ARCHITECTURES` (Llama, Qwen2, Qwen3, Mistral with a
sliding window shorter than the sequence, Gemma 2 with tied embeddings and alternating sliding
and full layers, Phi-3), a tiny random checkpoint written by `save_pretrained` is trained from
`model.pretrained=DIR` alone under each strategy, and the weights the run saves must equal an
*independent* reference to float noise: the checkpoint loaded by `AutoModelForCausalLM`, its own
forward with `labels=` computing the loss, `torch.optim.AdamW` with weight decay on every
weight but the norms and biases (chosen by name here, not by relaytrain's rule), over the same
minibatches and the same learning-rate schedule. Nothing of relaytrain's layered model, its
loss or its optimizer code is on the reference's path.

Chat rows add what synthetic rows lack: padding (an attention mask with zeros, the loss on the
replies only) and packed records (no mask, positions restarting at each record). A Llama and a
Gemma 2 checkpoint resume from their step-1 checkpoints bit for bit under L2L and PipeDream-2BW.

Every strategy on the Llama checkpoint (and on GPT-2's) is a cell of tests/conformance/, held to
the same loops (`tests/conformance/references.py`); here are the other architectures. The full
matrices (every other architecture x every strategy variant, and the chat rows) are `slow`; the
default suite runs every architecture, Llama's included, under L2L, and Gemma 2's padded and
packed chat rows once each.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.records import checkpoint
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import choices, strategy_class
from tests.checkpoints import ARCHITECTURES, CORPUS, tiny_decoder
from tests.conformance.references import (  # noqa: F401  (minibatches, reference_loop: tests.models import them from here)
    assert_same_weights,
    hf_reference,
    minibatches,
    reference_loop,
)
from tests.conformance.references import hf_saved as saved

STEPS = 3
LAYERS = 4  # two pipeline stages of two chunks each (pipe_interleaved) need four blocks
# What a run adds to `model.pretrained=DIR`: sequences longer than Mistral's and Gemma 2's
# window (6), four micro-batches of two, AdamW with weight decay and a warm-up step. The rate
# moves every weight ~1e-2, a thousand times the tolerance, so a wrongly decayed norm or a wrong
# gradient shows. Adam's eps is 1e-4, not 1e-6: with 1e-6, a gradient that is nearly zero (a
# token seen once) is divided by its own size, and summing it in another order (two replicas)
# flips its sign: float noise turned into a full step.
RUN_KEYS = [
    "data.seq_len=16", "data.num_samples=128", "optim=adamw", "optim.lr=0.02", "optim.eps=1e-4",
    "optim.weight_decay=0.1", "optim.warmup_steps=1", "optim.schedule=linear", f"train.steps={STEPS}",
    "train.untimed_steps=0", "strategy.num_microbatches=4", "strategy.microbatch_size=2", "train.save_model=true",
]
# Each registered strategy as it comes, plus the variants with their own code paths: data
# parallel replicas, and the pipelines' host offload (masters and optimizer in the EPS).
VARIANTS = {name: [f"strategy={name}"] for name in choices()} | {
    "baseline_replicas": ["strategy=baseline", "strategy.replicas=2"],
    "pipe_flush_offload": ["strategy=pipe_flush", "strategy.offload=host"],
    "pipe_2bw_offload": ["strategy=pipe_2bw", "strategy.offload=host"],
}
CONFORMANCE_ARCH = "llama"  # every strategy trains it in tests/conformance/
EVERY_ARCH = ("l2l",)  # what every architecture runs in the default suite (the model code is the same under each)
# Chat rows: padded (an attention mask with zeros, the loss on replies only) or packed (no mask,
# positions restarting at each record): what synthetic rows never exercise.
CHAT_ROWS = {"padded": ["data.pack=false"], "packed": ["data.pack=true"]}
CHAT_VARIANTS = ("l2l", "pipe_flush", "pipe_2bw")
CHAT_DEFAULT = {("gemma2", "padded", "pipe_flush"), ("gemma2", "packed", "l2l")}


def matrix() -> list:
    """(architecture, variant) pairs; outside L2L they are `slow`. Llama's other variants are
    conformance cells (tests/conformance/), not repeated here."""
    return [pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if variant in EVERY_ARCH else pytest.mark.slow)
            for arch in ARCHITECTURES for variant in VARIANTS if arch != CONFORMANCE_ARCH or variant in EVERY_ARCH]


def chat_matrix() -> list:
    """(architecture, rows, variant) triples; outside `CHAT_DEFAULT` they are `slow`."""
    return [pytest.param(arch, rows, variant, id=f"{arch}-{rows}-{variant}",
                         marks=() if (arch, rows, variant) in CHAT_DEFAULT else pytest.mark.slow)
            for arch in ARCHITECTURES for rows in CHAT_ROWS for variant in CHAT_VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per architecture, made the first time a test asks for it."""
    made: dict[str, Path] = {}

    def of(arch: str) -> Path:
        if arch not in made:
            made[arch] = tiny_decoder(tmp_path_factory.mktemp(arch) / "checkpoint", arch, layers=LAYERS)
        return made[arch]

    return of


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Conversations of one or two exchanges, some with a system turn, of the corpus's words."""
    draw, words = random.Random(0), " ".join(CORPUS).split()

    def text() -> str:
        return " ".join(draw.choices(words, k=draw.randint(1, 5)))

    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with path.open("w") as f:
        for i in range(48):
            messages = [{"role": "system", "content": text()}] if i % 3 == 0 else []
            for _ in range(1 + i % 2):
                messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def decoder_cfg(pretrained: Path, variant: str, *overrides: str):
    return compose_config([f"model.pretrained={pretrained}", *VARIANTS[variant], *RUN_KEYS, *overrides])


@pytest.mark.parametrize(("arch", "variant"), matrix())
def test_every_strategy_trains_the_checkpoint_as_a_plain_hugging_face_loop(arch, variant, checkpoints, tmp_path):
    pretrained = checkpoints(arch)
    cfg = decoder_cfg(pretrained, variant)
    results = run(cfg, tmp_path / "run", table=False)
    ours = saved(tmp_path / "run")
    reference, losses = hf_reference(pretrained, cfg, strategy_class(cfg.strategy.name).capabilities.update_delay)
    assert_same_weights(ours, reference, f"{arch} under {variant}")
    start = dict(AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).named_parameters())
    assert all((p - start[key]).abs().max() > 1e-3 for key, p in ours.named_parameters()), "a weight did not train"
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight  # one tensor again once loaded
    assert tied == bool(ARCHITECTURES[arch].get("tie_word_embeddings")), arch


@pytest.mark.parametrize(("arch", "rows", "variant"), chat_matrix())
def test_padded_and_packed_chat_rows_train_as_a_plain_hugging_face_loop(arch, rows, variant, checkpoints, chat_file,
                                                                         tmp_path):
    pretrained = checkpoints(arch)
    cfg = decoder_cfg(pretrained, variant, "data=chat", f"data.path={chat_file}", "data.seq_len=64", *CHAT_ROWS[rows])
    first = minibatches(cfg)[0][0]
    if rows == "packed":
        assert first.attention_mask is None and (first.position_ids[:, 1:] == 0).any()  # records share rows
    else:
        assert first.position_ids is None and not first.attention_mask.all()  # some rows are padded
    results = run(cfg, tmp_path / "run", table=False)
    reference, losses = hf_reference(pretrained, cfg, strategy_class(cfg.strategy.name).capabilities.update_delay)
    assert_same_weights(saved(tmp_path / "run"), reference, f"{arch} under {variant}, {rows} chat rows")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)


# Gemma 2 (tied, alternating sliding and full layers) under 2BW in the default suite; the rest is `slow`:
# tests/conformance/ resumes the Llama checkpoint under every strategy already.
@pytest.mark.parametrize(("arch", "variant"), [
    pytest.param("llama", "l2l", marks=pytest.mark.slow), pytest.param("llama", "pipe_2bw", marks=pytest.mark.slow),
    pytest.param("gemma2", "l2l", marks=pytest.mark.slow), ("gemma2", "pipe_2bw")])
def test_a_decoder_resumes_from_its_step_one_checkpoint_bit_for_bit(arch, variant, checkpoints, tmp_path):
    pretrained = checkpoints(arch)
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0")
    results = run(decoder_cfg(pretrained, variant, *keys), tmp_path / "run", table=False)
    first = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 1)
    resumed = run(decoder_cfg(pretrained, variant, *keys, f"train.resume={first}"), tmp_path / "resumed", table=False)
    whole, again = dict(saved(tmp_path / "run").named_parameters()), saved(tmp_path / "resumed")
    for key, p in again.named_parameters():
        assert torch.equal(p, whole[key]), f"{arch} under {variant}: {key} differs after resuming"
    assert resumed["loss"] == results["loss"]

