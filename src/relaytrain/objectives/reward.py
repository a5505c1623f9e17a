"""Reward models (`objective=reward`): one score per sequence, trained on preference pairs
(`data=preference`) with the Bradley–Terry loss, as TRL 1.16's RewardTrainer computes it.

The model is a sequence classifier with one output (`AutoModelForSequenceClassification`,
`num_labels=1`), so this objective derives from `Classification`: the model builder gives the head
`model.num_labels` outputs and the checkpoint its `...ForSequenceClassification` name, LoRA trains
the head in full (peft's SEQ_CLS `modules_to_save`), an export keeps its one label, and the head
is read at one token a row (a decoder's: its last before the padding, `models/decoder_heads.py`).
Its loss and items are its own: a pair is two consecutive rows of a micro-batch (`rows_per_item =
2`, made by `data=preference`), the chosen, then the rejected; the rows' labels only tell a real
pair from one that fills up a micro-batch (labelled nowhere).

Each pair's loss is `-logsigmoid(r_chosen - r_rejected - margin)`, plus `center_rewards_coefficient
* (r_chosen + r_rejected) ** 2` where that is set (TRL's `center_rewards_coefficient`, Eisenstein et
al. 2023); `margin` is the pair's (TRL's `margin` column, the row field `margin`), 0 without one.
TRL takes each term's mean over a micro-batch's pairs; here the loss is their sum ("losses are
sums", docs/design.md), so the minibatch's loss is the mean over its pairs, TRL's accumulated over
equal micro-batches. A mixture of experts adds no router term: transformers' sequence classifier
has none in its loss, and TRL adds none.

The figures TRL logs each step, in its names (`LossTerms.figures`): `accuracy` (how often the
chosen row scores higher), `margin` (the mean of r_chosen - r_rejected, the data's margin not
taken off), `mean_reward` (over every row), and `min_reward` and `max_reward`, the smallest and
largest score of each micro-batch, averaged over the micro-batches as TRL averages them: equal to
TRL's where one process holds each micro-batch (TRL gathers its processes' rows before taking
them; here each replica's share of a micro-batch counts as one).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms
from relaytrain.objectives.cross_entropy import Classification
from relaytrain.schema.config import ObjectiveConfig
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.utils.errors import ConfigError

FIGURES = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")  # TRL's RewardTrainer's names
KEYS = ("center_rewards_coefficient",)  # the objective.* keys it takes


@dataclass(frozen=True)
class ScoredPairs:
    """A micro-batch's pairs: each reply's score, each pair's margin, and which pairs are real (a
    micro-batch filled up with unlabelled copies to its full size has pairs that count nowhere)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    margin: torch.Tensor | float
    real: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, mb: Batch) -> ScoredPairs:
        scores = logits.float().squeeze(-1)  # [rows, 1] -> [rows]
        labelled = mb.labels != IGNORE_INDEX
        if labelled.dim() > 1:  # a pair's rows are labelled on their completions (data=preference)
            labelled = labelled.any(-1)
        margin = mb.margin[0::2].float() if getattr(mb, "margin", None) is not None else 0.0
        return cls(chosen=scores[0::2], rejected=scores[1::2], margin=margin, real=labelled[0::2])

    @property
    def count(self) -> int:
        return int(self.real.sum())

    def summed(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [pairs] summed over the real pairs."""
        return torch.where(self.real, values, 0.0).sum()

    def extreme(self, largest: bool) -> torch.Tensor:
        """The largest (or smallest) score of the real pairs' rows (0 where there is none)."""
        scores, real = torch.cat([self.chosen, self.rejected]), torch.cat([self.real, self.real])
        bound = -math.inf if largest else math.inf
        masked = torch.where(real, scores, bound)
        value = masked.max() if largest else masked.min()
        return torch.where(real.any(), value, 0.0)


@register_objective
@dataclass(frozen=True)
class Reward(Classification):
    """A Bradley–Terry reward model, as TRL's RewardTrainer trains it."""

    name: ClassVar[str] = "reward"
    rows_per_item: ClassVar[int] = 2
    figures: ClassVar[tuple[str, ...]] = FIGURES
    num_labels: ClassVar[int | None] = 1  # one score a sequence, whatever a classifier's model.num_labels

    center_rewards_coefficient: float | None = None

    def configured(self, settings: dict) -> Reward:
        refuse_other_keys(settings)
        coefficient = settings.get("center_rewards_coefficient")
        chosen = dataclasses.replace(
            self, center_rewards_coefficient=None if coefficient is None else float(coefficient))
        chosen.check()
        return chosen

    @property
    def settings(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and not (math.isfinite(coefficient) and coefficient >= 0):
            raise ConfigError(f"objective.center_rewards_coefficient={coefficient} must be at least 0 (TRL "
                              f"recommends 0.01), or null: no centring term")

    def pair_losses(self, p: ScoredPairs) -> torch.Tensor:
        """Each pair's loss [pairs]: Bradley–Terry, then the centring term."""
        losses = -F.logsigmoid(p.chosen - p.rejected - p.margin)
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * (p.chosen + p.rejected) ** 2
        return losses

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        p = ScoredPairs.of(logits, mb)
        return LossTerms(p.summed(self.pair_losses(p)), 0.0, self.pair_figures(p))

    def pair_figures(self, p: ScoredPairs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """TRL's figures, each a sum over the micro-batch (detached) and what it is a mean over,
        both device tensors: the step reads them once (no host sync a micro-batch)."""
        with torch.no_grad():
            count, chosen, rejected = p.real.sum(), p.chosen.detach(), p.rejected.detach()
            microbatches = p.real.any().long()  # the extremes: one value a micro-batch with real pairs
            return {"accuracy": (p.summed((chosen > rejected).float()), count),
                    "margin": (p.summed(chosen - rejected), count),
                    "mean_reward": (p.summed(chosen + rejected), 2 * count),
                    "min_reward": (p.extreme(largest=False).detach(), microbatches),
                    "max_reward": (p.extreme(largest=True).detach(), microbatches)}

    def items(self, mb: Batch) -> int:
        labelled = mb.labels != IGNORE_INDEX
        return int((labelled.any(-1) if labelled.dim() > 1 else labelled)[0::2].sum())

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """The held-out pairs' loss sum, their count, and how many the model ranks as the data
        does (the chosen row scored above the rejected one): `accuracy` is TRL's."""
        p = ScoredPairs.of(logits, mb)
        loss = p.summed(self.pair_losses(p)).detach().double()
        accurate = p.summed((p.chosen > p.rejected).double()).detach()
        zero = loss.new_zeros(())
        head = torch.stack([loss, loss.new_tensor(float(p.count)), accurate, zero, zero])
        confusion = loss.new_zeros(logits.shape[-1] ** 2)  # a one-label head's, as `EvalStats.zeros` makes it
        return EvalStats(torch.cat([head, confusion]).cpu())


def refuse_other_keys(settings: dict) -> None:
    """Another objective's key set for this one (objective.beta, objective.ref_model, ...): one
    line, rather than a setting that silently does nothing."""
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(ObjectiveConfig)}
    for key, value in settings.items():
        if key not in KEYS and key in defaults and value != defaults[key]:
            raise ConfigError(f"objective.{key}={value} is not a key of objective=reward (it takes "
                              f"{', '.join(f'objective.{k}' for k in KEYS)}); drop it")
