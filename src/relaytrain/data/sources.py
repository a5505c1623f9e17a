"""File and hub data sources (`data.source` = jsonl | glue | wikitext) turned into a `TokenDataset`.

- jsonl: one JSON object per line, holding text (`data.text_field`, "a,b" for a text pair) or
  pre-tokenized `input_ids`, plus `data.label_field` for classification;
- glue: a GLUE task, one sample per row (`data.name` picks the task, e.g. sst2 or mrpc);
- wikitext: raw text for language modelling, concatenated and cut into `data.seq_len` blocks.

glue and wikitext come from a local `datasets` directory when `data.path` is set
(`DatasetDict.save_to_disk`), else from the Hugging Face hub. Every problem a user can fix
(bad line, unreachable hub, wrong task) is a one-line `ConfigError` that names the fix.

Pre-tokenized input without a configured tokenizer follows the synthetic data's ids:
[PAD]=0, [CLS]=1, [SEP]=2, [MASK]=3, [UNK]=4.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.synthetic import FIRST_TOKEN, MASK_ID, MLM_MASK_RATE
from relaytrain.data.tokenizer import find_tokenizer, load_tokenizer
from relaytrain.errors import ConfigError, first_line

IGNORE_INDEX = -100  # label value the losses skip
TOKENIZE_BATCH = 10_000  # lines per tokenizer call when streaming a large corpus
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_MISSING = object()


def load_source(cfg, tokenizer_dir: str | None) -> TokenDataset:
    """The training set for `cfg.data` (see `load_sources`)."""
    return load_sources(cfg, tokenizer_dir)[0]


def load_sources(cfg, tokenizer_dir: str | None) -> tuple[TokenDataset, TokenDataset | None]:
    """The training set for `cfg.data` (source jsonl, glue or wikitext), tokenized for
    `cfg.model`, and the held-out set the source itself names (data.eval_path, data.eval_split),
    encoded with the same tokenizer; None when it names none.

    The tokenizer used for text (configured, or trained here on the training text only) is
    saved to `<tokenizer_dir>/tokenizer` when tokenizer_dir is given, so the run's saved model
    ships with it.
    """
    loaders = {"jsonl": _load_jsonl, "glue": _load_glue, "wikitext": _load_wikitext}
    if cfg.data.source not in loaders:
        raise ConfigError(
            f"data.source={cfg.data.source} is not a file or hub source; use one of {', '.join(loaders)}"
        )
    return loaders[str(cfg.data.source)](cfg, tokenizer_dir)


@dataclass
class Sample:
    """One sample before tokenization; `where` locates it for error messages."""

    where: str
    text: tuple[str, ...] | None = None  # one text, or a pair
    input_ids: list[int] | None = None
    label: int | None = None


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    mask: int | None
    special: tuple[int, ...]  # never chosen for masked-LM prediction


DEFAULT_SPECIAL_IDS = SpecialIds(pad=0, mask=MASK_ID, special=tuple(range(FIRST_TOKEN)))


# --------------------------------------------------------------------------- jsonl


def _load_jsonl(cfg, tokenizer_dir: str | None) -> tuple[TokenDataset, TokenDataset | None]:
    groups = [read_jsonl(cfg)]
    if cfg.data.eval_path:
        groups.append(read_jsonl(cfg, cfg.data.eval_path, "data.eval_path"))
    datasets = encode_samples(cfg, groups, tokenizer_dir)
    return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def read_jsonl(cfg, file: str | None = None, key: str = "data.path") -> list[Sample]:
    """Every non-blank line of `file` (default data.path) as a checked `Sample`."""
    file = file if file is not None else cfg.data.path
    samples = [_parse_line(cfg, line, where) for where, line in read_lines(file, key, cfg.data.source)]
    if not samples:
        raise ConfigError(
            f"{key}={file} holds no samples (the file is empty or blank); write one JSON object per line, "
            f'e.g. {{"{cfg.data.text_field.split(",")[0]}": "...", "{cfg.data.label_field}": 0}}'
        )
    return samples


def read_lines(file: str | None, key: str, source: str) -> list[tuple[str, str]]:
    """Every non-blank line of the JSONL file `key` names, with where it is ("PATH line N")."""
    if not file:
        raise ConfigError(f"data={source} needs a file: set {key}=/path/to/file.jsonl")
    path = Path(file).expanduser()
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(
            f"{key}={file} cannot be read ({e.strerror}); point {key} at a JSONL file"
        ) from e
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        where = f"{path} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text ({e.reason}); save the file as UTF-8") from e
        if line.strip():
            lines.append((where, line))
    return lines


def _parse_line(cfg, line: str, where: str) -> Sample:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: malformed JSON ({e.msg} at column {e.colno}); write one JSON object per line"
        ) from e
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: expected a JSON object, got a {type(record).__name__}; "
            f'write one object per line, e.g. {{"text": "...", "label": 0}}'
        )
    sample = Sample(where)
    if "input_ids" in record:  # pre-tokenized wins over text: it is what the user asked the model to see
        sample.input_ids = _checked_token_ids(record["input_ids"], where, cfg.model.vocab_size)
    else:
        sample.text = _record_text(record, where, cfg.data.text_field)
    if cfg.model.task == "classification":
        value = record.get(cfg.data.label_field, _MISSING)
        sample.label = _checked_label(value, where, cfg.data.label_field, cfg.model.num_labels)
    return sample


def _record_text(record: dict, where: str, text_field: str) -> tuple[str, ...]:
    fields = _text_fields(text_field)
    for field in fields:
        if field not in record:
            raise ConfigError(
                f"{where}: no {field!r} text (data.text_field={text_field}) and no 'input_ids'; "
                f"add the field, or set data.text_field to the key that holds the text"
            )
    return tuple(_checked_text(record[field], where, field) for field in fields)


def _text_fields(text_field: str) -> list[str]:
    fields = [f.strip() for f in text_field.split(",") if f.strip()]
    if not 1 <= len(fields) <= 2:
        raise ConfigError(f"data.text_field={text_field} must name one text field, or two for a pair (a,b)")
    return fields


def _checked_text(value, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where}: {field!r} must be non-empty text, got {_short(value)}; fix or remove the sample"
        )
    return value


def _checked_label(value, where: str, field: str, num_labels: int) -> int:
    if value is _MISSING:
        raise ConfigError(
            f"{where}: no {field!r} label, which model.task=classification needs on every sample; "
            f"add it, or set data.label_field to the key that holds it"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where}: label {_short(value)} is not an integer; give class ids 0..{num_labels - 1}"
        )
    if not 0 <= value < num_labels:
        raise ConfigError(
            f"{where}: label {value} is outside [0, {num_labels}) (model.num_labels={num_labels}); "
            f"fix the label or raise model.num_labels"
        )
    return value


def _checked_token_ids(value, where: str, vocab_size: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(t, bool) or not isinstance(t, int) for t in value)
    ):
        raise ConfigError(f"{where}: input_ids must be a non-empty list of integers, got {_short(value)}")
    for token in value:
        if not 0 <= token < vocab_size:
            raise ConfigError(
                f"{where}: token id {token} is outside [0, {vocab_size}) (model.vocab_size={vocab_size}); "
                f"re-tokenize with the model's vocabulary or raise model.vocab_size"
            )
    return value


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- glue


def _load_glue(cfg, tokenizer_dir: str | None) -> tuple[TokenDataset, TokenDataset | None]:
    splits = [cfg.data.split] + ([cfg.data.eval_split] if cfg.data.eval_split else [])
    datasets = encode_samples(cfg, [_glue_samples(cfg, split) for split in splits], tokenizer_dir)
    return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def _glue_samples(cfg, name: str) -> list[Sample]:
    """The samples of one split (data.split for training, data.eval_split held out)."""
    d = cfg.data
    split = load_split(cfg, "glue", name)
    origin = d.path or f"glue/{d.name}"
    fields = _text_fields(d.text_field)
    wanted = fields + ([d.label_field] if cfg.model.task == "classification" else [])
    _require_columns(split, wanted, origin)
    texts = zip(*(list(split[field]) for field in fields), strict=True)
    labels = list(split[d.label_field]) if cfg.model.task == "classification" else None
    if labels is not None and -1 in set(labels):
        raise ConfigError(
            f"{origin} split={name} is unlabelled (label -1, as in GLUE test splits); "
            f"use split train or validation"
        )
    samples = []
    for row, text in enumerate(texts):
        where = f"{origin} split={name} row {row}"
        sample = Sample(
            where, text=tuple(_checked_text(t, where, f) for t, f in zip(text, fields, strict=True))
        )
        if labels is not None:
            sample.label = _checked_label(labels[row], where, d.label_field, cfg.model.num_labels)
        samples.append(sample)
    if not samples:
        raise ConfigError(f"{origin} split={name} has no rows; pick another split")
    return samples


def _require_columns(split, columns: list[str], origin: str) -> None:
    for column in columns:
        if column not in split.column_names:
            raise ConfigError(
                f"{origin} has no column {column!r} (it has {', '.join(split.column_names)}); "
                f"set data.text_field / data.label_field to its columns, e.g. data.text_field=sentence1,sentence2"
            )


# --------------------------------------------------------------------------- wikitext


def _load_wikitext(cfg, tokenizer_dir: str | None) -> tuple[TokenDataset, TokenDataset | None]:
    d, m = cfg.data, cfg.model
    if m.task == "classification":
        raise ConfigError(
            "data=wikitext has no labels for model.task=classification; "
            "use model.task=masked_lm, or a GPT-2 model (model=gpt2_tiny) for causal_lm"
        )
    fields = _text_fields(d.text_field)
    if len(fields) != 1:
        raise ConfigError(
            f"data.text_field={d.text_field}: wikitext has one text column; use data.text_field=text"
        )
    origin = d.path or f"wikitext/{d.name}"
    lines = [_wikitext_lines(cfg, fields[0], split, origin) for split in [d.split, d.eval_split] if split]
    tokenizer = load_tokenizer(cfg, lines[0], tokenizer_dir)  # trained on the training text only
    specials = special_ids(tokenizer)
    wrap = None
    if m.task == "masked_lm" and tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None:
        wrap = (tokenizer.cls_token_id, tokenizer.sep_token_id)  # BERT blocks read [CLS] ... [SEP]
    datasets = [
        with_labels(cfg, chunk_blocks(_token_stream(tokenizer, text), d.seq_len, wrap, f"{origin} split={split}"),
                    None, specials, None)
        for text, split in zip(lines, [d.split, d.eval_split], strict=False)
    ]
    return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def _wikitext_lines(cfg, field: str, name: str, origin: str) -> list[str]:
    split = load_split(cfg, "wikitext", name)
    _require_columns(split, [field], origin)
    lines = [line for line in split[field] if isinstance(line, str) and line.strip()]
    if not lines:
        raise ConfigError(f"{origin} split={name} holds no text; pick another split")
    return lines


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


# --------------------------------------------------------------------------- hub / local datasets


def load_split(cfg, hub_name: str, split: str):
    """The `datasets.Dataset` for `split` (data.split or data.eval_split): from data.path when set,
    else from the hub."""
    d = cfg.data
    key = "data.split" if split == d.split else "data.eval_split"
    if d.path:
        return _split_from_disk(d.path, split, key)
    return _split_from_hub(hub_name, d.name, split)


def _split_from_disk(path: str, split: str, key: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except FileNotFoundError as e:
        raise ConfigError(
            f"data.path={path} is not a `datasets` directory ({first_line(e)}); "
            f"write one with DatasetDict.save_to_disk, or use data=jsonl"
        ) from e
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded  # a single saved Dataset is the split
    if split not in loaded:
        raise ConfigError(
            f"data.path={path} has no split {split!r}; set {key} to one of {', '.join(loaded)}"
        )
    return loaded[split]


def _split_from_hub(hub_name: str, name: str | None, split: str):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    dataset = f"{hub_name}/{name}" if name else hub_name
    # datasets reads the offline variables once, at import: when they were set later it would
    # still go to the network (and retry for tens of seconds), so refuse at once instead.
    if _offline_requested() and not datasets.config.HF_HUB_OFFLINE:
        raise ConfigError(_unreachable(dataset, "offline mode is set"))
    try:
        return datasets.load_dataset(hub_name, name, split=split)
    except (ConnectionError, TimeoutError) as e:  # includes offline mode with nothing cached
        raise ConfigError(_unreachable(dataset, first_line(e))) from e
    except DatasetNotFoundError as e:
        raise ConfigError(f"{dataset} was not found on the Hugging Face hub; check data.name") from e
    except (OSError, ValueError) as e:  # unknown config name or split, broken cache
        raise ConfigError(
            f"cannot load {dataset} split={split} ({first_line(e)}); check data.name and data.split"
        ) from e


def _offline_requested() -> bool:
    return any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") for var in OFFLINE_VARS)


def _unreachable(dataset: str, why: str) -> str:
    return (
        f"the Hugging Face hub is unreachable for {dataset} ({why}); set data.path=<local datasets dir> "
        f"(written by DatasetDict.save_to_disk) or use data=jsonl data.path=<file.jsonl>"
    )


# --------------------------------------------------------------------------- encoding


def encode_samples(cfg, groups: list[list[Sample]], tokenizer_dir: str | None) -> list[TokenDataset]:
    """Each group of samples (training, then held-out) -> padded tensors with labels for
    cfg.model.task, one sample per row, all with one tokenizer: the configured one, or one
    trained on the first group's text."""
    texts = [s.text for s in groups[0] if s.input_ids is None]
    if texts or any(s.input_ids is None for group in groups[1:] for s in group):
        tokenizer = load_tokenizer(cfg, (t for text in texts for t in text), tokenizer_dir)
    else:
        tokenizer = find_tokenizer(cfg)  # only for its special ids: pre-tokenized data needs no training
    return [_encode(cfg, samples, tokenizer) for samples in groups]


