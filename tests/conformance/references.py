"""What a trained cell is held to: relaytrain's own plain loop, and loops with nothing of relaytrain
on their path but its minibatches: a plain Hugging Face loop and a plain peft loop.

The plain loop (`tests.conftest.train_plain_loop`) is the whole layered model under autograd, so
it draws the strategies' keyed dropout masks; the independent loops load the checkpoint with
`AutoModelForCausalLM` (and peft), take Hugging Face's own loss and torch's AdamW with weight decay
chosen by name here: they hold relaytrain's model, loss and optimizer code to the libraries'.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.models.pretrained import resolve
from relaytrain.step.optim import lr_at
from relaytrain.strategies import strategy_class
from tests.conftest import train_plain_loop


def update_delay(cfg) -> int:
    """How many updates old the weights are that the strategy takes its gradients at (2BW: one)."""
    return strategy_class(cfg.strategy.name).capabilities.update_delay


def saved_model(run_dir: Path, cfg) -> torch.nn.Module:
    """The model a run saved with train.save_model, loaded back by relaytrain."""
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(Path(run_dir) / "model"))
    return build_model(saved.model).hf_model


def plain_loop(cfg) -> torch.nn.Module:
    """One process over the whole minibatch for `cfg.train.steps` steps: the plain loop, or the
    delayed rule (2BW's), each replica's rows with that replica's dropout masks."""
    single = copy.deepcopy(cfg)
    replicas = strategy_class(cfg.strategy.name).replicas(cfg)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * replicas)
    return train_plain_loop(single, cfg.train.steps, delay=update_delay(cfg), replicas=replicas).hf_model


# ------------------------------------------------------------------ a plain Hugging Face loop


def minibatches(cfg) -> list:
    """The minibatches the run trains on, whole (every replica's rows), from relaytrain's loader."""
    cfg = resolve(cfg)
    loader = build_loader(cfg, build_dataset(cfg), replicas=strategy_class(cfg.strategy.name).replicas(cfg))
    return [next(loader) for _ in range(cfg.train.steps)]


