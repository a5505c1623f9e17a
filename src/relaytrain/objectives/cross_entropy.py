"""The built-in objectives: cross-entropy of the head's logits against the labels.

Classification has one label per sequence, masked LM one per masked token; a causal LM predicts
token n from the tokens before it, so its logits drop the last position and its labels the first
(Hugging Face's shift, here and nowhere else). Label -100 marks no item.
"""

from __future__ import annotations

import torch
from torch import nn

from relaytrain.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms, Objective


def sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over items, in fp32 like Hugging Face's losses; -100 is ignored."""
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class CrossEntropy(Objective):
    """Summed cross-entropy over the items the labels mark; `predictions` and `targets` align
    the logits and the labels item by item (unchanged here)."""

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        return LossTerms(sum_cross_entropy(self.predictions(logits), self.targets(mb.labels)))

    def items(self, mb: Batch) -> int:
        return int((self.targets(mb.labels) != IGNORE_INDEX).sum())

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        predictions = self.predictions(logits)
        num_labels = predictions.shape[-1] if self.classifies else None  # the confusion matrix's side
        return EvalStats.of(predictions, self.targets(mb.labels), num_labels)


@register_objective
class Classification(CrossEntropy):
    name = "classification"
    classifies = True
    head = "AutoModelForSequenceClassification"
    architectures = ("ForSequenceClassification",)
    peft_task_type = "SEQ_CLS"


@register_objective
class MaskedLM(CrossEntropy):
    name = "masked_lm"
    masks_tokens = True
    head = "AutoModelForMaskedLM"
    architectures = ("ForMaskedLM", "ForPreTraining")


@register_objective
class CausalLM(CrossEntropy):
    name = "causal_lm"
    predicts_next_token = True
    metric = "perplexity"
    head = "AutoModelForCausalLM"
    architectures = ("LMHeadModel", "ForCausalLM")
    peft_task_type = "CAUSAL_LM"

    # Tokens < n predict token n, as in Hugging Face's causal LM loss.
    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :-1]

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[:, 1:]