def _encode(cfg, samples: list[Sample], tokenizer) -> TokenDataset:
    texts = [s.text for s in samples if s.input_ids is None]
    encoded = iter(_tokenize(tokenizer, texts, cfg.data.seq_len) if texts else [])
    rows = [s.input_ids[: cfg.data.seq_len] if s.input_ids is not None else next(encoded) for s in samples]
    specials = special_ids(tokenizer)
    ids, attention = pad_rows(rows, cfg.data.seq_len, specials.pad)
    labels = [s.label for s in samples] if cfg.model.task == "classification" else None
    return with_labels(cfg, ids, attention, specials, labels)


def _tokenize(tokenizer, texts: list[tuple[str, ...]], seq_len: int) -> list[list[int]]:
    columns = [list(column) for column in zip(*texts, strict=True)]
    return tokenizer(*columns, truncation=True, max_length=seq_len)["input_ids"]


def special_ids(tokenizer) -> SpecialIds:
    """Pad, mask and special ids of `tokenizer`; the synthetic data's ids when there is none."""
    if tokenizer is None:
        return DEFAULT_SPECIAL_IDS
    pad = tokenizer.pad_token_id
    if pad is None:  # GPT-2 checkpoints have no pad token; the mask and -100 labels hide padding anyway
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return SpecialIds(pad=pad, mask=tokenizer.mask_token_id, special=tuple(tokenizer.all_special_ids))