def exempt_from_decay(name: str) -> bool:
    """A norm's weight or a bias, as Hugging Face names them (GPT-2's norms are `ln_1`, `ln_2`, `ln_f`)."""
    return "norm" in name or ".ln_" in name or name.endswith(".bias")


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on every weight but the norms', the biases (GPT-OSS's experts' `gate_up_proj_bias`
    too) and other vectors (GPT-OSS's attention sinks)."""
    named = list(model.named_parameters())  # a tied weight once

    def undecayed(name: str, p) -> bool:
        return exempt_from_decay(name) or name.endswith("bias") or p.ndim < 2

    decayed = [p for name, p in named if not undecayed(name, p)]
    exempt = [p for name, p in named if undecayed(name, p)]
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


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """This process computes on `threads` torch threads meanwhile: a reference taken with a run's
    workers' thread count sums in their order."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


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
        for group in optimizer.param_groups:  # torchao's optimizers keep the rate a tensor
            rate = lr_at(step, cfg.optim, cfg.train.steps)
            group["lr"].fill_(rate) if torch.is_tensor(group["lr"]) else group.update(lr=rate)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def hf_saved(run_dir: Path) -> torch.nn.Module:
    """What the run saved, as anyone would load it."""
    return AutoModelForCausalLM.from_pretrained(Path(run_dir) / "model", dtype=torch.float32)


def assert_resumes_exactly(make_cfg, keys: list[str], tmp_path: Path) -> None:
    """A run checkpointed every step and the same run resumed from its step-one checkpoint end
    on the same last losses and the same weights, bit for bit. `make_cfg(*keys)`: the run's config."""
    from relaytrain.records import checkpoint
    from relaytrain.run.train import run

    keys = [*keys, "train.checkpoint_every=1", "train.keep_checkpoints=0"]
    whole = run(make_cfg(*keys), tmp_path / "whole", quiet=True)
    step_one = checkpoint.checkpoint_dir(tmp_path / "whole") / "step-00000001"
    resumed = run(make_cfg(*keys, f"train.resume={step_one}"), tmp_path / "resumed", quiet=True)
    assert resumed["loss"][-2:] == whole["loss"][-2:]
    theirs = dict(hf_saved(tmp_path / "whole").named_parameters())
    for name, p in hf_saved(tmp_path / "resumed").named_parameters():
        assert torch.equal(p, theirs[name]), name


def assert_same_weights(ours: torch.nn.Module, reference: torch.nn.Module, what: str) -> None:
    """Every parameter, by name, equal to float noise."""
    theirs = dict(reference.named_parameters())
    mine = dict(ours.named_parameters())
    assert mine.keys() == theirs.keys(), what
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{what} {key}: {m}")


def assert_same_weights_but_flipped_codes(ours: torch.nn.Module, reference: torch.nn.Module, what: str,
                                         within: float) -> None:
    """Equal to float noise (`assert_same_weights`), but for the few elements whose 8- or 4-bit
    moment code flipped: noise in the last bit (eager against compiled, another CPU's vector width)
    can move a moment across a code boundary, which moves that element's update by a fraction of
    an AdamW step. Those stay `within` (the steps' rates summed) and are at most one in a thousand;
    a wrong update rule moves every element."""
    theirs = dict(reference.named_parameters())
    flipped = total = 0
    for name, p in ours.named_parameters():
        q = theirs[name].detach()
        close = torch.isclose(p.detach(), q, atol=2e-5, rtol=1e-4)
        assert bool(((p - q).abs()[~close] <= within).all()), f"{what} {name}: a difference beyond {within}"
        flipped += int((~close).sum())
        total += p.numel()
    assert flipped <= total * 1e-3, f"{what}: {flipped} of {total} elements differ beyond float noise"


def assert_within_a_rounding(ours: torch.nn.Module, reference: torch.nn.Module, what: str,
                             noise: float = 1e-6) -> None:
    """Equal, but for the few elements where float noise in a gradient moved an update across a
    draw: those are one bf16 step apart (at most two, once one of them fed the next update). Near
    zero bf16's steps are finer than the noise an AdamW update carries wherever the weight lies
    (lr·m/(√v+eps) in fp32: of order lr·1e-4 with these tests' rates), so `noise` bounds those."""
    theirs = dict(reference.named_parameters())
    differ = total = 0
    for name, p in ours.named_parameters():
        q = theirs[name]
        step = torch.maximum(p.abs(), q.abs()).bfloat16().float() * 2 ** -7  # one bf16 step at that size
        assert bool(((p - q).abs() <= 2 * step + noise).all()), f"{what} {name}"
        differ += int((p != q).sum())
        total += p.numel()
    assert differ <= total * 1e-3, f"{what}: {differ} of {total} elements differ"


# ------------------------------------------------------------------ a plain peft loop


def gpt2_checkpoint(directory: Path) -> Path:
    """A tiny random GPT-2 (Conv1D layers, tied embeddings) saved by save_pretrained."""
    config = AutoConfig.for_model("gpt2", vocab_size=320, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # peft's loop draws its own masks
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def peft_adapter(base: Path, directory: Path) -> Path:
    """A LoRA adapter for `base` made by peft, both matrices random (non-zero), saved by peft."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gpt2 = model.config.model_type == "gpt2"
    targets = ["c_attn", "c_proj", "c_fc"] if gpt2 else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=gpt2)
    return random_adapter(model, config, directory)


def random_adapter(model, config, directory: Path) -> Path:
    """`config`'s LoRA adapter on `model`, every matrix random (non-zero), saved by peft."""
    peft_model = get_peft_model(model, config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(directory)
    return directory


def peft_reference(base: Path, adapter: Path, cfg, delay: int) -> tuple[torch.nn.Module, list[float]]:
    """The adapter trained by a plain peft loop: peft's model and loss, torch's AdamW on the
    trainable parameters (decay on matrices, as every LoRA matrix is), relaytrain's minibatches."""
    o = cfg.optim
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter,
                                      is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return model, reference_loop(model, optimizer, cfg, delay)


def adapters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if "lora_" in name}
