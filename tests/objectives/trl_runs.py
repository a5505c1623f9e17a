"""TRL's trainers run on the same checkpoint, data and optimizer as a relaytrain run: the reference
the preference objectives must equal (TRL 1.16, the `dev` extra).

TRL takes the records in file order (`train_sampling_strategy=sequential`, relaytrain's
`data.shuffle=false`), a constant learning rate, no warm-up, no clipping and no weight decay
(each set the same on both sides), dropout off (TRL's default, relaytrain's objective configs),
fp32 on both sides (TRL's configs default to bf16 autocast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# relaytrain's optimizer settings, as the Trainer's arguments: SGD without momentum, AdamW with
# relaytrain's epsilon.
OPTIMIZERS = {
    "sgd": ({"optim": "sgd"}, ["optim=sgd", "optim.momentum=0.0"]),
    "adamw": ({"optim": "adamw_torch", "adam_epsilon": 1e-6}, ["optim=adamw"]),
}


@dataclass
class TrlRun:
    losses: list[float]  # per optimizer step
    figures: list[dict[str, float]]  # per step: TRL's logged figures (rewards/chosen, ...)
    weights: dict[str, torch.Tensor]  # the trained model's, by Hugging Face name


def write_pairs(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trl_dpo(checkpoint: Path, records: list[dict], out: Path, *, microbatch: int, accumulate: int, steps: int,
            lr: float, optim: str, max_length: int, adapter: Path | None = None, **dpo) -> TrlRun:
    """TRL's DPOTrainer on `records` (prompt/chosen/rejected), `steps` optimizer steps of
    `microbatch` pairs times `accumulate`; `adapter`: a peft adapter of `checkpoint` to continue
    (the reference is then the base, the adapter off); `dpo`: DPOConfig's own keys (beta, ...)."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    arguments = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=microbatch, gradient_accumulation_steps=accumulate,
        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, bf16=False, report_to=[], save_strategy="no", seed=0, max_length=max_length,
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **OPTIMIZERS[optim][0], **dpo)
    trainer = DPOTrainer(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    trained = trainer.model.merge_and_unload() if adapter is not None else trainer.model
    return TrlRun(losses=[entry["loss"] for entry in logged],
                  figures=[{k: v for k, v in entry.items() if "/" in k} for entry in logged],
                  weights={name: t.detach().clone() for name, t in trained.state_dict().items()})


# What a Trainer logs each step besides the figures of the trainer's own.
TRAINER_LOGS = ("loss", "grad_norm", "learning_rate", "epoch", "step")


def trl_cpo(checkpoint: Path, records: list[dict], out: Path, **run) -> TrlRun:
    """TRL's experimental CPOTrainer on `records` (prompt/chosen/rejected); `run`: as
    `trl_reference_free` takes it, CPOConfig's own keys (loss_type="simpo", simpo_gamma, ...) included."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return trl_reference_free(CPOTrainer, CPOConfig, checkpoint, records, out, **run)


def trl_orpo(checkpoint: Path, records: list[dict], out: Path, **run) -> TrlRun:
    """TRL's experimental ORPOTrainer on `records`; `run`: as `trl_reference_free` takes it."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return trl_reference_free(ORPOTrainer, ORPOConfig, checkpoint, records, out, **run)


@dataclass
class TrlEvaluatedRun(TrlRun):
    evaluation: dict[str, float] | None  # TRL's evaluate() of the trained model on held-out pairs, one a batch


def trl_reference_free(trainer_class, config_class, checkpoint: Path, records: list[dict], out: Path, *,
                       microbatch: int, accumulate: int, steps: int, lr: float, optim: str, max_length: int,
                       held_out: list[dict] | None = None, **config) -> TrlEvaluatedRun:
    """One of TRL's trainers without a reference (CPO, ORPO): `steps` optimizer steps of
    `microbatch` pairs times `accumulate`, every figure it logs (TRL's names) per step; then,
    given `held_out` pairs, its evaluation of them one pair a batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    arguments = config_class(
        output_dir=str(out), per_device_train_batch_size=microbatch, gradient_accumulation_steps=accumulate,
        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, bf16=False, report_to=[], save_strategy="no", seed=0, max_length=max_length,
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=False, per_device_eval_batch_size=1, **OPTIMIZERS[optim][0], **config)
    trainer = trainer_class(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                            eval_dataset=None if held_out is None else Dataset.from_list(held_out),
                            processing_class=AutoTokenizer.from_pretrained(checkpoint))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return TrlEvaluatedRun(losses=[entry["loss"] for entry in logged],
                           figures=[{k: v for k, v in entry.items() if k not in TRAINER_LOGS} for entry in logged],
                           weights={name: t.detach().clone() for name, t in trainer.model.state_dict().items()},
                           evaluation=None if held_out is None else trainer.evaluate())


def trl_kto(checkpoint: Path, records: list[dict], out: Path, **run) -> TrlRun:
    """TRL's KTOTrainer on `records` (prompt/completion/label, or pairs it unpairs), its reference
    the initial model; `run`: as `trl_reference_free` takes it (`microbatch` is also the batch its
    KL completions are cycled in), KTOConfig's own keys (beta, desirable_weight, ...) included."""
    from trl import KTOConfig, KTOTrainer

    return trl_reference_free(KTOTrainer, KTOConfig, checkpoint, records, out, **run)


def assert_equal_to_trl(results: dict, reference: TrlRun, run_dir: Path, figures: tuple[str, ...],
                        atol: float = 2e-5) -> None:
    """A relaytrain run's results.json (`results`) and saved model (`run_dir`/model) equal TRL's
    run: the loss, each of `figures` by TRL's name every step, and every trained weight."""
    import math

    import pytest
    from transformers import AutoModelForCausalLM

    assert results["loss"] == pytest.approx(reference.losses, abs=atol)
    for step, logged in enumerate(reference.figures):
        for name in figures:
            ours = results["loss_terms"][name][step]
            assert math.isclose(ours, logged[name], abs_tol=1e-4, rel_tol=1e-5), (step, name, ours, logged[name])
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    for name, tensor in reference.weights.items():
        torch.testing.assert_close(trained[name], tensor, atol=atol, rtol=1e-4, msg=name)