def pad_rows(rows: list[list[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, seq_len] ids and the attention mask (1 = real token), None when nothing is padded."""
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    lengths = torch.tensor([min(len(row), seq_len) for row in rows], dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : lengths[i]] = torch.tensor(row[:seq_len], dtype=torch.long)
    attention = (torch.arange(seq_len) < lengths[:, None]).long()
    return ids, None if bool(attention.all()) else attention


def with_labels(cfg, ids, attention, specials: SpecialIds, class_labels: list[int] | None) -> TokenDataset:
    """The dataset with labels for cfg.model.task."""
    task = cfg.model.task
    if task == "classification":
        return TokenDataset(ids, torch.tensor(class_labels, dtype=torch.long), attention)
    if task == "causal_lm":
        return TokenDataset(ids, causal_labels(ids, attention), attention)
    if specials.mask is None:
        raise ConfigError("model.task=masked_lm needs a tokenizer with a mask token; this one has none")
    masked, labels = mask_tokens(ids, attention, specials, cfg.data.seed)
    return TokenDataset(masked, labels, attention)


def causal_labels(ids: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
    """Labels are the inputs (the model shifts them); padding is ignored by position, not by id,
    because GPT-2 pads with its end-of-text token."""
    labels = ids.clone()
    if attention is not None:
        labels[attention == 0] = IGNORE_INDEX
    return labels


def mask_tokens(
    ids: torch.Tensor, attention: torch.Tensor | None, specials: SpecialIds, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM inputs and labels: MLM_MASK_RATE of the real (non-pad, non-special) tokens,
    drawn from `seed`, become the mask id; labels are -100 elsewhere. Every sample predicts at
    least one token, so no micro-batch row has an empty loss."""
    generator = torch.Generator().manual_seed(seed)
    present = torch.ones_like(ids, dtype=torch.bool) if attention is None else attention.bool()
    real = present & ~torch.isin(ids, torch.tensor(specials.special, dtype=torch.long))
    scores = torch.rand(ids.shape, generator=generator)
    chosen = real & (scores < MLM_MASK_RATE)
    # A row with nothing drawn predicts its lowest-scoring real token (any present one if it has none).
    candidates = torch.where(real.any(dim=1, keepdim=True), real, present)
    fallback = torch.where(candidates, scores, torch.inf).argmin(dim=1)
    empty = ~chosen.any(dim=1)
    chosen[empty, fallback[empty]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return torch.where(chosen, torch.full_like(ids, specials.mask), ids), labels
