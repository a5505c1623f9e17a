"""Kahneman-Tversky Optimization on unpaired examples (`objective=kto`), as TRL 1.16's KTOTrainer
computes it.

An example is a prompt, one completion and a label (desirable or not), unpaired: no rejected
reply to compare with. KTO compares each example's log-ratio to the reference with a reference
point, the KL divergence of the policy from the reference, estimated on mismatched examples: each
prompt with the completion of its neighbour in the micro-batch (TRL's "KL completions", cycled by
one within each batch of `per_device_train_batch_size`). So an item is two consecutive rows
(`rows_per_item = 2`, made by `data=preference`): the example, then its KL row; both travel in one
micro-batch and every strategy runs them as it runs any rows. The rows carry the example's label
(the row field `desirable`).

Per micro-batch, as TRL: the KL estimate is the mean over its items of the KL rows' log-ratios,
detached and clamped at 0; a desirable example's loss is `1 - sigmoid(beta * (log-ratio - KL))`
times `desirable_weight`, an undesirable one's `1 - sigmoid(beta * (KL - log-ratio))` times
`undesirable_weight`. TRL takes their mean over the micro-batch, then over the step's micro-batches;
here the loss is their sum (`LossTerms.total`, "losses are sums"), over the step's items, the same
mean for micro-batches of equal size (a training step's always are). With replicas, each replica's
micro-batch estimates its own KL, as TRL's micro-batches of gradient accumulation do on one process
(TRL on several processes averages it over them).

The figures TRL logs each step are means over its micro-batches of each micro-batch's own mean
(`rewards/chosen` over the desirable examples, `kl`, ...), each present where the micro-batch had
what it is a mean of: so each is reported as (that mean, 1) per micro-batch (`LossTerms.figures`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.objectives.preference import row_logps
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.utils.errors import ConfigError

# TRL's KTO figures, in its names: the KL estimate, beta times each kind of example's log-ratio,
# their difference, the policy's log-probs and its mean logit on the completions.
FIGURES = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected")
KTO_LOSS_TYPES = ("kto",)
# What TRL's KTOTrainer offers beyond it (a loss without the KL term), refused by name.
TRL_ONLY_LOSS_TYPES = ("apo_zero_unpaired",)


@dataclass(frozen=True)
class Examples:
    """A micro-batch's items: the policy's and the reference's log-probs of each example and of its
    KL row, each example's label, its completion's mean logit sum and tokens, and which items are
    real (a micro-batch filled up with unlabelled copies has items that count nowhere)."""

    logps: torch.Tensor
    ref: torch.Tensor
    kl_logps: torch.Tensor
    kl_ref: torch.Tensor
    desirable: torch.Tensor  # bool, real items only
    undesirable: torch.Tensor
    logit_sums: torch.Tensor  # the example's mean-over-vocabulary logits summed over its predicted tokens
    predicted: torch.Tensor  # those tokens
    real: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, mb: Batch) -> Examples:
        logps, predicted = row_logps(logits, mb.labels)
        ref = mb.ref_logps.float() if mb.ref_logps is not None else torch.zeros_like(logps)
        real = (mb.labels[0::2] != IGNORE_INDEX).sum(-1) > 0
        # Rows made without labels (a micro-batch built by hand, no data=preference) read as desirable.
        label = mb.desirable[0::2].bool() if mb.desirable is not None else torch.ones_like(real)
        with torch.no_grad():  # TRL's logits/* figures: the mean logit over the vocabulary at each predicted token
            scored = mb.labels[0::2, 1:] != IGNORE_INDEX
            logit_sums = torch.where(scored, logits[0::2, :-1].float().mean(-1), 0.0).sum(-1)
        return cls(logps=logps[0::2], ref=ref[0::2], kl_logps=logps[1::2], kl_ref=ref[1::2],
                   desirable=label & real, undesirable=~label & real, logit_sums=logit_sums,
                   predicted=predicted[0::2], real=real)

    def kl(self) -> torch.Tensor:
        """TRL's KL estimate: the KL rows' mean log-ratio, detached, at least 0 (0 without items)."""
        ratios = torch.where(self.real, (self.kl_logps - self.kl_ref).detach(), 0.0)
        return (ratios.sum() / self.real.sum().clamp(min=1)).clamp(min=0)


def once_if(total: torch.Tensor, present: torch.Tensor, over: torch.Tensor | None = None) -> tuple:
    """A figure TRL logs once for a micro-batch that has what it is a mean of (`present` > 0):
    (`total` / `over`, 1) then, (0, 0) otherwise, as device tensors (no host sync)."""
    has = (present > 0).long()
    mean = total / over.clamp(min=1) if over is not None else total
    return mean * has, has


@register_objective
@dataclass(frozen=True)
class KTO(CausalLM):
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024), TRL's default `loss_type` kto:
    each example's log-ratio against the KL estimate, weighted by its label."""

    name: ClassVar[str] = "kto"
    # held out: how often an example's reward lies on its label's side of the KL estimate (its loss under half its weight)
    metric: ClassVar[str] = "accuracy"
    rows_per_item: ClassVar[int] = 2
    figures: ClassVar[tuple[str, ...]] = FIGURES
    needs_reference: ClassVar[bool] = True
    unpaired: ClassVar[bool] = True

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def configured(self, settings: dict) -> KTO:
        """Its keys from `settings`, each of its default's type (a float given as an integer, 1)."""
        chosen = dataclasses.replace(self, **{f.name: type(f.default)(settings[f.name]) for f in dataclasses.fields(self)})
        chosen.check()
        return chosen

    def check(self) -> None:
        """Its keys, each wrong one in one line."""
        if self.loss_type in TRL_ONLY_LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={self.loss_type} is one of TRL's that relaytrain does not "
                              f"offer; use objective.loss_type=kto")
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={self.loss_type} is not a KTO loss; use objective.loss_type=kto")
        if not self.beta > 0:
            raise ConfigError(f"objective.beta={self.beta} must be positive (e.g. 0.1)")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"objective.{key}={getattr(self, key)} must be at least 0 (e.g. 1.0)")

    def row_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return row_logps(logits, labels)[0]

    def router_mask(self, mb: Batch) -> torch.Tensor:
        """The examples' real tokens, none of the KL rows': TRL's forward of the KL completions runs
        without gradient and apart, so a mixture's balancing term sees only the examples."""
        mask = torch.ones_like(mb.input_ids) if mb.attention_mask is None else mb.attention_mask.clone()
        mask[1::2] = 0
        return mask

    def example_losses(self, e: Examples, kl: torch.Tensor) -> torch.Tensor:
        """Each example's weighted loss [items] (TRL's `losses`, 0 for an item that is not real)."""
        ratio = e.logps - e.ref
        desirable = self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl)))
        undesirable = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio)))
        return torch.where(e.desirable, desirable, torch.where(e.undesirable, undesirable, 0.0))

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        e = Examples.of(logits, mb)
        kl = e.kl()
        return LossTerms(self.example_losses(e, kl).sum(), figures=self.example_figures(e, kl))

    def example_figures(self, e: Examples, kl: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """TRL's figures of the micro-batch, each its mean over what it is of, counted once where
        there was any (TRL appends it to the step's list only then): (mean x present, present),
        device tensors the step reads once (no host sync a micro-batch)."""
        with torch.no_grad():
            figures = {"kl": once_if(kl.detach(), e.real.sum())}
            rewards = {}
            for kind, chosen in (("chosen", e.desirable), ("rejected", e.undesirable)):
                count = chosen.sum()
                rewards[kind] = once_if(torch.where(chosen, self.beta * (e.logps - e.ref), 0.0).sum(), count, count)
                figures[f"rewards/{kind}"] = rewards[kind]
                figures[f"logps/{kind}"] = once_if(torch.where(chosen, e.logps, 0.0).sum(), count, count)
                tokens = torch.where(chosen, e.predicted, 0).sum()
                figures[f"logits/{kind}"] = once_if(torch.where(chosen, e.logit_sums, 0.0).sum(), tokens, tokens)
            (chosen, has_chosen), (rejected, has_rejected) = rewards["chosen"], rewards["rejected"]
            both = has_chosen * has_rejected
            figures["rewards/margins"] = ((chosen - rejected) * both, both)
        return figures

    def items(self, mb: Batch) -> int:
        return int(((mb.labels[0::2] != IGNORE_INDEX).sum(-1) > 0).sum())

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """The held-out examples' weighted loss sum, their count, and how many the policy places on
        their label's side of the micro-batch's KL estimate (a desirable example's log-ratio above
        it, an undesirable one's below): `accuracy`."""
        e = Examples.of(logits, mb)
        kl = e.kl()
        ratio = e.logps - e.ref
        loss = self.example_losses(e, kl).sum().detach().double()
        right = ((e.desirable & (ratio > kl)) | (e.undesirable & (ratio < kl))).sum().double()
        zero = loss.new_zeros(())
        return EvalStats(torch.stack([loss, e.real.sum().double(), right, zero, zero]).cpu())
