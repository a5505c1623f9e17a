"""BERT as a layered model: BertEmbeddings -> BertLayer x N -> pooler+classifier or MLM head."""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask

from relaytrain.models.layered import LayeredModel, MicroBatch


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

    def __init__(self, hf_model: nn.Module, task: str):
        bert = hf_model.bert
        if task == "classification":
            head = BertClassifierHead(bert.pooler, hf_model.dropout, hf_model.classifier)
        else:
            head = BertMLMHead(hf_model.cls)
        super().__init__(hf_model, BertEmbed(bert.embeddings), list(bert.encoder.layer), head, task)

    def context(self, mb: MicroBatch, hidden: torch.Tensor) -> dict:
        mask = create_bidirectional_mask(config=self.hf_config, inputs_embeds=hidden, attention_mask=mb.attention_mask)
        return {"attention_mask": mask}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def tied_parameters(self) -> list[tuple[str, str]]:
        if self.task == "classification":
            return []
        return [("embed.embeddings.word_embeddings.weight", "head.cls.predictions.decoder.weight")]
