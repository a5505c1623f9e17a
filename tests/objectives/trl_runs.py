"""TRL's trainers run on the same checkpoint, data and optimizer as a relaytrain run: the reference
the preference objectives must equal (TRL 1.16, the `dev` extra).

TRL takes the records in file order (`train_sampling_strategy=sequential`, relaytrain's
`data.shuffle=false`), a constant learning rate, no warm-up, no clipping and no weight decay
(each set the same on both sides), dropout off (TRL's default, relaytrain's objective configs),
fp32 on both sides (TRL's configs default to bf16 autocast).
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# relaytrain's optimizer settings, as the Trainer's arguments: SGD without momentum, AdamW with
# relaytrain's epsilon.
OPTIMIZERS = {
    "sgd": ({"optim": "sgd"}, ["optim=sgd", "optim.momentum=0.0"]),
    "adamw": ({"optim": "adamw_torch", "adam_epsilon": 1e-6}, ["optim=adamw"]),
}


# The models and strategies each objective is held equal to TRL on (every pair of them): a tiny
# Llama and a tiny Qwen3-MoE; baseline, l2l, a two-stage pipe_flush and FSDP over two replicas
# (its overrides each objective's own: how two replicas split TRL's micro-batches depends on what
# the loss is a mean of).
MODELS = ("llama", "qwen3_moe")
STRATEGIES = {"baseline": ["strategy=baseline"], "l2l": ["strategy=l2l"],
              "pipe_flush": ["strategy=pipe_flush", "strategy.stages=2"]}


def strategy_matrix(fsdp: list[str], *leading, name: str = "", default: bool = True) -> list:
    """pytest params (*leading, strategy overrides, optimizer, model) of every model under every
    strategy, `fsdp` the overrides of the two-replica case, ids begun with `name`. The optimizer
    alternates, so each model trains under SGD and AdamW and two strategies share each TRL run
    (`once`); with `default`, the baseline on Llama stays in the default suite, the rest run in the
    slow step."""
    cases = []
    for i, (strategy, overrides) in enumerate([*STRATEGIES.items(), ("fsdp2", fsdp)]):
        for j, model in enumerate(MODELS):
            optim = ("sgd", "adamw")[(i + j) % 2]
            fast = default and (strategy, model) == ("baseline", "llama")
            cases.append(pytest.param(*leading, overrides, optim, model, marks=() if fast else pytest.mark.slow,
                                      id="-".join(filter(None, (name, strategy, model, optim)))))
    return cases


def once(trainer_run):
    """`trainer_run` (one of TRL's trainers run to its end) once per distinct arguments in this
    process, its output directory aside: the strategies a test file holds equal to the same TRL
    run share it (a file's tests run on one worker)."""
    runs: dict[str, object] = {}
    signature = inspect.signature(trainer_run)

    @functools.wraps(trainer_run)
    def cached(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        key = json.dumps({k: v for k, v in arguments.items() if k != "out"}, sort_keys=True, default=str)
        if key not in runs:
            runs[key] = trainer_run(*args, **kwargs)
        return runs[key]

    return cached


@dataclass
class TrlRun:
    losses: list[float]  # per optimizer step
    figures: list[dict[str, float]]  # per step: TRL's logged figures (rewards/chosen, ...)
    weights: dict[str, torch.Tensor]  # the trained model's, by Hugging Face name


def write_pairs(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@once
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


@once
def trl_cpo(checkpoint: Path, records: list[dict], out: Path, **run) -> TrlRun:
    """TRL's experimental CPOTrainer on `records` (prompt/chosen/rejected); `run`: as
    `trl_reference_free` takes it, CPOConfig's own keys (loss_type="simpo", simpo_gamma, ...) included."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return trl_reference_free(CPOTrainer, CPOConfig, checkpoint, records, out, **run)


@once
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


@once
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
