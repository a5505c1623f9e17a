"""`data=wikitext`: raw text for language modelling, concatenated and cut into `data.seq_len`
blocks, from a local `datasets` directory (data.path) or the Hugging Face hub; held out: its own
split (data.eval_split, e.g. validation)."""

from __future__ import annotations

import torch

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import special_ids, with_labels
from relaytrain.data.reading import load_split, require_columns
from relaytrain.data.samples import text_fields
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.utils.errors import ConfigError

TOKENIZE_BATCH = 10_000  # lines per tokenizer call when streaming a large corpus


@register_source("wikitext")
class WikitextSource(DataSource):
    origin = Origin.hub
    hub_dataset = "wikitext"  # the hub's name for it

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        d = cfg.data
        if labels.class_labels(objective):
            raise ConfigError(
                "data=wikitext has no labels for model.task=classification; "
                "use model.task=masked_lm, or a GPT-2 model (model=gpt2_tiny) for causal_lm"
            )
        fields = text_fields(d.text_field)
        if len(fields) != 1:
            raise ConfigError(
                f"data.text_field={d.text_field}: wikitext has one text column; use data.text_field=text"
            )
        origin = d.path or f"{cls.hub_dataset}/{d.name}"
        splits = [split for split in [d.split, d.eval_split] if split]
        lines = [cls.lines(cfg, fields[0], split, origin) for split in splits]
        tokenizer = load_tokenizer(cfg, lines[0], tokenizer_dir, family)  # trained on the training text only
        specials = special_ids(tokenizer)
        wrap = _cls_sep(tokenizer) if labels.masked_token_labels(objective) else None
        datasets = []
        for text, split in zip(lines, splits, strict=True):
            blocks = chunk_blocks(_token_stream(tokenizer, text), d.seq_len, wrap, f"{origin} split={split}")
            dataset = with_labels(cfg, blocks, None, specials, None, objective)
            # Lines run on into each other: none is cut or dropped, only the last partial block is.
            dataset.facts = {"records": len(text), "tokens": blocks.numel(), "truncated": 0, "dropped": 0}
            datasets.append(dataset)
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)

    @classmethod
    def lines(cls, cfg, field: str, name: str, origin: str) -> list[str]:
        """The non-blank lines of one split."""
        split = load_split(cfg, cls.hub_dataset, name)
        require_columns(split, [field], origin)
        lines = [line for line in split[field] if isinstance(line, str) and line.strip()]
        if not lines:
            raise ConfigError(f"{origin} split={name} holds no text; pick another split")
        return lines


def _cls_sep(tokenizer) -> tuple[int, int] | None:
    """BERT's blocks read [CLS] ... [SEP]: the two ids, when the tokenizer has both."""
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        return None
    return tokenizer.cls_token_id, tokenizer.sep_token_id


def _token_stream(tokenizer, lines: list[str]) -> torch.Tensor:
    """All lines' tokens end to end, without special tokens (blocks get theirs when cut)."""
    pieces = []
    for start in range(0, len(lines), TOKENIZE_BATCH):
        encoded = tokenizer(lines[start : start + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]
        pieces.append(torch.tensor([t for ids in encoded for t in ids], dtype=torch.long))
    return torch.cat(pieces)


def chunk_blocks(
    stream: torch.Tensor, seq_len: int, wrap: tuple[int, int] | None, origin: str
) -> torch.Tensor:
    """`stream` cut into full [seq_len] blocks (the ragged tail is dropped, so nothing is padded);
    `wrap` = (cls, sep) puts each block between those tokens."""
    body = seq_len - (2 if wrap else 0)
    if body < 1:
        raise ConfigError(
            f"data.seq_len={seq_len} leaves no room for text between [CLS] and [SEP]; raise data.seq_len"
        )
    count = stream.numel() // body
    if count == 0:
        raise ConfigError(
            f"{origin} has {stream.numel()} tokens, less than one block of data.seq_len={seq_len}; "
            f"lower data.seq_len or use more text"
        )
    blocks = stream[: count * body].view(count, body)
    if wrap:
        cls, sep = (torch.full((count, 1), token, dtype=torch.long) for token in wrap)
        blocks = torch.cat([cls, blocks, sep], dim=1)
    return blocks
