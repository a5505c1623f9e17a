"""GPT-2 as a layered model: wte+wpe -> GPT2Block x N -> ln_f + LM head (tied to wte)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from relaytrain.models.layered import LayeredModel, MicroBatch


class GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2Head(nn.Module):
    """Final layer norm and LM head. `lm_head.weight` *is* `wte.weight`: the tie is kept."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class LayeredGPT2(LayeredModel):
    family = "gpt2"

    def __init__(self, hf_model: nn.Module, task: str):
        t = hf_model.transformer
        super().__init__(hf_model, GPT2Embed(t.wte, t.wpe, t.drop), list(t.h), GPT2Head(t.ln_f, hf_model.lm_head), task)

    def context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        # No position ids: they would only let Hugging Face look for packed sequences (a check
        # that reads values, which a dry run on the meta device has not), and samples are never packed.
        mask = create_causal_mask(
            config=self.hf_config,
            inputs_embeds=hidden,
            attention_mask=mb.attention_mask,
            past_key_values=None,
            position_ids=None,
        )
        return {"attention_mask": mask}

    # Tokens < n predict token n, as in Hugging Face's causal LM loss.
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)[:, :-1]

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[:, 1:]

    def tied_parameters(self) -> list[tuple[str, str]]:
        return [("embed.wte.weight", "head.lm_head.weight")]
