"""Pairs tokenized as TRL 1.16's CPO and ORPO trainers do (`objective=simpo`, `objective=orpo`):
the older way of TRL's trainers, which differs from its DPOTrainer's (`data/preference.py`).

What differs, each for TRL's reasons:

- a conversation is first rendered to text (TRL's `maybe_apply_chat_template`: the prompt with
  the generation prompt, or continuing its last turn where that is the assistant's; each whole
  conversation; the prompt is the characters all three share, each completion the rest of its
  text), then tokenized as text is; the record's `tools` are not given to the template (TRL
  passes none), so a record with tools is refused rather than rendered without them;
- text is tokenized without special tokens; each completion's row is the tokens of prompt plus
  completion, its prompt the first as many tokens as the prompt alone has, one fewer where the
  last of them merged with the completion (`build_tokenized_answer`); so a pair's two rows may
  begin with prompts a token apart;
- the tokenizer's bos is put before each row that does not begin with it, and its eos after each
  completion that does not end with it, as tokens (`add_bos_token_if_needed`,
  `add_eos_token_if_needed`);
- a long row keeps its whole prompt and as much of the completion as fits data.seq_len (TRL's
  `max_length`); a row whose prompt alone fills data.seq_len would have no completion (TRL: an
  empty one, whose mean log-prob is NaN), so such a pair is dropped and counted.

The rows are `data/preference.py`'s: row 2i pair i's chosen, row 2i+1 its rejected, right-padded to
data.seq_len with the pad id, labelled on the completion tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import pad_rows, special_ids
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.preference import Pair, common_prefix_length
from relaytrain.utils.errors import ConfigError, first_line


@dataclass(frozen=True)
class Row:
    """One completion's row before padding: its prompt tokens and its completion tokens."""

    prompt: list[int]
    completion: list[int]

    def cut(self, seq_len: int) -> Row:
        """The whole prompt and as much of the completion as fits `seq_len` (TRL's truncation)."""
        return Row(self.prompt, self.completion[: max(0, seq_len - len(self.prompt))])


def encode_cpo_pairs(pairs: list[Pair], tokenizer, seq_len: int, key: str) -> TokenDataset:
    """The pairs as interleaved rows of seq_len (chosen, then rejected), tokenized as TRL's CPO and
    ORPO trainers do; pairs whose prompt fills seq_len dropped, long ones cut, both counted."""
    _check_specials(tokenizer)
    tokenized = [cpo_rows(tokenizer, pair) for pair in pairs]
    kept = [rows for rows in tokenized if all(len(row.prompt) < seq_len for row in rows)]
    dropped = len(tokenized) - len(kept)
    if not kept:
        raise ConfigError(f"{key}: every pair's prompt fills data.seq_len={seq_len} tokens, so all {dropped} were "
                          f"dropped; raise data.seq_len")
    rows = [row for pair in kept for row in pair]
    truncated = sum(any(len(row.prompt) + len(row.completion) > seq_len for row in pair) for pair in kept)
    dataset = padded_rows([row.cut(seq_len) for row in rows], seq_len, special_ids(tokenizer).pad)
    dataset.facts = {"records": len(kept), "tokens": int(dataset.attention_mask.sum()), "truncated": truncated,
                     "dropped": dropped, "rows": len(rows)}
    return dataset


def padded_rows(rows: list[Row], seq_len: int, pad: int) -> TokenDataset:
    """Rows of at most seq_len tokens as a set of pairs, right-padded; labels on the completions."""
    ids, attention = pad_rows([row.prompt + row.completion for row in rows], seq_len, pad)
    labels, _ = pad_rows([[IGNORE_INDEX] * len(row.prompt) + row.completion for row in rows], seq_len, IGNORE_INDEX)
    if attention is None:  # every row fills seq_len
        attention = torch.ones_like(ids)
    return TokenDataset(input_ids=ids, labels=labels, attention_mask=attention, rows_per_item=2)


