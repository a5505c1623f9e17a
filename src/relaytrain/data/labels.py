"""What the model's task asks of the data: the one place in `data/` that asks the objective.

Sources and encoders ask these questions, and the run's objective (`model.task`, resolved once:
`relaytrain.run.resolve`) answers them (`relaytrain.objectives`): a data source never compares
task names, so an objective of one's own derived from a built-in one gets the data of the one it
derives from. The questions, and who asks:

- `class_labels`: one class id per sample, read from the data (jsonl's and glue's label field,
  the encoder's labels; wikitext, which has none, refuses it; synthetic data draws them);
- `next_token_labels`: the labels are the inputs, shifted by the model (the encoder; the
  synthetic progressions; chat, which trains nothing else);
- `masked_token_labels`: some tokens are masked and predicted (wikitext wraps its blocks in
  [CLS] ... [SEP] for it). The encoder and the synthetic data mask whatever asks for neither
  of the above, as they always have.

Each takes the run's objective, which every caller is handed (never a task's name to look up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

IGNORE_INDEX = -100  # label value the losses skip


def class_labels(objective: Objective) -> bool:
    """Whether each sample carries one class id (classification)."""
    return objective.classifies


def next_token_labels(objective: Objective) -> bool:
    """Whether every token predicts the next one (causal LM): the labels are the inputs."""
    return objective.predicts_next_token


def masked_token_labels(objective: Objective) -> bool:
    """Whether masked tokens are predicted (masked LM)."""
    return objective.masks_tokens
