"""TRL's GRPOTrainer as the reference of `objective=grpo`: its own loss (`_compute_loss`) and
per-token log-probs on given completions (TRL 1.16, the `dev` extra).

TRL samples its own completions; relaytrain's are keyed, so the tests hand TRL relaytrain's (as
recorded in rollouts.jsonl, or made up) and compare what each computes from them. A trainer is
built for its settings only (a dataset of one prompt, a reward that is never called)."""

from __future__ import annotations

from pathlib import Path

import torch


def trl_trainer(model, tokenizer, out: Path, *, microbatch_rows: int, accumulate: int, generations: int,
                completion_length: int, **settings):
    """A GRPOTrainer over `model` with relaytrain's micro-batches: `microbatch_rows` completions a
    micro-batch (TRL's per-device batch), `accumulate` of them a step (steps_per_generation too),
    fp32, no dropout change; `settings`: GRPOConfig's (loss_type, beta, epsilon, ...)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=microbatch_rows,
                      gradient_accumulation_steps=accumulate, num_generations=generations,
                      max_completion_length=completion_length, report_to=[], use_cpu=True, bf16=False,
                      logging_steps=1, **settings)
    trainer = GRPOTrainer(model=model, reward_funcs=_never, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": "unused"}]))
    trainer.current_gradient_accumulation_steps = accumulate  # set by Trainer's loop, which these tests do not run
    return trainer


def _never(prompts, completions, **kwargs):
    raise AssertionError("the reference's rewards are relaytrain's, recorded")


def trl_inputs(trainer, prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor,
               tokens_in_batch: int, masked: list[bool] | None = None, old=None, ref=None) -> dict:
    """One micro-batch as TRL's `_generate_and_score_completions` hands it to `_compute_loss`:
    prompts left-padded, completions right-padded (`masked`: a truncated completion's mask off)."""
    pad = trainer.processing_class.pad_token_id
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    p_ids = torch.full((len(prompts), width_p), pad)
    p_mask = torch.zeros_like(p_ids)
    c_ids = torch.full((len(completions), width_c), pad)
    c_mask = torch.zeros_like(c_ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        p_ids[i, width_p - len(p):], p_mask[i, width_p - len(p):] = torch.tensor(p), 1
        c_ids[i, :len(c)] = torch.tensor(c)
        c_mask[i, :len(c)] = 0 if masked and masked[i] else 1
    inputs = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask,
              "advantages": advantages.float(), "num_items_in_batch": torch.tensor(float(tokens_in_batch))}
    if old is not None:
        inputs["old_per_token_logps"] = old(inputs)
    if ref is not None:
        inputs["ref_per_token_logps"] = ref(inputs)
    return inputs


def trl_scoring(trainer, model):
    """`model` patched as TRL patches its policy and reference (a fused head that returns the
    per-token log-probs at the trainer's temperature), so `trl_token_logps` can score with it."""
    from trl.trainer import grpo_trainer

    grpo_trainer.add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    return model


def trl_token_logps(trainer, model, inputs: dict) -> torch.Tensor:
    """TRL's per-token log-probs of the completions under `model` (patched: `trl_scoring`)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])
    return logps
