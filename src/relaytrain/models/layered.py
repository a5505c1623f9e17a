"""The layered model: `embed -> blocks[0..N) -> head(loss)` over a Hugging Face model.

Every strategy works on this abstraction. The parts share their parameters with the wrapped
Hugging Face model (nothing is copied), so the math is the model's own and
`hf_model.save_pretrained` writes the trained weights under their usual names.

Losses are returned as *sums* together with the number of items they sum over: a strategy
divides by the item count of the whole minibatch, which makes micro-batched accumulation
exactly the full batch's mean loss even when micro-batches hold different numbers of
tokens.
"""

from __future__ import annotations

import inspect
from abc import ABCMeta, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from relaytrain.evaluation import EvalStats

# The mask builders' "no KV cache" argument: `cache=None` from transformers 5.24 on, where
# `past_key_values` is deprecated; `past_key_values=None` before (the GPU images carry 5.17).
NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [batch, seq] int64
    labels: torch.Tensor  # [batch] for classification, [batch, seq] for LM (-100 = ignore)
    attention_mask: torch.Tensor | None = None  # [batch, seq], 1 = real token
    # [batch, seq]: each token's position in its own record, set when records are packed into
    # one row (positions restart at 0 where a record starts; decoders then keep records apart).
    position_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        moved = {
            f.name: None if (t := getattr(self, f.name)) is None else t.to(device, non_blocking=non_blocking)
            for f in fields(self)
        }
        return MicroBatch(**moved)

    def rows(self, index: slice) -> MicroBatch:
        """These rows of every tensor (a replica's share of a micro-batch)."""
        return MicroBatch(**{f.name: None if (t := getattr(self, f.name)) is None else t[index] for f in fields(self)})

    def pin_memory(self) -> MicroBatch:
        pinned = {f.name: None if (t := getattr(self, f.name)) is None else t.pin_memory() for f in fields(self)}
        return MicroBatch(**pinned)

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel() if self.attention_mask is None else int(self.attention_mask.sum())


class Block(nn.Module):
    """One transformer layer with a uniform call: `block(hidden, ctx) -> hidden`.

    `ctx` holds what every block of a micro-batch shares (the attention mask), computed once
    per micro-batch by `LayeredModel.context`. A family whose blocks differ in what they take
    from it (a decoder's sliding-window and full-attention layers) brings its own subclass
    (`LayeredModel.block_class`).
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        out = self.layer(hidden, **ctx)
        return out[0] if isinstance(out, tuple) else out


class LayeredModel(nn.Module, metaclass=ABCMeta):
    """A Hugging Face model seen as embed -> blocks -> head.

    Subclasses (one per model family) provide the parts and two small functions: `context`
    (per-micro-batch inputs of the blocks) and `logits` (the head's output), plus `targets`
    where the labels are not aligned with the logits as they come (GPT-2 predicts the next
    token). The loss, its item count and the evaluation sums follow from those.
    """

    family: str = ""
    block_class: type[Block] = Block
    # Whether `context` keeps records packed into one row apart by `MicroBatch.position_ids`.
    packs_records: bool = False

    def __init__(self, hf_model: nn.Module, embed: nn.Module, blocks: list[nn.Module], head: nn.Module, task: str):
        super().__init__()
        # Kept outside the module tree: its parameters are reachable through the parts,
        # and registering it too would list every parameter under two names.
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "hf_config", hf_model.config)
        # Hugging Face names, fixed before any strategy splits the model (tied weights: the first name).
        object.__setattr__(self, "_hf_names", {id(p): n for n, p in hf_model.named_parameters()})
        self.embed = embed
        self.blocks = nn.ModuleList(self.block_class(layer) for layer in blocks)
        self.head = head
        self.task = task

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    # -- per-family hooks -------------------------------------------------------------
    @abstractmethod
    def context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        """What every block of this micro-batch shares (the attention mask)."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits for the last block's output."""

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels aligned item by item with `logits` (-100: no item); GPT-2 shifts them."""
        return labels

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed loss of the micro-batch (fp32)."""
        return sum_cross_entropy(self.logits(hidden), self.targets(labels))

    def eval_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> EvalStats:
        """The evaluation sums of one micro-batch (loss, items, correct, confusion)."""
        return EvalStats.of(self.logits(hidden), self.targets(labels), self.num_labels)

    def loss_items(self, labels: torch.Tensor) -> int:
        """How many items `head_loss` sums over."""
        return int((self.targets(labels) != -100).sum())

    @property
    def num_labels(self) -> int | None:
        """Classes of a classification head; None for language models."""
        return self.hf_config.num_labels if self.task == "classification" else None

    def hf_name(self, param: torch.Tensor) -> str:
        return self._hf_names[id(param)]

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Pairs of (embed parameter name, head parameter name) that are one tensor."""
        return []

    # -- whole-model helpers ------------------------------------------------------------
    def forward(self, mb: MicroBatch, loss_items: int | None = None) -> torch.Tensor:
        """Loss of one micro-batch divided by `loss_items` (default: its own item count)."""
        hidden = self.embed(mb.input_ids)
        ctx = self.context(mb, hidden)
        for block in self.blocks:
            hidden = block(hidden, ctx)
        items = self.loss_items(mb.labels) if loss_items is None else loss_items
        return self.head_loss(hidden, mb.labels) / items

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over items, in fp32 like Hugging Face's losses; -100 is ignored."""
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


@contextmanager
def eval_mode(module: nn.Module):
    """Dropout off while evaluating; the module's training flag restored afterwards."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)
