"""The tokenizer for text sources: the pretrained model's, a configured one, or one trained here.

Lookup order (the first that exists wins):
1. `model.pretrained`'s tokenizer, when that model ships one;
2. `data.tokenizer`, a directory written by `save_pretrained`;
3. a tokenizer trained on the corpus with the `tokenizers` library: WordPiece for BERT (with
   the special-token ids the synthetic data uses) and byte-level BPE for GPT-2, sized to
   `model.vocab_size`; only for a model trained from scratch (a pretrained model's weights
   know only its own tokenizer's ids, so a checkpoint without one is refused).

Chat data (`chat=True`) needs a chat template: there `data.tokenizer` comes first (it is how a
user supplies a template the checkpoint's tokenizer lacks), and a tokenizer trained here gets
ChatML's special tokens and template.

Whatever is used is saved to `<tokenizer_dir>/tokenizer`, so a model saved from the run can
be reloaded with the tokenizer it was trained with.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from relaytrain.utils.errors import ConfigError, first_line

if TYPE_CHECKING:
    from relaytrain.models.family import Family

# Ids 0..4, in the order synthetic.py reserves them ([PAD]=0, [CLS]=1, [SEP]=2, [MASK]=3, [UNK]=4).
BERT_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")
GPT2_EOS = "<|endoftext|>"
# ChatML, as Qwen and many others use it: a turn is "<|im_start|>ROLE\nCONTENT<|im_end|>\n", and
# the generation prompt opens an assistant turn. Any role renders, "tool" included.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Any one of these marks a directory that holds a tokenizer (fast, WordPiece, BPE or SentencePiece files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")


def load_tokenizer(
    cfg, corpus: Iterable[str], tokenizer_dir: str | None, family: Family, chat: bool = False
) -> PreTrainedTokenizerFast:
    """The tokenizer for `cfg`, trained on `corpus` when none is configured (of the kind the run's
    model `family` trains); saved under tokenizer_dir. `chat`: it must have a chat template (see
    the module's docstring)."""
    tokenizer = find_tokenizer(cfg, chat)
    if tokenizer is None and cfg.model.pretrained:
        raise ConfigError(
            f"model.pretrained={cfg.model.pretrained} has no tokenizer, and its weights know only the token ids of "
            f"the one it was trained with: set data.tokenizer=DIR to that tokenizer's directory (tokenizer.json or "
            f"tokenizer_config.json), or give records of input_ids"
        )
    if tokenizer is None:
        tokenizer = train_tokenizer(corpus, family.tokenizer, cfg.model.vocab_size, cfg.model.max_seq_len, chat)
        check_vocab_size(tokenizer, cfg.model.vocab_size, f"the tokenizer trained for model.family={family.name}")
    if tokenizer_dir:
        tokenizer.save_pretrained(str(Path(tokenizer_dir) / "tokenizer"))
    return tokenizer


def find_tokenizer(cfg, chat: bool = False) -> PreTrainedTokenizerFast | None:
    """The configured tokenizer (model.pretrained's, else data.tokenizer; for `chat` data.tokenizer
    first, and it must have a chat template), or None when there is none."""
    configured = tokenizer_location(cfg.model.pretrained, cfg.data.tokenizer, chat)
    if configured is None:
        return None
    key, location = configured
    tokenizer = _from_pretrained(location, key)
    check_vocab_size(tokenizer, cfg.model.vocab_size, f"the tokenizer of {key}={location}")
    if chat and not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer of {key}={location} has no chat template, which data=chat renders records with; "
            f"set data.tokenizer=DIR to a tokenizer directory that has one (chat_template)"
        )
    return tokenizer


def tokenizer_location(pretrained: str | None, configured: str | None, chat: bool = False) -> tuple[str, str] | None:
    """Which configured tokenizer a run uses, as (its key, its location), without loading it:
    `pretrained`'s (model.pretrained) or `configured` (data.tokenizer); None when one is trained
    here (see the module's docstring for the order)."""
    if pretrained and may_hold_tokenizer(pretrained) and not (chat and configured):
        return "model.pretrained", pretrained
    if configured:
        if not Path(configured).expanduser().is_dir():
            raise ConfigError(
                f"data.tokenizer={configured} is not a directory; give a tokenizer saved with "
                f"save_pretrained, or drop data.tokenizer to train one"
            )
        return "data.tokenizer", configured
    return None


def tokenizer_identity(location: tuple[str, str] | None, family: Family, vocab_size: int, max_seq_len: int,
                       chat: bool = False) -> dict:
    """What decides the tokenizer a run uses, for the tokenize cache's key: a local tokenizer's
    files (vocabulary, merges, special tokens and chat template all live in them), a hub id as
    named, or, with none configured (`location`: `tokenizer_location`'s), what a tokenizer
    trained here is made from: the kind the model's `family` trains, its size and length (the
    corpus is the data, keyed apart)."""
    if location is None:
        return {"trained": family.tokenizer, "vocab_size": vocab_size, "max_seq_len": max_seq_len, "chat": chat}
    key, where = location
    path = Path(where).expanduser()
    if not path.is_dir():
        return {key: where}
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(path.iterdir()):
        if file.is_file() and (file.name.startswith(("tokenizer", "special_tokens", "added_tokens", "chat_template",
                                                      "vocab", "merges", "spiece")) or file.suffix == ".model"):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return {key: digest.hexdigest()}


