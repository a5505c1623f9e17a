"""Preference objectives: a pair's chosen reply against its rejected one (`objective=dpo`).

A pair is two consecutive rows of a micro-batch (`rows_per_item = 2`, made by `data=preference`):
the prompt with the chosen reply, then the prompt with the rejected one, labelled on the replies
only. Both travel in one micro-batch, so a pair's loss is local to wherever the head runs (a
pipeline's last stage) and every strategy runs them as it runs any rows.

A row's log-prob is the sum of its labelled tokens' log-probs (token n predicted from those
before, as the causal LM's cross-entropy shifts). The loss is a sum over the micro-batch's pairs
(`LossTerms.total`; "losses are sums", docs/design.md), so the minibatch's loss is the mean over
its pairs, TRL's `per_sequence_loss.mean()` accumulated over equal micro-batches. A term TRL takes
as a mean over a micro-batch's tokens (the NLL of the chosen replies, `rpo_alpha`) is a term of
the micro-batch (`LossTerms.per_microbatch`), which makes it TRL's mean over micro-batches.

The reference's log-probs are a field of the rows (`ref_logps`), computed once before training
(`relaytrain.run.reference`): TRL's `precompute_ref_log_probs`. The figures TRL logs each step
(`rewards/chosen`, ..., `logps/rejected`) are `LossTerms.figures`, means over the pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms, check_loss_type
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.utils.errors import ConfigError

# TRL's DPO figures, in its names: beta times each reply's log-ratio to the reference, how often
# the chosen one's is larger, their difference, and the policy's log-probs.
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
# What TRL's DPOTrainer offers beyond these, refused by name rather than as an unknown word.
TRL_ONLY_LOSS_TYPES = ("exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
                       "apo_down", "discopop", "sft", "sigmoid_norm")


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob of its labelled tokens, fp32 [rows], and how many tokens
    were predicted [rows] (the labelled ones after the first position)."""
    x, y = logits[:, :-1].float(), labels[:, 1:]
    labelled = y != IGNORE_INDEX
    token = torch.gather(x.log_softmax(-1), -1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labelled, token, 0.0).sum(-1), labelled.sum(-1)


@dataclass(frozen=True)
class Pairs:
    """A micro-batch's pairs: the policy's and the reference's log-probs of each reply, each
    reply's labelled tokens, and which pairs are real (a micro-batch filled up with unlabelled
    copies to its full size has pairs that count nowhere)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # labelled tokens of the chosen reply (TRL's completion_mask.sum)
    rejected_tokens: torch.Tensor
    predicted_chosen: torch.Tensor  # those predicted (after the first position): the NLL term's count
    real: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, mb: Batch) -> Pairs:
        logps, predicted = row_logps(logits, mb.labels)
        ref = mb.ref_logps if mb.ref_logps is not None else torch.zeros_like(logps)
        labelled = (mb.labels != IGNORE_INDEX).sum(-1)
        return cls(chosen=logps[0::2], rejected=logps[1::2], ref_chosen=ref[0::2].float(),
                   ref_rejected=ref[1::2].float(), chosen_tokens=labelled[0::2], rejected_tokens=labelled[1::2],
                   predicted_chosen=predicted[0::2], real=labelled[0::2] > 0)

    @property
    def count(self) -> int:
        return int(self.real.sum())

    def summed(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [pairs] summed over the real pairs."""
        return torch.where(self.real, values, 0.0).sum()


