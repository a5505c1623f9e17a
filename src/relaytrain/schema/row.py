"""A row's fields, defined once: what a training row carries from the data to the loss.

Every place that holds rows derives its fields from `FIELDS`: the dataset (`data.dataset.
TokenDataset`), the micro-batch (`models.layered.MicroBatch`, with its `.to()`, `.rows()`,
`.pin_memory()`), the loaders (in memory and streamed), the rows filling an evaluation
micro-batch, and the tokenize cache's stored sets. Both classes get the fields through
`with_row_fields`. So a new kind of row (a preference pair's rejected ids and labels, a rollout's
advantages) is a `Field` added here, plus the code that fills it (a data source) and the code
that reads it (an objective); nothing between them names the fields.

A new field is optional (None where a set has none), so every set made before it still is one;
the required fields come first, so that `MicroBatch(ids, labels, mask)` keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

IGNORE_INDEX = -100  # a label the losses skip


class Per(Enum):
    """What one value of a field belongs to."""

    TOKEN = "[rows, seq]"
    ROW = "[rows]"
    TASK = "[rows, seq] or [rows]"  # per token for the language-model tasks, per row for classification


@dataclass(frozen=True)
class Field:
    """One field of a row.

    `pad`: a padding token's value (a row's unused tail, a sequence cut to equal parts), None
    where the code that pads makes it (the tokenizer's pad id; positions of a segment of their
    own). `target`: the loss reads it, the model does not; a row added only to fill up a
    micro-batch takes `pad` in every target field, so it counts nowhere, and copies a real row's
    inputs, so the forward sees nothing unusual."""

    name: str
    holds: str
    per: Per
    dtype: torch.dtype = torch.long
    optional: bool = False
    pad: int | float | None = None
    target: bool = False

    @property
    def annotation(self) -> str:
        return "torch.Tensor | None" if self.optional else "torch.Tensor"

    def fits(self, tensor: torch.Tensor, rows: int, seq_len: int) -> bool:
        """Whether `tensor` has this field's shape in a set of `rows` rows of `seq_len` tokens."""
        token, row = tuple(tensor.shape) == (rows, seq_len), tuple(tensor.shape) == (rows,)
        return {Per.TOKEN: token, Per.ROW: row, Per.TASK: token or row}[self.per]


FIELDS: tuple[Field, ...] = (
    Field("input_ids", "token ids (masked-LM: the drawn tokens replaced by the mask id)", Per.TOKEN),
    Field("labels", "what each token (classification: the row) is scored against; -100 where nothing is",
          Per.TASK, pad=IGNORE_INDEX, target=True),
    Field("attention_mask", "1 for a real token, 0 for padding; None where no row is padded", Per.TOKEN,
          optional=True, pad=0),
    # Hugging Face's decoders keep packed records apart by these positions (with no attention mask).
    Field("position_ids", "each token's position in its own record, restarting at 0 where a packed record "
          "starts; None where rows are not packed", Per.TOKEN, optional=True),
    # A preference objective's reference (objectives/preference.py), computed once before training.
    Field("ref_logps", "the reference model's log-prob of the row's labelled tokens; None without a reference",
          Per.ROW, dtype=torch.float32, optional=True, pad=0.0, target=True),
    # KTO's label (objectives/kto.py): an unpaired example's, carried by its row and its KL row.
    Field("desirable", "1 where the row's example is desirable, 0 where it is undesirable (KTO's label); None "
          "for other data", Per.ROW, optional=True, pad=0, target=True),
    # A reward model's pair margin (objectives/reward.py; TRL's `margin` column): on both rows of the pair.
    Field("margin", "how far the pair's chosen score should exceed its rejected one's (TRL's margin); None "
          "for data without one", Per.ROW, dtype=torch.float32, optional=True, pad=0.0, target=True),
    # A prompt's record (data=prompts): where the rollout stage finds the prompt as written and the
    # columns the rewards read (`TokenDataset.records`).
    # A target, so a row that only fills up a micro-batch has none (-1) and counts nowhere.
    Field("record", "the row's record number in its set's `records` (data=prompts, and the rollouts made of "
          "them); None for other data", Per.ROW, optional=True, pad=-1, target=True),
    # A rollout's (objectives/grpo.py): made by the rollout stage from the policy's completions.
    Field("advantage", "the completion's advantage over its group (GRPO); None for other data", Per.ROW,
          dtype=torch.float32, optional=True, pad=0.0, target=True),
    Field("old_logps", "each completion token's log-prob under the policy that sampled it (GRPO with "
          "num_iterations > 1); None where the loss takes the policy's own, detached", Per.TOKEN,
          dtype=torch.float32, optional=True, pad=0.0, target=True),
    Field("ref_token_logps", "each completion token's log-prob under the reference (GRPO's KL term, beta > 0); "
          "None without one", Per.TOKEN, dtype=torch.float32, optional=True, pad=0.0, target=True),
)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in FIELDS)


def check_fields(fields: tuple[Field, ...]) -> None:
    """What the classes built from `fields` rely on: distinct names, input_ids first (it gives
    the rows and the sequence length), the required fields before the optional ones (positional
    construction), and a pad value for every target (the filling rows take it)."""
    seen = [f.name for f in fields]
    if len(set(seen)) != len(seen) or seen[:1] != ["input_ids"]:
        raise ValueError(f"a row's fields need distinct names, input_ids first: {seen}")
    optional = [f.optional for f in fields]
    if optional != sorted(optional):
        raise ValueError(f"a row's required fields come before its optional ones: {seen}")
    if unpadded := [f.name for f in fields if f.target and f.pad is None]:
        raise ValueError(f"a target field needs a pad value (what a filling row holds): {unpadded}")


def with_row_fields(cls: type) -> type:
    """`cls` as a dataclass whose fields are the row's (`FIELDS`, in order; None by default where
    optional) followed by its own, which need defaults."""
    check_fields(FIELDS)
    own = dict(cls.__dict__.get("__annotations__", {}))
    if clash := [f.name for f in FIELDS if f.name in own]:
        raise TypeError(f"{cls.__name__} declares the row's fields {clash}; schema/row.py defines them")
    cls.__annotations__ = {**{f.name: f.annotation for f in FIELDS}, **own}
    for f in FIELDS:
        if f.optional:
            setattr(cls, f.name, None)
    return dataclass(cls)


def row_values(holder) -> dict[str, torch.Tensor | None]:
    """Every row field of `holder` (a dataset, a micro-batch) by name."""
    return {f.name: getattr(holder, f.name) for f in FIELDS}

