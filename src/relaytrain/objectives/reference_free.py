"""Preference objectives without a reference model: SimPO (`objective=simpo`) and ORPO
(`objective=orpo`), as TRL 1.16's experimental CPOTrainer (`loss_type="simpo"`) and ORPOTrainer
compute them.

Pairs travel as for DPO (`objectives/preference.py`): two consecutive rows of a micro-batch, the
chosen then the rejected, labelled on the completions. Both objectives score a reply by its mean
log-prob per completion token (the labelled tokens after the first position), so no reference
pass runs (`needs_reference = False`). Both add a negative log-likelihood term that TRL takes as a
mean over the micro-batch's tokens (SimPO: the chosen completions' tokens, weighted by
`cpo_alpha`; ORPO: every token of the chosen rows, prompt included), which is therefore a term of
the micro-batch (`LossTerms.per_microbatch`), TRL's mean over micro-batches; the pairs' own terms
are sums over the pairs ("losses are sums", docs/design.md).

Their rows are tokenized as TRL's CPO and ORPO trainers do (`pair_tokenization = "cpo"`,
`data/cpo_tokens.py`), which is not its DPOTrainer's way. TRL's figures, in its names, are
`LossTerms.figures`: those of a pair (rewards, log-probs, ORPO's log odds) as sums over the pairs,
those TRL takes of a micro-batch as a whole (`nll_loss`, the mean logits) once a micro-batch.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.utils.errors import ConfigError

# TRL's CPOTrainer's figures: beta times each reply's mean log-prob, how often the chosen one's
# is larger, their difference, the mean log-probs, the mean logits, the NLL term; ORPOTrainer
# adds the mean log-sigmoid of the log odds ratio and the mean log odds ratio.
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss")
ORPO_FIGURES = (*FIGURES, "log_odds_ratio", "log_odds_chosen")


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-prob of the next token's target [rows, seq - 1], fp32, 0 where the
    target is -100 (token n predicted from those before, as the causal LM's cross-entropy shifts)."""
    y = targets[:, 1:]
    token = torch.gather(logits[:, :-1].float().log_softmax(-1), -1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(y != IGNORE_INDEX, token, 0.0)


@dataclass(frozen=True)
class Replies:
    """A micro-batch's pairs: each reply's mean log-prob per completion token, the NLL term's
    summed log-probs and tokens on the chosen rows, TRL's mean logits, and which pairs are real
    (a micro-batch filled up with unlabelled copies to its full size has pairs that count nowhere)."""

    chosen: torch.Tensor  # [pairs]
    rejected: torch.Tensor
    nll_logps: torch.Tensor  # [pairs]: the chosen row's summed log-prob over the NLL term's tokens
    nll_tokens: torch.Tensor
    real: torch.Tensor
    mean_logits: tuple[torch.Tensor, torch.Tensor]  # TRL's logits/chosen and logits/rejected

    @classmethod
    def of(cls, logits: torch.Tensor, mb: Batch, whole_rows: bool, cut_last: bool) -> Replies:
        """`whole_rows`: the NLL term covers every real token of a chosen row (ORPO), else its
        completion (SimPO); `cut_last`: TRL's mean logits leave out the last position (ORPO)."""
        labelled = mb.labels != IGNORE_INDEX
        attended = _attended(mb)
        targets = torch.where(labelled | ~attended, mb.labels, mb.input_ids) if whole_rows else mb.labels
        logps = token_logps(logits, targets)
        completion = labelled[:, 1:]
        sums, counts = torch.where(completion, logps, 0.0).sum(-1), completion.sum(-1)
        means = sums / counts.clamp(min=1)  # a filled-up pair has none (and counts nowhere)
        real = counts[0::2] > 0
        nll_sums, nll_counts = (logps.sum(-1), (targets[:, 1:] != IGNORE_INDEX).sum(-1)) if whole_rows else (sums, counts)
        return cls(chosen=means[0::2], rejected=means[1::2], nll_logps=nll_sums[0::2], nll_tokens=nll_counts[0::2],
                   real=real, mean_logits=_mean_logits(logits, attended, real, cut_last))

    @property
    def count(self) -> int:
        return int(self.real.sum())

    def summed(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [pairs] summed over the real pairs."""
        return torch.where(self.real, values, 0.0).sum()

    def nll(self) -> torch.Tensor:
        """TRL's NLL term: the mean over the micro-batch's NLL tokens of the chosen rows."""
        return -self.summed(self.nll_logps) / torch.where(self.real, self.nll_tokens, 0).sum().clamp(min=1)

    def pair_nll(self) -> torch.Tensor:
        """Each pair's own NLL, the mean over its chosen row's NLL tokens [pairs] (held out)."""
        return -self.nll_logps / self.nll_tokens.clamp(min=1)

    def figures(self, beta: float, nll: torch.Tensor | float) -> dict[str, tuple[torch.Tensor, int]]:
        """TRL's CPO figures: those of a pair summed over the real pairs, with their count; those of
        the micro-batch (its mean logits, its NLL) once, counted as one micro-batch."""
        chosen, rejected = beta * self.chosen, beta * self.rejected
        per_pair = (chosen, rejected, (chosen > rejected).float(), chosen - rejected, self.chosen, self.rejected)
        count = self.count
        once = int(count > 0)
        sums = [(self.summed(v), count) for v in per_pair]
        sums += [(v * once, once) for v in (*self.mean_logits, torch.as_tensor(nll, dtype=torch.float32))]
        return {name: (total.detach(), count) for name, (total, count) in zip(FIGURES, sums, strict=True)}


def _attended(mb: Batch) -> torch.Tensor:
    return torch.ones_like(mb.input_ids, dtype=torch.bool) if mb.attention_mask is None else mb.attention_mask.bool()


def _mean_logits(logits: torch.Tensor, attended: torch.Tensor, real: torch.Tensor, cut_last: bool):
    """TRL's logits/chosen and logits/rejected: the mean of the real pairs' logits over every
    position up to the micro-batch's longest real row (TRL pads a micro-batch to that; ORPO leaves
    the last position out) and the whole vocabulary, padding positions included. On the device,
    read nowhere (no wait for it), and no copy of the logits."""
    with torch.no_grad():
        longest = torch.where(real.repeat_interleave(2), attended.sum(-1), 0).max() - int(cut_last)
        within = torch.arange(logits.shape[1], device=logits.device) < longest
        row_sums = torch.where(within, logits.sum(-1, dtype=torch.float32), 0.0).sum(-1)
        size = (real.sum() * longest.clamp(min=0) * logits.shape[-1]).clamp(min=1)
        return tuple(torch.where(real, row_sums[side::2], 0.0).sum() / size for side in (0, 1))


class ReferenceFree(CausalLM):
    """What SimPO and ORPO share: pairs of rows tokenized as TRL's CPO/ORPO trainers do, no
    reference, the held-out accuracy; a subclass gives each pair's loss and its NLL weight."""

    metric: ClassVar[str] = "accuracy"  # held out: how often the chosen reply's reward is the larger (rewards/accuracies)
    rows_per_item: ClassVar[int] = 2
    needs_reference: ClassVar[bool] = False
    pair_tokenization: ClassVar[str] = "cpo"
    whole_rows: ClassVar[bool] = False  # the NLL term covers the chosen rows' every token (ORPO), else its completion
    beta: float

    @property
    def settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def nll_weight(self) -> float:
        return 1.0

    def check(self, settings: dict) -> None:
        """The keys every reference-free objective shares, each wrong one in one line; `settings`:
        every objective.* key (a worker's holds only this objective's own)."""
        if not self.beta > 0:
            raise ConfigError(f"objective.beta={self.beta} must be positive (e.g. 0.1)")
        for key, fix in (("ref_model", "it reads no reference"), ("rpo_alpha", "DPO's; its NLL term is built in")):
            if settings.get(key) is not None:
                raise ConfigError(f"objective.{key}={settings[key]} is not a key of objective={self.name} ({fix}); "
                                  f"drop it")

    def replies(self, logits: torch.Tensor, mb: Batch) -> Replies:
        return Replies.of(logits, mb, whole_rows=self.whole_rows, cut_last=self.whole_rows)

    @abstractmethod
    def pair_losses(self, r: Replies) -> torch.Tensor:
        """Each pair's loss [pairs], its NLL term apart."""

    def pair_figures(self, r: Replies, nll: torch.Tensor | float) -> dict[str, tuple[torch.Tensor, int]]:
        return r.figures(self.beta, nll)

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        r = self.replies(logits, mb)
        nll = r.nll() if self.nll_weight else logits.new_zeros((), dtype=torch.float32)  # TRL skips it at weight 0
        with torch.no_grad():
            figures = self.pair_figures(r, nll.detach())
        return LossTerms(r.summed(self.pair_losses(r)), self.nll_weight * nll, figures)

    def items(self, mb: Batch) -> int:
        return int(((mb.labels[0::2] != IGNORE_INDEX).sum(-1) > 0).sum())

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """The held-out pairs' loss sum (each pair's loss with its own chosen row's NLL, a mean over
        its tokens: TRL's batch mean, per pair, so the sum does not depend on how pairs are
        batched), their count, and how many the policy ranks as the data does (`accuracy` is
        TRL's `rewards/accuracies`)."""
        r = self.replies(logits, mb)
        loss = r.summed(self.pair_losses(r) + self.nll_weight * r.pair_nll()).detach().double()
        accurate = r.summed((r.chosen > r.rejected).float()).double()
        zero = loss.new_zeros(())
        return EvalStats(torch.stack([loss, loss.new_tensor(float(r.count)), accurate, zero, zero]).cpu())


@register_objective
@dataclass(frozen=True)
class SimPO(ReferenceFree):
    """Simple Preference Optimization (Meng et al. 2024), as TRL's CPOTrainer with
    `loss_type="simpo"` computes it: the margin of the replies' mean log-probs per token less the
    target margin `gamma / beta`, through a log-sigmoid at `beta` (`label_smoothing`: the chance a
    label is flipped), plus `cpo_alpha` times the chosen completions' NLL (CPO's behaviour cloning
    term; 0 is the paper's SimPO)."""

    name: ClassVar[str] = "simpo"
    figures: ClassVar[tuple[str, ...]] = FIGURES

    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0

    def configured(self, settings: dict) -> SimPO:
        loss_type = settings.get("loss_type", "simpo")
        if loss_type != "simpo":
            raise ConfigError(f"objective.loss_type={loss_type}: objective=simpo is TRL's CPO loss_type=simpo only; "
                              f"drop the key (for {loss_type} use objective=dpo)")
        chosen = dataclasses.replace(self, beta=float(settings["beta"]), gamma=float(settings["gamma"]),
                                     label_smoothing=float(settings["label_smoothing"]),
                                     cpo_alpha=float(settings["cpo_alpha"]))
        chosen.check(settings)
        return chosen

    def check(self, settings: dict) -> None:
        super().check(settings)
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if not self.cpo_alpha >= 0:
            raise ConfigError(f"objective.cpo_alpha={self.cpo_alpha} must be at least 0 (0: no NLL term)")

    @property
    def nll_weight(self) -> float:
        return self.cpo_alpha

    def pair_losses(self, r: Replies) -> torch.Tensor:
        margin = self.beta * (r.chosen - r.rejected - self.gamma / self.beta)
        eps = self.label_smoothing
        return -F.logsigmoid(margin) * (1 - eps) - F.logsigmoid(-margin) * eps


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branched at -ln 2 against cancellation (TRL's)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_objective
@dataclass(frozen=True)
class ORPO(ReferenceFree):
    """Odds Ratio Preference Optimization (Hong et al. 2024), as TRL's ORPOTrainer computes it:
    the chosen rows' NLL over all their tokens, prompt included, less `beta` (the paper's lambda)
    times the log-sigmoid of the log odds ratio of the replies' mean log-probs per token."""

    name: ClassVar[str] = "orpo"
    figures: ClassVar[tuple[str, ...]] = ORPO_FIGURES
    whole_rows: ClassVar[bool] = True

    beta: float = 0.1

    def configured(self, settings: dict) -> ORPO:
        chosen = dataclasses.replace(self, beta=float(settings["beta"]))
        chosen.check(settings)
        return chosen

    def check(self, settings: dict) -> None:
        super().check(settings)
        if settings.get("label_smoothing"):
            raise ConfigError(f"objective.label_smoothing={settings['label_smoothing']} is not ORPO's (TRL's ORPO has "
                              f"none); drop it")

    @staticmethod
    def log_odds(r: Replies) -> torch.Tensor:
        """Each pair's log odds ratio [pairs] (the paper's eqs. 4 and 7 in log form)."""
        return (r.chosen - r.rejected) - (log1mexp(r.chosen) - log1mexp(r.rejected))

    def pair_losses(self, r: Replies) -> torch.Tensor:
        return -self.beta * F.logsigmoid(self.log_odds(r))

    def pair_figures(self, r: Replies, nll: torch.Tensor | float) -> dict[str, tuple[torch.Tensor, int]]:
        log_odds = self.log_odds(r)
        odds = {"log_odds_ratio": F.logsigmoid(log_odds), "log_odds_chosen": log_odds}
        return {**r.figures(self.beta, nll), **{name: (r.summed(v).detach(), r.count) for name, v in odds.items()}}
