"""A decoder's heads: the causal LM's (`DecoderHead`) and the sequence classifier's
(`DecoderScoreHead`, a reward model's with one label: `objective=reward`; `model.task=classification`).

The sequence classifier is transformers' `GenericForSequenceClassification`
(`LlamaForSequenceClassification`, `Qwen3MoeForSequenceClassification`, ...): the final norm,
then `score`, a linear layer of `num_labels` outputs, read at one token of each row: the
rightmost whose id is not `config.pad_token_id`. A row padded on the right with that id is
scored at its last real token; a row whose own last token is the pad id too (a tokenizer without
a pad token pads with its eos, as TRL's trainers do) is scored at the token before it, as
transformers and TRL score it. The norm and `score` act token by token, so the head runs on
the scored tokens alone (`scored_tokens`): the same values, without a [rows, seq, labels]
output of which one token a row is kept. It has none of the scalars some types put on their LM
logits (transformers' classifier has none either).
"""

from __future__ import annotations

import torch
from torch import nn


class DecoderHead(nn.Module):
    """Final norm and LM head, then the type's scalars on the logits in Hugging Face's order: a
    multiplier (Cohere), a divisor (Granite), soft-capping (Gemma 2)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, softcap: float | None = None,
                 multiplier: float | None = None, divisor: float | None = None):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.softcap, self.multiplier, self.divisor = softcap, multiplier, divisor

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class DecoderScoreHead(nn.Module):
    """Final norm and the `score` layer: [..., hidden] -> [..., num_labels]; the decoder hands it
    each row's scored token (`scored_tokens`)."""

    def __init__(self, norm: nn.Module, score: nn.Linear):
        super().__init__()
        self.norm, self.score = norm, score

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(self.norm(hidden))


def scored_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_id: int | None) -> torch.Tensor:
    """Each row's scored position [rows]: transformers' rightmost token that is not `pad_id`,
    among the real ones (the attention mask; the same tokens wherever padding carries `pad_id`).
    Without a pad id, the last real token: what transformers scores in a row without padding,
    the only rows it scores then."""
    scored = torch.ones_like(input_ids, dtype=torch.bool) if pad_id is None else input_ids != pad_id
    if attention_mask is not None:
        scored = scored & attention_mask.bool()
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * scored).argmax(-1)


def scored_tokens(hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  pad_id: int | None) -> torch.Tensor:
    """The last block's output at each row's scored position: [rows, seq, hidden] -> [rows, hidden]."""
    positions = scored_positions(input_ids, attention_mask, pad_id).to(hidden.device)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), positions]
