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
