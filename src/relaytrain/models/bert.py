"""BERT as a layered model: BertEmbeddings -> BertLayer x N -> pooler+classifier or MLM head."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig
from transformers.masking_utils import create_bidirectional_mask

from relaytrain.models.family import BlockShape, Family, register_family
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.objectives.base import Objective
from relaytrain.objectives.cross_entropy import Classification, MaskedLM


class BertEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids)


class BertClassifierHead(nn.Module):
    """Pooler (first token, dense, tanh) -> dropout -> classifier, as BertForSequenceClassification."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


class BertMLMHead(nn.Module):
    def __init__(self, cls: nn.Module):
        super().__init__()
        self.cls = cls

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls(hidden)


class LayeredBert(LayeredModel):
    family = "bert"

    def __init__(self, hf_model: nn.Module, objective: Objective):
        bert = hf_model.bert
        if objective.classifies:
            head = BertClassifierHead(bert.pooler, hf_model.dropout, hf_model.classifier)
        else:
            head = BertMLMHead(hf_model.cls)
        super().__init__(hf_model, BertEmbed(bert.embeddings), list(bert.encoder.layer), head, objective)

    def shared_context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        mask = create_bidirectional_mask(config=self.hf_config, inputs_embeds=hidden, attention_mask=mb.attention_mask)
        return {"attention_mask": mask}

    def tied_parameters(self) -> list[tuple[str, str]]:
        if self.objective.classifies:
            return []
        return [("embed.embeddings.word_embeddings.weight", "head.cls.predictions.decoder.weight")]


# --------------------------------------------------------------------------- the family spec


def _hf_config(m) -> BertConfig:
    return BertConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_seq_len,
        hidden_dropout_prob=m.dropout,
        attention_probs_dropout_prob=m.dropout,
        num_labels=m.num_labels,
        attn_implementation=m.attn_implementation,
    )


def _facts(c) -> dict:
    return {"num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "num_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size, "max_seq_len": c.max_position_embeddings,
            "dropout": c.hidden_dropout_prob}



# Megatron's split of a BERT layer over the tensor ranks (`placement/tensor_parallel.py`): the query,
# key, value and intermediate projections column-wise (whole heads, a share of the MLP's width),
# the attention's and the layer's output projections row-wise; the layer norms and the hidden
# dropout after each output projection act on whole (replicated) tensors.
TP_PLAN = {"attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
           "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}


register_family(Family(
    name="bert", layered=LayeredBert, objectives=(Classification, MaskedLM), tokenizer="wordpiece",
    hf_config=_hf_config, facts=_facts, block_shape=BlockShape.multi_head,
    refuses=lambda c: None if c.model_type == "bert" else "not bert",
    dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob"), tp_plan=lambda c: TP_PLAN,
    description="BERT (classification, masked LM)",
))
