"""`data=glue`: a GLUE task, one sample per row (`data.name` picks the task, e.g. sst2 or mrpc),
from a local `datasets` directory (data.path) or the Hugging Face hub; held out: its own split
(data.eval_split, e.g. validation)."""

from __future__ import annotations

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import encode_samples
from relaytrain.data.reading import load_split, require_columns
from relaytrain.data.samples import Sample, checked_label, checked_text, text_fields
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.utils.errors import ConfigError


@register_source("glue")
class GlueSource(DataSource):
    origin = Origin.hub
    hub_dataset = "glue"  # the hub's name for it

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        splits = [cfg.data.split] + ([cfg.data.eval_split] if cfg.data.eval_split else [])
        datasets = encode_samples(cfg, [cls.samples(cfg, split, labels.class_labels(objective)) for split in splits],
                                  tokenizer_dir, objective, family)
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)

    @classmethod
    def benchmark_task(cls, name: str | None) -> str | None:
        return name  # the GLUE task is the dataset's name (sst2, mrpc, ...)

    @classmethod
    def samples(cls, cfg, name: str, labelled: bool) -> list[Sample]:
        """The samples of one split (data.split for training, data.eval_split held out), each with
        its class id when `labelled` (the run's objective classifies)."""
        d = cfg.data
        split = load_split(cfg, cls.hub_dataset, name)
        origin = d.path or f"{cls.hub_dataset}/{d.name}"
        fields = text_fields(d.text_field)
        require_columns(split, fields + ([d.label_field] if labelled else []), origin)
        texts = zip(*(list(split[field]) for field in fields), strict=True)
        class_ids = list(split[d.label_field]) if labelled else None
        if class_ids is not None and -1 in set(class_ids):
            raise ConfigError(
                f"{origin} split={name} is unlabelled (label -1, as in GLUE test splits); "
                f"use split train or validation"
            )
        samples = []
        for row, text in enumerate(texts):
            where = f"{origin} split={name} row {row}"
            sample = Sample(
                where, text=tuple(checked_text(t, where, f) for t, f in zip(text, fields, strict=True))
            )
            if class_ids is not None:
                sample.label = checked_label(class_ids[row], where, d.label_field, cfg.model.num_labels)
            samples.append(sample)
        if not samples:
            raise ConfigError(f"{origin} split={name} has no rows; pick another split")
        return samples
