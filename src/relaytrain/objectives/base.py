"""What an objective is: the head's output and the micro-batch in, the loss as a sum out.

"Losses are sums" (docs/design.md): an objective returns a micro-batch's loss summed over its
items (`LossTerms.total`, fp32) and counts those items (`Objective.items`); a strategy divides
every micro-batch's sum by the item count of the whole minibatch (`LossTerms.over`), which makes
the accumulation over micro-batches, replicas and pipeline stages exactly the minibatch's mean.
A term defined per micro-batch rather than per item (a mixture's router balancing loss:
`LossTerms.per_microbatch`) is divided by the minibatch's micro-batches instead, which makes it
their mean.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from relaytrain.objectives.chunked import Chunking
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.step.evaluation import EvalStats


class Batch(Protocol):
    """What an objective reads of a micro-batch (`models.layered.MicroBatch`, which the models
    layer defines above this one)."""

    input_ids: torch.Tensor  # [batch, seq]
    labels: torch.Tensor  # [batch] for a classifier, [batch, seq] per token (-100: no item)
    attention_mask: torch.Tensor | None  # [batch, seq], 1 = real token


@dataclass(frozen=True)
class Divisor:
    """What a micro-batch's loss terms are divided by: the whole minibatch's loss items and its
    micro-batches, every replica's (a replica's share of a micro-batch is one of them)."""

    items: int
    microbatches: int = 1


@dataclass(frozen=True)
class LossTerms:
    """A micro-batch's loss: `total`, summed over its items in fp32, and `per_microbatch`, a term
    of the micro-batch as a whole (a mixture's router balancing term), 0 where there is none.
    `figures`: what the objective reports beside the loss (a preference objective's rewards),
    each as (its sum over the micro-batch's items, their count), detached; the step reports
    their means over the minibatch."""

    total: torch.Tensor
    per_microbatch: torch.Tensor | float = 0.0
    figures: dict[str, tuple[torch.Tensor, torch.Tensor | int]] = field(default_factory=dict)

    def over(self, divisor: Divisor) -> torch.Tensor:
        """Its share of the minibatch's loss: the sum over the whole minibatch's item count, plus
        the micro-batch's own term over the minibatch's micro-batches (so that term's mean). A
        minibatch of no items (every completion masked) has nothing to learn: its sums are 0, and
        so is its loss (TRL and Hugging Face clamp the count at 1), not 0/0."""
        return self.total / max(divisor.items, 1) + self.per_microbatch / divisor.microbatches


class Objective(ABC):
    """One objective: the loss, its items, the evaluation sums, and the answers the rest of the
    program asks for instead of comparing names. Stateless: one instance serves every model."""

    name: ClassVar[str] = ""  # the registered name (model.task); "" for a user's: its import path
    # One label per sequence, a class out of model.num_labels (a classifier head); else one per token.
    classifies: ClassVar[bool] = False
    predicts_next_token: ClassVar[bool] = False  # a causal LM: generation, chat data, perplexity
    masks_tokens: ClassVar[bool] = False  # the labels are masked-out input tokens: the data masks them
    metric: ClassVar[str] = "accuracy"  # the evaluation's figure beside the loss: accuracy or perplexity
    head: ClassVar[str] = ""  # transformers' auto class of the model the objective trains the head of
    architectures: ClassVar[tuple[str, ...]] = ()  # checkpoint architecture name endings with that head
    peft_task_type: ClassVar[str | None] = None  # peft's task type for the head (adapter_config.json)
    # A classifier head of this many outputs whatever model.num_labels says (a reward model's one
    # score; the config checks hold model.num_labels to it); None: model.num_labels classes.
    num_labels: ClassVar[int | None] = None
    # Consecutive rows that make one item (a preference pair: chosen, then rejected); a micro-batch
    # of strategy.microbatch_size items holds this many times as many rows.
    rows_per_item: ClassVar[int] = 1
    figures: ClassVar[tuple[str, ...]] = ()  # the names of `LossTerms.figures`, reported each step
    needs_reference: ClassVar[bool] = False  # the loss reads a reference model's log-probs (`reference_logps`)
    # Its items are unpaired examples (KTO's), each followed by its KL row: the same prompt with a
    # neighbour's completion (the data pairs them within each micro-batch), rather than pairs.
    unpaired: ClassVar[bool] = False
    # How data=preference tokenizes a pair: as TRL's DPOTrainer ("dpo") or as its CPO and ORPO trainers
    # ("cpo", data/cpo_tokens.py), which differ (bos, the prompt's last token, chat templates as text).
    pair_tokenization: ClassVar[str] = "dpo"
    # Its rows are rollouts: completions the policy samples for data=prompts' prompts as it trains,
    # scored and turned into rows by `relaytrain.rollout` each time a batch is due (GRPO's).
    learns_online: ClassVar[bool] = False
    # Its held-out figures include a loss (an online objective's are its rewards: completions are
    # sampled, and no loss is taken of them).
    evaluates_loss: ClassVar[bool] = True

    def configured(self, settings: dict) -> Objective:
        """This objective with the run's `objective.*` keys (`settings`: plain values by key);
        one that takes none is itself."""
        return self

    @property
    def settings(self) -> dict:
        """The keys `configured` took, as plain values (how a worker receives the objective)."""
        return {}

    @abstractmethod
    def loss(self, logits: torch.Tensor, mb: Batch) -> LossTerms:
        """The micro-batch's loss terms from the head's output."""

    @abstractmethod
    def items(self, mb: Batch) -> int:
        """How many items `loss` sums over (a strategy sums this over the minibatch)."""

    @abstractmethod
    def eval_stats(self, logits: torch.Tensor, mb: Batch) -> EvalStats:
        """The evaluation sums of the micro-batch (loss, items, correct, confusion)."""

    def router_mask(self, mb: Batch) -> torch.Tensor | None:
        """The tokens a mixture's balancing term counts [rows, tokens] (None: every one): the
        micro-batch's real tokens, as Hugging Face's model counts those of its input."""
        return mb.attention_mask

    def row_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's log-prob of its labelled tokens [rows] (a reference pass); an objective
        that reads no reference has none."""
        raise NotImplementedError(f"objective {self.name} reads no reference log-probs")

    @property
    def cuts_head_into_chunks(self) -> bool:
        """Whether `head_loss` runs the head over chunks of tokens where that saves memory (the
        cost model counts what it holds the same way)."""
        return False

    def head_loss(self, head: nn.Module, hidden: torch.Tensor, mb: Batch, chunking: Chunking) -> LossTerms:
        """The loss of the head's output on the last block's `hidden`: the whole output at once
        (a causal LM's cross-entropy cuts it into chunks of tokens, `chunking`)."""
        return self.loss(head(hidden), mb)

    def head_eval_stats(self, head: nn.Module, hidden: torch.Tensor, mb: Batch, chunking: Chunking) -> EvalStats:
        """`eval_stats` of the head's output on `hidden` (by chunks where `head_loss` cuts them)."""
        return self.eval_stats(head(hidden), mb)


def check_loss_type(loss_type: str, offered: tuple[str, ...], trl_only: tuple[str, ...], kind: str) -> None:
    """objective.loss_type against the `kind` of loss it names (DPO, GRPO): one of TRL's that
    relaytrain does not offer is refused by name, any other word as unknown; each in one line."""
    if loss_type in trl_only:
        raise ConfigError(f"objective.loss_type={loss_type} is one of TRL's {kind} losses that relaytrain does not "
                          f"offer; use {', '.join(offered)}")
    if loss_type not in offered:
        raise ConfigError(f"objective.loss_type={loss_type} is not a {kind} loss; use {', '.join(offered)}")
