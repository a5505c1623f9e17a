"""Group Relative Policy Optimization (`objective=grpo`), as TRL's GRPOTrainer computes it.

The rows are rollouts (`Objective.learns_online`): for each prompt of a minibatch the policy
samples `num_generations` completions (`relaytrain.rollout`), the rewards score them, and each
completion's advantage is its reward against its group's (`rollout.rewards.advantages`). A row
is the prompt followed by one completion: its labels are the completion's tokens up to and
including the first end token (TRL's `completion_mask`; all -100 for a truncated completion with
`mask_truncated_completions`), its `advantage` the completion's. A micro-batch holds whole groups
(`rows_per_item` is G), so a replica's or a pipeline's share of it keeps its groups together.

Each completion token's log-prob is taken at the sampling temperature (the logits divided by
it, as TRL's `_get_per_token_logps_and_entropies`); the token's loss is PPO's clipped surrogate
-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r the ratio to the policy that sampled the
completion (`old_logps`; with one update per rollout batch the policy's own log-prob, detached,
so r = 1), plus `beta` times the k3 estimate of the KL to the reference (`ref_token_logps`),
times r (`use_bias_correction_kl`, TRL 1.16's default: the unbiased reverse-KL gradient of
DeepSeek-V3.2; the ratio's gradient counts even where its value is 1).
"Losses are sums" (docs/design.md): TRL's four reductions become a sum over the micro-batch
and the items it is over, so accumulating over micro-batches, replicas and stages gives TRL's
loss of the same minibatch:

| loss_type | TRL's reduction | total (a micro-batch's) | items |
| --- | --- | --- | --- |
| grpo | each completion's token mean, then the mean over completions | the completions' token means | completions |
| dr_grpo | the token sum over completions x max_completion_length | token sum / max_completion_length | completions |
| dapo | the token sum over the generation batch's tokens | token sum | completion tokens |
| bnpo | each micro-batch's token mean, then the mean over micro-batches | a per-micro-batch term | completions |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from relaytrain.objectives import register_objective
from relaytrain.objectives.base import Batch, LossTerms, check_loss_type
from relaytrain.objectives.chunked import Chunking
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.step.evaluation import IGNORE_INDEX, EvalStats
from relaytrain.utils.errors import ConfigError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
# TRL 1.16's loss types beyond those, refused by name rather than as unknown words.
TRL_ONLY_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
ROLLOUT_ENGINES = ("builtin", "vllm")
# Where a host-held policy (L2L's) samples: chosen by the device's free memory, a whole device copy,
# a relay of its blocks through the device, or the host itself (`rollout.on_device`).
ROLLOUT_PLACEMENTS = ("auto", "copy", "relay", "host")
# What the loss reports each step, in TRL's names: means over the minibatch's completion tokens.
FIGURES = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class TokenTerms:
    """A micro-batch's counted completion tokens, flattened: the policy's log-prob of each (at
    the sampling temperature), its entropy, and which row it is of. A position p of a row
    predicts token p + 1; only the positions whose next token the loss counts are computed
    (`counted`), except in a dry run, where no value says which: there every position is
    (`counted` None), the most a micro-batch of rows can hold."""

    logps: torch.Tensor  # [tokens]
    entropy: torch.Tensor  # [tokens]
    rows: torch.Tensor  # [tokens]: each token's row
    per_row_tokens: torch.Tensor  # [rows]: each row's counted tokens
    counted: torch.Tensor | None  # [rows, seq - 1]: where the tokens are; None: everywhere (a dry run)

    @classmethod
    def of(cls, logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor | None,
           temperature: float) -> TokenTerms:
        """`logits` [tokens, vocab] of the `counted` positions, in row-major order."""
        shape = labels[:, 1:].shape
        if counted is None:
            rows = torch.arange(shape[0], device=labels.device).repeat_interleave(shape[1])
            per_row = torch.full((shape[0],), shape[1], device=labels.device)
        else:
            rows, per_row = counted.nonzero()[:, 0], counted.sum(-1)
        log_probs = (logits.float() / temperature).log_softmax(-1)
        logps = torch.gather(log_probs, -1, cls._select(labels, counted).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():  # TRL's entropy_from_logits: reported, never trained
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return cls(logps=logps, entropy=entropy, rows=rows, per_row_tokens=per_row, counted=counted)

    @staticmethod
    def _select(per_position: torch.Tensor, counted: torch.Tensor | None) -> torch.Tensor:
        """A [rows, seq] field's values at the tokens the positions predict [tokens]."""
        following = per_position[:, 1:]
        return following.flatten() if counted is None else following[counted]

    def at(self, per_position: torch.Tensor) -> torch.Tensor:
        """A row field given at each token's own position [rows, seq] (old or reference
        log-probs), at the counted tokens [tokens]."""
        return self._select(per_position, self.counted).float()

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [tokens] summed over each row's tokens [rows]."""
        return values.new_zeros(self.per_row_tokens.shape[0]).index_add(0, self.rows, values)