def cpo_rows(tokenizer, pair: Pair) -> tuple[Row, Row]:
    """The pair's chosen and rejected rows as TRL's `tokenize_row` makes them (uncut)."""
    prompt, chosen, rejected = rendered(tokenizer, pair) if pair.conversational else (
        pair.prompt, pair.chosen, pair.rejected)
    prompt_ids = _ids(tokenizer, prompt)
    rows = [_answer_row(tokenizer, prompt, prompt_ids, completion, pair) for completion in (chosen, rejected)]
    first, second = (row.prompt for row in rows)
    if sum(a != b for a, b in zip(first, second, strict=False)) > 1 or abs(len(first) - len(second)) > 1:
        raise ConfigError(f"{pair.where}: the prompt's tokens differ by more than the last one between the chosen and "
                          f"the rejected completion, which TRL's CPO/ORPO tokenizing refuses; end the prompt where a "
                          f"token ends (a space or a newline), or use objective=dpo")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return tuple(Row(_with_bos(row.prompt, bos), _with_eos(row.completion, eos)) for row in rows)


def _answer_row(tokenizer, prompt: str, prompt_ids: list[int], completion: str, pair: Pair) -> Row:
    """TRL's `build_tokenized_answer`: prompt plus completion tokenized whole, the prompt's part as
    long as the prompt's own tokens, one shorter where its last token merged with the completion's."""
    whole = _ids(tokenizer, prompt + completion)
    if len(whole) < len(prompt_ids):
        raise ConfigError(f"{pair.where}: the prompt and a completion make fewer tokens than the prompt alone, which "
                          f"TRL's CPO/ORPO tokenizing refuses; use objective=dpo")
    start = len(prompt_ids) - (common_prefix_length(prompt_ids, whole) < len(prompt_ids))
    return Row(whole[:start], whole[start:])


def _with_bos(prompt: list[int], bos: int | None) -> list[int]:
    return prompt if bos is None or (prompt and prompt[0] == bos) else [bos, *prompt]


def _with_eos(completion: list[int], eos: int) -> list[int]:
    return completion if completion and completion[-1] == eos else [*completion, eos]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def rendered(tokenizer, pair: Pair) -> tuple[str, str, str]:
    """A conversational pair as text, as TRL's `maybe_apply_chat_template` renders it: the prompt
    (the text it shares with both whole conversations), the chosen and the rejected completion."""
    if pair.template_args.get("tools"):
        raise ConfigError(f"{pair.where}: 'tools' are given, and TRL's CPO/ORPO trainers render conversations "
                          f"without them; drop the record's tools, or use objective=dpo")
    args = {k: v for k, v in pair.template_args.items() if k != "tools"}
    last = pair.prompt[-1]["role"]
    if last not in ("user", "tool", "assistant"):
        raise ConfigError(f"{pair.where}: the prompt's last turn is {last!r}; TRL renders a prompt that ends with "
                          f"a user, tool or assistant turn")
    opens = last != "assistant"  # a prompt ending with the assistant's turn is continued, not answered
    prompt = _chat_text(tokenizer, pair, pair.prompt, args, add_generation_prompt=opens,
                        continue_final_message=not opens)
    whole = [_chat_text(tokenizer, pair, pair.prompt + completion, args) for completion in (pair.chosen, pair.rejected)]
    shared = min(_shared_characters(prompt, text) for text in whole)
    return prompt[:shared], whole[0][shared:], whole[1][shared:]


def _shared_characters(text: str, other: str) -> int:
    return next((i for i, (a, b) in enumerate(zip(text, other, strict=False)) if a != b), min(len(text), len(other)))


def _chat_text(tokenizer, pair: Pair, messages: list[dict], args: dict, **flags) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **flags, **args)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{pair.where}: the chat template refuses this pair ({first_line(e)}); fix the record or "
                          f"use data.tokenizer=DIR with a template that takes it") from e


def _check_specials(tokenizer) -> None:
    """Every completion ends with the tokenizer's eos token, which it must have."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer {tokenizer.name_or_path or '(unnamed)'} has no eos token, which TRL's CPO/ORPO "
                          f"tokenizing ends every completion with; use data.tokenizer=DIR with one that has")
