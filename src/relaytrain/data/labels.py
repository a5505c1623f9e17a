"""What the model's task asks of the data: the one place in `data/` that reads `model.task`.

Sources and encoders ask these questions, and the objective `model.task` names answers them
(`relaytrain.objectives`): a data source never compares task names, so an objective of one's own
derived from a built-in one gets the data of the one it derives from. The questions, and who asks:

- `class_labels`: one class id per sample, read from the data (jsonl's and glue's label field,
  the encoder's labels; wikitext, which has none, refuses it; synthetic data draws them);
- `next_token_labels`: the labels are the inputs, shifted by the model (the encoder; the
  synthetic progressions; chat, which trains nothing else);
- `masked_token_labels`: some tokens are masked and predicted (wikitext wraps its blocks in
  [CLS] ... [SEP] for it). The encoder and the synthetic data mask whatever asks for neither
  of the above, as they always have.
"""

from __future__ import annotations

from relaytrain.objectives import objective

IGNORE_INDEX = -100  # label value the losses skip


def class_labels(model) -> bool:
    """Whether each sample carries one class id (classification)."""
    return objective(model.task).classifies


def next_token_labels(model) -> bool:
    """Whether every token predicts the next one (causal LM): the labels are the inputs."""
    return objective(model.task).predicts_next_token


def masked_token_labels(model) -> bool:
    """Whether masked tokens are predicted (masked LM)."""
    return objective(model.task).masks_tokens
