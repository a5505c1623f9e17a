"""`data=preference`: preference pairs (a prompt, a chosen and a rejected completion; TRL's forms,
text or conversations, the prompt explicit or implicit) at data.path in any form `reading.py`
takes, or mixed from several (data.mix); held out: data.eval_path (or data.eval_split of a
`datasets` directory or hub dataset). Tokenized as TRL's DPOTrainer does, into two rows a pair
(`rows_per_item=2`), for an objective that compares them. The records, their tokenizing and
rows are `data/preference.py`'s.

The same source reads KTO's unpaired examples (`prompt`/`completion`/`label`) for an objective that
trains on them (`Objective.unpaired`), pairs too, unpaired as TRL's KTOTrainer does: one source
because TRL's forms are one family told apart by their keys, and the objective, not the file,
decides the rows (a pair is two rows for DPO, two examples for KTO). Each example's KL row takes its
micro-batch neighbour's completion, paired here for strategy.microbatch_size; so, as TRL requires,
the examples are read in file order (data.shuffle=false), in micro-batches of at least two, and
none drawn out of the training set (data.eval_fraction), each of which would break those pairs."""

from __future__ import annotations

import copy

from omegaconf import OmegaConf

from relaytrain.data.cpo_tokens import encode_cpo_pairs
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mixture import training_records
from relaytrain.data.preference import Example, Pair, encode_examples, encode_pairs, read_examples, read_pairs
from relaytrain.data.reading import read_records
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.utils.errors import ConfigError

PAIR_ROWS = 2  # a pair's rows: its chosen, then its rejected


@register_source("preference")
class PreferenceSource(DataSource):
    origin = Origin.file
    gives_pairs = True
    chat_template = True  # conversations are rendered with it; it decides which tokenizer is used (and keyed)

    @classmethod
    def check(cls, cfg, objective) -> None:
        if cfg.data.pack:  # before the base's rule, whose fix (data=chat) is no fix for pairs
            raise ConfigError("data.pack=true packs records into rows; data=preference keeps each pair's chosen and "
                              "rejected rows whole and side by side, never packed: drop data.pack")
        super().check(cfg, objective)
        check_compares_pairs(objective)
        if objective.unpaired:
            check_kl_pairs(cfg.data.shuffle, cfg.strategy.microbatch_size, cfg.data.eval_fraction)

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        """The training pairs (data.path or data.mix) and the held-out ones (None without any),
        tokenized with one tokenizer: the configured one, or one trained on the training pairs."""
        check_compares_pairs(objective)
        d = cfg.data
        read = read_examples if objective.unpaired else read_pairs
        train, mix = training_records(cfg, lambda *where: _read(d, read, *where))
        groups = [("data.mix" if mix else "data.path", train), *_held_out(d, read)]
        tokenizer = _tokenizer(cfg, [pair for _, pairs in groups for pair in pairs], tokenizer_dir, family)
        if objective.unpaired:  # each example's KL row is paired within its micro-batch (TRL's per-device batch)
            group = cfg.strategy.microbatch_size
            datasets = [encode_examples(examples, tokenizer, d.seq_len, key, group) for key, examples in groups]
        else:
            encode = encode_cpo_pairs if objective.pair_tokenization == "cpo" else encode_pairs  # TRL's CPO/ORPO way
            datasets = [encode(pairs, tokenizer, d.seq_len, key) for key, pairs in groups]
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def check_compares_pairs(objective) -> None:
    """Pairs are for an objective that compares a chosen and a rejected row (its `rows_per_item` is 2)."""
    if objective.rows_per_item != PAIR_ROWS:
        raise ConfigError(f"data=preference gives chosen/rejected pairs, and the objective {objective.name} trains "
                          f"on one sequence at a time; use objective=dpo (or another that compares pairs)")


def check_kl_pairs(shuffle: bool, microbatch_size: int, eval_fraction: float) -> None:
    """What KTO's KL rows need, as TRL's KTOTrainer refuses otherwise: the examples in file order,
    micro-batches of at least two (one example's KL row would be itself), nothing drawn out."""
    if shuffle:
        raise ConfigError("data.shuffle=true reorders the examples, and objective=kto pairs each with its file "
                          "neighbour's completion for the KL term (TRL: train_sampling_strategy=sequential); set "
                          "data.shuffle=false")
    if microbatch_size < 2:
        raise ConfigError(f"strategy.microbatch_size={microbatch_size}: objective=kto estimates the KL term from each "
                          f"example's prompt with its micro-batch neighbour's completion, so it needs at least 2 "
                          f"(TRL's per_device_train_batch_size > 1); raise it")
    if eval_fraction:
        raise ConfigError(f"data.eval_fraction={eval_fraction} draws held-out examples out of the training set, which "
                          f"breaks objective=kto's KL pairs of neighbours; give them as data.eval_path instead")


def _tokenizer(cfg, pairs: list[Pair], tokenizer_dir, family):
    """Conversations need a chat template, as for data=chat; text needs none (a base model's
    tokenizer serves), but is the same tokenizer the cache keys: data.tokenizer before
    model.pretrained's, the chat rule (`tokenizer_location`)."""
    corpus = (text for pair in pairs for text in pair.texts())
    if any(pair.conversational for pair in pairs):
        return load_tokenizer(cfg, corpus, tokenizer_dir, family, chat=True)
    if cfg.data.tokenizer:
        cfg = copy.deepcopy(cfg)
        OmegaConf.update(cfg, "model.pretrained", None, merge=False)
    return load_tokenizer(cfg, corpus, tokenizer_dir, family)


def _read(d, read, location: str, key: str, split: str, name: str | None) -> list[Pair] | list[Example]:
    """The records at `location` as `read` (`read_pairs` or `read_examples`) makes them."""
    split_key = "data.eval_split" if split == d.eval_split else "data.split"
    return read(read_records(location, key, split, name, split_key), key)


def _held_out(d, read) -> list[tuple[str, list[Pair] | list[Example]]]:
    """The held-out records cfg.data (`d`) names, with the key they came from: none, or one set."""
    if d.eval_path:
        return [("data.eval_path", _read(d, read, d.eval_path, "data.eval_path", d.split, d.name))]
    if d.eval_split:
        return [("data.eval_split", _read(d, read, d.path, "data.path", d.eval_split, d.name))]
    return []