def check_vocab_size(tokenizer: PreTrainedTokenizerFast, vocab_size: int, what: str) -> None:
    """A token id at or past the model's embedding table would crash deep inside the forward pass."""
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"{what} has {len(tokenizer)} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={len(tokenizer)} or use a smaller tokenizer"
        )


def may_hold_tokenizer(pretrained: str) -> bool:
    """A local model directory without tokenizer files falls through; a hub id is tried as is."""
    path = Path(pretrained).expanduser()
    if not path.is_dir():
        return True
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _from_pretrained(location: str, key: str) -> PreTrainedTokenizerFast:
    local = Path(location).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else location)
    except (OSError, ValueError) as e:  # missing files, unreachable hub, unknown tokenizer class
        reason = first_line(e)
        raise ConfigError(
            f"{key}={location}: cannot load its tokenizer ({reason}); give a local directory "
            f"saved with save_pretrained"
        ) from e
    if not tokenizer.is_fast:
        raise ConfigError(
            f"{key}={location} has only a slow (Python) tokenizer; save a fast one (tokenizer.json)"
        )
    return tokenizer


# --------------------------------------------------------------------------- training


TRAINERS = {}  # tokenizer kind (a family's `tokenizer`) -> its trainer, filled below


def train_tokenizer(
    corpus: Iterable[str], kind: str, vocab_size: int, max_length: int, chat: bool = False
) -> PreTrainedTokenizerFast:
    """A fresh tokenizer of `kind` ("wordpiece" or "byte_bpe", as the model family says) trained
    on `corpus`; at most `vocab_size` tokens, fewer when the corpus is small (byte-level BPE
    never has fewer than 257). `chat`: with ChatML's special tokens and template (byte_bpe only)."""
    try:
        trainer = TRAINERS[kind]
    except KeyError:
        raise ConfigError(f"no tokenizer of kind {kind!r} can be trained here; kinds: {', '.join(TRAINERS)}") from None
    if chat:
        if kind != "byte_bpe":
            raise ConfigError(f"data=chat needs a tokenizer with a chat template, and a {kind} tokenizer trained "
                              f"here has none; set data.tokenizer=DIR to one that has")
        return _train_byte_level_bpe(corpus, vocab_size, max_length, chat=True)
    return trainer(corpus, vocab_size, max_length)


def _train_wordpiece(corpus: Iterable[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import models, trainers

    texts = list(corpus)  # read twice: once for the alphabet, once to train
    scratch = _bert_pipeline(models.WordPiece(unk_token="[UNK]"))
    alphabet = _alphabet(
        texts, scratch.normalizer, limit=max((vocab_size - len(BERT_SPECIAL_TOKENS)) // 2, 1)
    )
    # The trainer creates the "##x" continuation pieces in hash-map order, so the same corpus can
    # give different ids on every run (huggingface/tokenizers#1794). Registering them up front,
    # sorted, makes training reproducible; the vocabulary is then rebuilt so they are ordinary
    # pieces rather than special tokens.
    continuations = ["##" + char for char in alphabet]
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BERT_SPECIAL_TOKENS) + continuations,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    scratch.train_from_iterator(texts, trainer)
    vocab = scratch.get_vocab(with_added_tokens=False)
    tokenizer = _bert_pipeline(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        unk_token="[UNK]",
        model_max_length=max_length,
    )


def _bert_pipeline(model):
    """A BERT-style (uncased) tokenizer around `model`: [CLS] a [SEP] (b [SEP])."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(token, BERT_SPECIAL_TOKENS.index(token)) for token in ("[CLS]", "[SEP]")],
    )
    return tokenizer


def _alphabet(texts: list[str], normalizer, limit: int) -> list[str]:
    """The `limit` most frequent characters after normalization, sorted; ties break by character
    so the result does not depend on the corpus order. Capped so that each character and its
    "##" continuation fit in the vocabulary; rarer ones become [UNK]."""
    raw = Counter()
    for text in texts:
        raw.update(text)
    counts = Counter()
    for char, count in raw.items():
        for normalized in normalizer.normalize_str(char):  # lowercased, accents stripped
            if not normalized.isspace():
                counts[normalized] += count
    return sorted(sorted(counts, key=lambda char: (-counts[char], char))[:limit])


def _train_byte_level_bpe(
    corpus: Iterable[str], vocab_size: int, max_length: int, chat: bool = False
) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOS, IM_START, IM_END] if chat else [GPT2_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    # GPT-2 has a single special token; it doubles as padding (labels ignore padding by the mask).
    # A chat model ends its turns with <|im_end|>: that is its end of sequence, where generation stops.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=GPT2_EOS,
        eos_token=IM_END if chat else GPT2_EOS,
        unk_token=GPT2_EOS,
        pad_token=GPT2_EOS,
        model_max_length=max_length,
    )
    if chat:
        fast.chat_template = CHATML_TEMPLATE
    return fast


TRAINERS.update(wordpiece=_train_wordpiece, byte_bpe=_train_byte_level_bpe)
