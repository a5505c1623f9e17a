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

The full matrices (every architecture x every strategy variant, and the chat rows) are `slow`;
the default suite runs every strategy on Llama, every architecture under L2L, and Gemma 2's padded and packed chat rows once each.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain import checkpoint
from relaytrain.compose import compose_config
from relaytrain.data import build_dataset, build_loader
from relaytrain.models.pretrained import resolve
from relaytrain.optim import lr_at
from relaytrain.strategies import choices, strategy_class
from relaytrain.train import run
from tests.checkpoints import ARCHITECTURES, CORPUS, tiny_decoder

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
DEFAULT_ARCH = "llama"
EVERY_ARCH = ("l2l",)  # what every architecture runs in the default suite (the model code is the same under each)
# Chat rows: padded (an attention mask with zeros, the loss on replies only) or packed (no mask,
# positions restarting at each record): what synthetic rows never exercise.
CHAT_ROWS = {"padded": ["data.pack=false"], "packed": ["data.pack=true"]}
CHAT_VARIANTS = ("l2l", "pipe_flush", "pipe_2bw")
CHAT_DEFAULT = {("gemma2", "padded", "pipe_flush"), ("gemma2", "packed", "l2l")}


def matrix() -> list:
    """(architecture, variant) pairs; outside the default slice they are `slow`."""
    pairs = []
    for arch in ARCHITECTURES:
        for variant in VARIANTS:
            fast = arch == DEFAULT_ARCH or variant in EVERY_ARCH
            pairs.append(pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if fast else pytest.mark.slow))
    return pairs


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


def minibatches(cfg) -> list:
    """The minibatches the run trains on, whole (every replica's rows), from relaytrain's loader."""
    cfg = resolve(cfg)
    loader = build_loader(cfg, build_dataset(cfg), replicas=strategy_class(cfg.strategy.name).replicas(cfg))
    return [next(loader) for _ in range(STEPS)]


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on every weight but the norms' and the biases (named so by Hugging Face)."""
    named = list(model.named_parameters())  # a tied weight once
    exempt = [p for name, p in named if "norm" in name or name.endswith(".bias")]
    decayed = [p for name, p in named if not ("norm" in name or name.endswith(".bias"))]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def hf_loss(model: torch.nn.Module, minibatch: list) -> torch.Tensor:
    """The minibatch's mean token loss, backpropagated micro-batch by micro-batch: Hugging Face's
    own causal LM loss summed over each micro-batch's tokens and divided by the whole minibatch's
    (`num_items_in_batch`, as the Trainer accumulates gradients)."""
    items = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in minibatch)
    total = torch.zeros(())
    for mb in minibatch:
        mask = mb.attention_mask
        if mask is None and mb.position_ids is None:  # packed rows have none: their positions keep records apart
            mask = torch.ones_like(mb.input_ids)
        # No KV cache in training; with one, Hugging Face would not look for packed records either.
        out = model(input_ids=mb.input_ids, attention_mask=mask, position_ids=mb.position_ids, labels=mb.labels,
                    num_items_in_batch=items, use_cache=False)
        out.loss.backward()
        total += out.loss.detach()
    return total


def hf_reference(pretrained: Path, cfg, delay: int = 0) -> tuple[torch.nn.Module, list[float]]:
    """The checkpoint trained by a plain Hugging Face loop; its weights and each step's loss.

    `delay=1`: PipeDream-2BW's rule, each minibatch's gradients taken at the weights one update
    older, W(b+1) = W(b) - step(grad f_b(W(max(b-1, 0))))."""
    o = cfg.optim
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    optimizer = torch.optim.AdamW(decay_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return model, reference_loop(model, optimizer, cfg, delay)


def reference_loop(model: torch.nn.Module, optimizer, cfg, delay: int = 0) -> list[float]:
    """`model` trained by `optimizer` over the run's minibatches at its learning rates, Hugging
    Face's loss backpropagated micro-batch by micro-batch; each step's loss. `delay=1`: the
    gradients taken at the weights one update older (PipeDream-2BW)."""
    model.train()
    stale = copy.deepcopy(model) if delay else model  # the weights the gradients are taken at
    versions = [copy.deepcopy(model.state_dict())] * delay
    losses = []
    for step, minibatch in enumerate(minibatches(cfg)):
        if delay:
            stale.load_state_dict(versions.pop(0))
            versions.append(copy.deepcopy(model.state_dict()))
        losses.append(float(hf_loss(stale, minibatch)))
        if delay:
            for p, q in zip(model.parameters(), stale.parameters(), strict=True):
                if p.requires_grad:
                    p.grad, q.grad = q.grad, None
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, STEPS)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def saved(run_dir: Path) -> torch.nn.Module:
    """What the run saved, as anyone would load it."""
    return AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)


def assert_same_weights(ours: torch.nn.Module, reference: torch.nn.Module, what: str) -> None:
    theirs = dict(reference.named_parameters())
    mine = dict(ours.named_parameters())
    assert mine.keys() == theirs.keys(), what
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{what} {key}: {m}")


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


# Llama's are slow: test_conformance resumes a Llama-layout decoder under every strategy already.
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "gemma2"])
@pytest.mark.parametrize("variant", ["l2l", "pipe_2bw"])
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