@register_objective
@dataclass(frozen=True)
class GRPO(CausalLM):
    """GRPO (Shao et al. 2024) with TRL's loss types: grpo, dr_grpo (Liu et al. 2025), dapo (Yu
    et al. 2025) and bnpo; asymmetric clipping (`epsilon_high`, DAPO's clip-higher); `num_iterations`
    updates per rollout batch against the sampling policy's log-probs."""

    name: ClassVar[str] = "grpo"
    metric: ClassVar[str] = "reward"  # held out: the mean summed reward of the prompts' sampled completions
    evaluates_loss: ClassVar[bool] = False
    figures: ClassVar[tuple[str, ...]] = FIGURES
    learns_online: ClassVar[bool] = True

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None
    rollout_engine: str = "builtin"
    rollout_placement: str = "auto"
    use_bias_correction_kl: bool = True

    @property
    def rows_per_item(self) -> int:  # type: ignore[override]  # a prompt's group of completions
        return self.num_generations

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def configured(self, settings: dict) -> GRPO:
        weights = settings.get("reward_weights")
        high = settings.get("epsilon_high")
        chosen = dataclasses.replace(
            self, num_generations=int(settings["num_generations"]),
            max_completion_length=int(settings["max_completion_length"]),
            temperature=float(settings["temperature"]), top_p=float(settings["top_p"]), top_k=int(settings["top_k"]),
            beta=float(settings["beta"]), epsilon=float(settings["epsilon"]),
            epsilon_high=None if high is None else float(high), num_iterations=int(settings["num_iterations"]),
            loss_type=str(settings["loss_type"]), scale_rewards=str(settings["scale_rewards"]),
            mask_truncated_completions=bool(settings["mask_truncated_completions"]),
            rewards=tuple(str(r) for r in settings.get("rewards") or ()),
            reward_weights=None if weights is None else tuple(float(w) for w in weights),
            rollout_engine=str(settings["rollout_engine"]),
            rollout_placement=str(settings.get("rollout_placement", "auto")),
            use_bias_correction_kl=bool(settings.get("use_bias_correction_kl", True)))
        chosen.check()
        return chosen

    @property
    def settings(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["rewards"] = list(self.rewards)
        values["reward_weights"] = None if self.reward_weights is None else list(self.reward_weights)
        return values

    def check(self) -> None:
        """Its keys, each wrong one in one line (the rewards themselves are checked by loading them)."""
        check_loss_type(self.loss_type, LOSS_TYPES, TRL_ONLY_LOSS_TYPES, "GRPO")
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations={self.num_generations}: GRPO's advantage is a completion's "
                              f"reward against its group's, so it needs at least 2 completions a prompt (TRL: 8)")
        if self.max_completion_length < 1:
            raise ConfigError(f"objective.max_completion_length={self.max_completion_length} must be at least 1")
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature={self.temperature} must be positive: GRPO samples its "
                              f"completions (TRL: 1.0)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"objective.top_p={self.top_p} must be in (0, 1] (1: no nucleus cut)")
        if self.top_k < 0:
            raise ConfigError(f"objective.top_k={self.top_k} must be at least 0 (0: no top-k cut)")
        if self.beta < 0:
            raise ConfigError(f"objective.beta={self.beta} must be at least 0 (0: no KL term, TRL's default)")
        if not (0 <= self.epsilon < 1 and self.clip_high >= 0):
            raise ConfigError(f"objective.epsilon={self.epsilon} (and epsilon_high={self.epsilon_high}) must be in "
                              f"[0, 1) (TRL: 0.2; DAPO's clip-higher: epsilon_high=0.28)")
        if self.num_iterations < 1:
            raise ConfigError(f"objective.num_iterations={self.num_iterations} must be at least 1 (updates per "
                              f"rollout batch)")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"objective.scale_rewards={self.scale_rewards} is not one of {', '.join(SCALE_REWARDS)}")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"objective.rollout_engine={self.rollout_engine} is not one of "
                              f"{', '.join(ROLLOUT_ENGINES)}")
        if self.rollout_placement not in ROLLOUT_PLACEMENTS:
            raise ConfigError(f"objective.rollout_placement={self.rollout_placement} is not one of "
                              f"{', '.join(ROLLOUT_PLACEMENTS)}")
        if not self.rewards:
            raise ConfigError("objective=grpo needs rewards: set objective.rewards=[package.module:function, ...] "
                              "(TRL's reward-function signature) or a built-in, e.g. objective.rewards=[exact_answer]")

    # -- the loss -----------------------------------------------------------------------------
    def head_loss(self, head: nn.Module, hidden: torch.Tensor, mb: Batch, chunking: Chunking) -> LossTerms:
        """The head over the positions that predict a completion token only (not the prompt's,
        nor padding): TRL's `logits_to_keep`, which spares the logits of every other position."""
        if hidden.device.type == "meta":  # a dry run: every position (`TokenTerms`)
            return self.token_loss(head(hidden[:, :-1].flatten(0, 1)), mb, None)
        counted = mb.labels[:, 1:] != IGNORE_INDEX
        return self.token_loss(head(hidden[:, :-1][counted]), mb, counted)

    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        counted = mb.labels[:, 1:] != IGNORE_INDEX
        return self.token_loss(logits[:, :-1][counted], mb, counted)

    def token_loss(self, logits: torch.Tensor, mb: Batch, counted: torch.Tensor | None) -> LossTerms:
        """The micro-batch's loss terms from the logits of its `counted` positions [tokens, vocab]."""
        t = TokenTerms.of(logits, mb.labels, counted, self.temperature)
        losses, values = self.token_losses(t, mb)
        tokens = t.per_row_tokens.sum()
        total, per_microbatch = losses.new_zeros(()), 0.0
        if self.loss_type == "grpo":
            total = (t.per_row(losses) / t.per_row_tokens.clamp(min=1)).sum()
        elif self.loss_type == "dr_grpo":
            total = losses.sum() / self.max_completion_length
        elif self.loss_type == "dapo":
            total = losses.sum()
        else:  # bnpo: the micro-batch's token mean, a term of the micro-batch
            per_microbatch = losses.sum() / tokens.clamp(min=1)
        with torch.no_grad():
            figures = {name: (v.sum(), tokens) for name, v in values.items()}
        return LossTerms(total, per_microbatch, figures)

    def token_losses(self, t: TokenTerms, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each counted token's loss [tokens] and the per-token values the figures average."""
        advantage = mb.advantage.float()[t.rows]
        old = t.logps.detach() if mb.old_logps is None else t.at(mb.old_logps)
        ratio = torch.exp(t.logps - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.clip_high)
        loss = -torch.min(ratio * advantage, clipped * advantage)
        values = {"entropy": t.entropy}
        if self.beta != 0:
            ref = t.at(mb.ref_token_logps)
            kl = torch.exp(ref - t.logps) - (ref - t.logps) - 1  # k3, as TRL
            if self.use_bias_correction_kl:  # TRL 1.16's default: weighted by the ratio, whose gradient counts at r = 1
                kl = kl * ratio
            loss = loss + self.beta * kl
            values["kl"] = kl.detach()
        with torch.no_grad():
            low = (ratio < 1 - self.epsilon) & (advantage < 0)
            high = (ratio > 1 + self.clip_high) & (advantage > 0)
            values.update({"clip_ratio/low_mean": low.float(), "clip_ratio/high_mean": high.float(),
                           "clip_ratio/region_mean": (low | high).float()})
        return loss, values

    def items(self, mb: Batch) -> int:
        if self.loss_type == "dapo":
            return int((mb.labels[:, 1:] != IGNORE_INDEX).sum())
        return int((mb.record >= 0).sum()) if mb.record is not None else mb.labels.shape[0]

    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """Held-out prompts are not scored by a loss (their completions are sampled, not given):
        the rollout stage samples and scores them instead (`RolloutStage.evaluate`)."""
        raise NotImplementedError("objective=grpo's held-out prompts are evaluated by the rollout stage")
