"""GPT-2 as a layered model: wte+wpe -> GPT2Block x N -> ln_f + LM head (tied to wte)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config
from transformers.masking_utils import create_causal_mask

from relaytrain.models.family import BlockShape, Family, register_family
from relaytrain.models.layered import NO_CACHE, LayeredModel, MicroBatch
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.utils.errors import ConfigError


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

    def shared_context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        # No position ids: they would only let Hugging Face look for packed sequences (a check
        # that reads values, which a dry run on the meta device has not), and samples are never packed.
        mask = create_causal_mask(
            config=self.hf_config,
            inputs_embeds=hidden,
            attention_mask=mb.attention_mask,
            **NO_CACHE,
            position_ids=None,
        )
        return {"attention_mask": mask}

    def tied_parameters(self) -> list[tuple[str, str]]:
        return [("embed.wte.weight", "head.lm_head.weight")]


# --------------------------------------------------------------------------- the family spec


def _hf_config(m) -> GPT2Config:
    return GPT2Config(
        vocab_size=m.vocab_size,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_inner=m.intermediate_size,
        n_positions=m.max_seq_len,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        # GPT-2's <|endoftext|> is id 50256; a smaller vocabulary keeps it as its last id.
        bos_token_id=m.vocab_size - 1,
        eos_token_id=m.vocab_size - 1,
        attn_implementation=m.attn_implementation,
    )


def _facts(c) -> dict:
    return {"num_layers": c.n_layer, "hidden_size": c.n_embd, "num_heads": c.n_head,
            "intermediate_size": c.n_inner or 4 * c.n_embd, "max_seq_len": c.n_positions, "dropout": c.resid_pdrop}



def _no_tp_plan(c):
    raise ConfigError("strategy.tensor_parallel: GPT-2 packs its query, key and value projections into one Conv1D "
                      "(c_attn), which a column split would cut across them; set strategy.tensor_parallel=1")


register_family(Family(
    name="gpt2", layered=LayeredGPT2, objectives=(CausalLM,), tokenizer="byte_bpe",
    hf_config=_hf_config, facts=_facts, block_shape=BlockShape.multi_head,
    refuses=lambda c: None if c.model_type == "gpt2" else "not gpt2",
    dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop"), tp_plan=_no_tp_plan,
    description="GPT-2 (causal LM)",
))