@register_objective
@dataclass(frozen=True)
class DPO(CausalLM):
    """Direct Preference Optimization (Rafailov et al. 2023), as TRL's DPOTrainer computes it:
    `loss_type` sigmoid (the paper's), ipo (length-normalised, Azar et al.), hinge (SLiC) or
    robust (label noise `label_smoothing`, Chowdhury et al.); `rpo_alpha` adds the chosen
    replies' NLL (RPO)."""

    name: ClassVar[str] = "dpo"
    metric: ClassVar[str] = "accuracy"  # held out: how often the chosen reply's reward is the larger (rewards/accuracies)
    rows_per_item: ClassVar[int] = 2
    figures: ClassVar[tuple[str, ...]] = FIGURES
    needs_reference: ClassVar[bool] = True

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None

    def configured(self, settings: dict) -> DPO:
        alpha = settings.get("rpo_alpha")
        chosen = dataclasses.replace(self, beta=float(settings["beta"]), loss_type=str(settings["loss_type"]),
                                     label_smoothing=float(settings["label_smoothing"]),
                                     rpo_alpha=None if alpha is None else float(alpha))
        chosen.check()
        return chosen

    @property
    def settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check(self) -> None:
        """Its keys, each wrong one in one line."""
        check_loss_type(self.loss_type, DPO_LOSS_TYPES, TRL_ONLY_LOSS_TYPES, "DPO")
        if not self.beta > 0:
            raise ConfigError(f"objective.beta={self.beta} must be positive (e.g. 0.1)")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "robust":
            raise ConfigError(f"objective.label_smoothing={self.label_smoothing} is robust DPO's label noise; set "
                              f"objective.loss_type=robust or drop it")
        if self.rpo_alpha is not None and not self.rpo_alpha >= 0:
            raise ConfigError(f"objective.rpo_alpha={self.rpo_alpha} must be at least 0 (or null: no NLL term)")

    def row_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return row_logps(logits, labels)[0]

    def pair_losses(self, p: Pairs) -> torch.Tensor:
        """Each pair's loss [pairs] (TRL's `per_sequence_loss`)."""
        delta = (p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected)
        if self.loss_type == "sigmoid":
            return -F.logsigmoid(self.beta * delta)
        if self.loss_type == "hinge":
            return torch.relu(1 - self.beta * delta)
        if self.loss_type == "ipo":  # per token of each reply: TRL's normalisation, which IPO's authors confirmed
            chosen = (p.chosen - p.ref_chosen) / p.chosen_tokens.clamp(min=1)
            rejected = (p.rejected - p.ref_rejected) / p.rejected_tokens.clamp(min=1)
            return (chosen - rejected - 1 / (2 * self.beta)) ** 2
        eps = self.label_smoothing  # robust
        return (-(1 - eps) * F.logsigmoid(self.beta * delta) + eps * F.logsigmoid(-self.beta * delta)) / (1 - 2 * eps)

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        p = Pairs.of(logits, mb)
        nll = 0.0
        if self.rpo_alpha is not None:  # TRL's "sft" term: the mean over the micro-batch's chosen tokens
            tokens = torch.where(p.real, p.predicted_chosen, 0).sum().clamp(min=1)
            nll = self.rpo_alpha * -p.summed(p.chosen) / tokens
        return LossTerms(p.summed(self.pair_losses(p)), nll, self.pair_figures(p))

    def pair_figures(self, p: Pairs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """TRL's figures, summed over the real pairs (detached), with their count."""
        with torch.no_grad():
            chosen, rejected = self.beta * (p.chosen - p.ref_chosen), self.beta * (p.rejected - p.ref_rejected)
            values = (chosen, rejected, (chosen > rejected).float(), chosen - rejected, p.chosen, p.rejected)
            count = p.real.sum()  # a tensor: no host sync per micro-batch (read once a step)
            return {name: (p.summed(v.detach()), count) for name, v in zip(FIGURES, values, strict=True)}

    def items(self, mb: Batch) -> int:
        return int(((mb.labels[0::2] != IGNORE_INDEX).sum(-1) > 0).sum())

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """The held-out pairs' loss sum, their count, and how many the policy ranks as the data
        does (its reward for the chosen reply above the rejected one's): `accuracy` is TRL's
        `rewards/accuracies`."""
        p = Pairs.of(logits, mb)
        figures = self.pair_figures(p)
        loss = p.summed(self.pair_losses(p)).detach().double()
        zero = loss.new_zeros(())
        accurate = figures["rewards/accuracies"][0].double()
        return EvalStats(torch.stack([loss, loss.new_tensor(float(p.count)), accurate, zero, zero]).cpu())
