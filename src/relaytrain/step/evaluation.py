"""Held-out evaluation figures, summed exactly across micro-batches, processes and strategies.

Every strategy evaluates by running its forward pass and handing the head's logits to
`EvalStats.of`, which keeps only sums: the summed loss, the number of predicted items, the
number predicted right and, for classification, the confusion matrix. Sums add up the same
whichever way the examples were split (micro-batches, replicas, pipeline stages), so every
strategy reports the figures plain transformers gives on the saved model, and the final
metrics (`metrics`) are computed once, from the totals.

Padding rows and tokens carry the label -100 and count nowhere. A mixture whose routers
balance also sums its balancing term over the evaluated micro-batches (`with_router_aux`),
reported beside the loss as `router_aux`, their mean: Hugging Face's eval-mode loss of a
micro-batch is its cross-entropy plus that term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from relaytrain.schema.row import IGNORE_INDEX

# Positions in the sums vector: a mixture's summed router terms and the micro-batches they are of
# come before the confusion matrix.
_LOSS, _ITEMS, _CORRECT, _ROUTER_AUX, _ROUTED_MICROBATCHES, _CONFUSION = range(6)

# GLUE tasks scored by something other than accuracy (the benchmark's own choice).
GLUE_METRIC = {"cola": "matthews_correlation", "mrpc": "f1", "qqp": "f1"}
METRICS = ("loss", "accuracy", "perplexity", "matthews_correlation", "f1", "router_aux")  # every figure an evaluation may report
LOWER_IS_BETTER = {"loss", "perplexity"}


def metric_names(objective, glue_task: str | None = None) -> list[str]:
    """The figures `EvalStats.metrics` reports for this objective (`relaytrain.objectives`: what
    train.keep_best may name)."""
    names = ["loss", objective.metric] if objective.evaluates_loss else [objective.metric]
    if objective.classifies and glue_task in GLUE_METRIC:
        names.append(GLUE_METRIC[glue_task])
    return names


def better(metric: str, value: float, than: float | None) -> bool:
    if than is None:
        return True
    return value < than if metric in LOWER_IS_BETTER else value > than


@dataclass
class EvalStats:
    """Sums over evaluated examples, as one float64 vector (so processes can all-reduce it)."""

    sums: torch.Tensor

    @classmethod
    def zeros(cls, num_labels: int | None = None) -> EvalStats:
        return cls(torch.zeros(_CONFUSION + (num_labels or 0) ** 2, dtype=torch.float64))

    @classmethod
    def of(cls, logits: torch.Tensor, targets: torch.Tensor, num_labels: int | None = None) -> EvalStats:
        """Sums for one micro-batch: `logits` [..., classes] aligned with `targets` [...].
        `num_labels` (classification) also counts the confusion matrix (rows: truth)."""
        logits = logits.float().reshape(-1, logits.shape[-1])
        targets = targets.reshape(-1)
        valid = targets != IGNORE_INDEX
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        predicted = logits.argmax(dim=-1)
        zero = loss.new_zeros((), dtype=torch.float64)
        head = torch.stack([loss.double(), valid.sum().double(), ((predicted == targets) & valid).sum().double(),
                            zero, zero])
        if num_labels is None:
            return cls(head.cpu())
        pairs = targets[valid] * num_labels + predicted[valid]
        confusion = torch.bincount(pairs, minlength=num_labels * num_labels).double()
        return cls(torch.cat([head, confusion]).cpu())

    def __add__(self, other: EvalStats) -> EvalStats:
        return EvalStats(self.sums + other.sums)

    def with_router_aux(self, term: float) -> EvalStats:
        """These sums with one micro-batch's router term (`router_aux_loss_coef * aux`) added."""
        sums = self.sums.clone()
        sums[_ROUTER_AUX] += term
        sums[_ROUTED_MICROBATCHES] += 1
        return EvalStats(sums)

    @property
    def items(self) -> int:
        return int(self.sums[_ITEMS])

    def confusion(self) -> torch.Tensor | None:
        size = self.sums.numel() - _CONFUSION
        if size == 0:
            return None
        labels = math.isqrt(size)
        return self.sums[_CONFUSION:].view(labels, labels)

    def metrics(self, objective, glue_task: str | None = None) -> dict:
        """The figures of a held-out evaluation: mean loss over every predicted item, and the
        objective's metric (accuracy, or perplexity), the GLUE task's own metric."""
        items = self.items
        if items == 0:
            return {"loss": None, "items": 0}
        loss = float(self.sums[_LOSS]) / items
        out = {"loss": loss, "items": items}
        routed = int(self.sums[_ROUTED_MICROBATCHES])
        if routed:
            out["router_aux"] = float(self.sums[_ROUTER_AUX]) / routed
        if objective.metric == "perplexity":
            out["perplexity"] = math.exp(min(loss, 700.0))
        else:
            out["accuracy"] = float(self.sums[_CORRECT]) / items
        confusion = self.confusion()
        metric = GLUE_METRIC.get(glue_task or "")
        if confusion is not None and metric == "matthews_correlation":
            out[metric] = matthews_correlation(confusion)
        elif confusion is not None and metric == "f1":
            out[metric] = f1_positive(confusion)
        return out


def matthews_correlation(confusion: torch.Tensor) -> float:
    """Matthews correlation of a (truth x prediction) confusion matrix, any number of classes
    (Gorodkin's R_K; the usual MCC for two). 0 when a marginal is constant, as scikit-learn."""
    c = confusion.double()
    total, correct = c.sum(), c.trace()
    truth, predicted = c.sum(dim=1), c.sum(dim=0)
    numerator = correct * total - (truth * predicted).sum()
    denominator = torch.sqrt((total**2 - (predicted**2).sum()) * (total**2 - (truth**2).sum()))
    return float(numerator / denominator) if denominator > 0 else 0.0


def f1_positive(confusion: torch.Tensor) -> float:
    """F1 of class 1 (GLUE's paraphrase tasks call 1 the positive class)."""
    tp = float(confusion[1, 1])
    fp = float(confusion[:, 1].sum()) - tp
    fn = float(confusion[1, :].sum()) - tp
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
