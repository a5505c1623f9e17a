"""The built-in objectives: cross-entropy of the head's logits against the labels.

Classification has one label per sequence, masked LM one per masked token; a causal LM predicts
token n from the tokens before it, so its logits drop the last position and its labels the first
(Hugging Face's shift, here and nowhere else). Label -100 marks no item. A causal LM's head
and loss run over chunks of tokens where the whole sequence's logits would take more memory
(`objectives/chunked.py`, `model.loss_chunk_tokens`).
"""

from __future__ import annotations

import torch
from torch import nn

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms, Objective
from relaytrain.objectives.chunked import Chunking, chunked_head_loss, chunks_of
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats


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

    def head_loss(self, head: nn.Module, hidden: torch.Tensor, mb: Batch, chunking: Chunking) -> LossTerms:
        chunk = self.chunk_tokens(head, hidden, chunking)
        if not chunk:
            return super().head_loss(head, hidden, mb, chunking)
        x, y = self._predicting(hidden, mb)
        return LossTerms(chunked_head_loss(head, x, y, chunk, sum_cross_entropy))

    def head_eval_stats(self, head: nn.Module, hidden: torch.Tensor, mb: Batch, chunking: Chunking) -> EvalStats:
        chunk = self.chunk_tokens(head, hidden, chunking)
        if not chunk:
            return super().head_eval_stats(head, hidden, mb, chunking)
        stats = EvalStats.zeros()
        for x, y in chunks_of(chunk, *self._predicting(hidden, mb)):
            stats += EvalStats.of(head(x), y)
        return stats

    @property
    def cuts_head_into_chunks(self) -> bool:
        """This cross-entropy only: an objective deriving from it with a loss of its own (a
        per-sequence one) gets the whole logits it was written for."""
        cls = type(self)
        return cls.loss is CrossEntropy.loss and cls.predictions is CausalLM.predictions and cls.targets is CausalLM.targets

    def chunk_tokens(self, head: nn.Module, hidden: torch.Tensor, chunking: Chunking) -> int:
        """Tokens per chunk of the head and its loss for this micro-batch (0: the whole at once)."""
        if not self.cuts_head_into_chunks:
            return 0
        trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
        return chunking.tokens(hidden.shape[0] * (hidden.shape[1] - 1), trained)

    def _predicting(self, hidden: torch.Tensor, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states that predict a token and its labels, flattened: [tokens, width], [tokens]."""
        x = self.predictions(hidden)
        return x.reshape(-1, x.shape[-1]), self.targets(mb.labels).reshape(-1)
