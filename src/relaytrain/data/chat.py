"""Chat and instruction data (`data=chat`, read by `data/sources/chat.py`): conversations
rendered with the tokenizer's chat template, the loss on the assistant's replies only.

Records come from data.path (data.eval_path held out; the parts of data.mix) in any form
`reading.py` reads, one conversation a record, in one of the common shapes (one a file: the
first record fixes it, and a record of another is refused in one line naming both):

- messages (OpenAI): `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}`
  with roles system, user and assistant ("tool" too, where the template renders it);
- ShareGPT: `{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}`, `from`
  being human, gpt, system or tool (or user, assistant); data.roles maps other names
  (`data.roles={bot: assistant}`), in either shape;
- alpaca: `{"instruction": "...", "input": "...", "output": "..."}` (input optional), read as a
  user turn "instruction\n\ninput" and an assistant turn "output".

A top-level `system` text (as LLaMA-Factory's ShareGPT and alpaca files have) opens the
conversation as a system turn.

Labels are the token ids of the replies and -100 everywhere else (the model shifts them). A
reply is located by rendering the conversation prefix by prefix: the template up to the turn
with the generation prompt is its prompt, the template up to and including the turn ends with
the reply. So any template works, with or without `{% generation %}` markers; the reply is the
content and the template's end-of-turn token, not the whitespace a template puts between turns.
A template that ignores the generation prompt yet opens the assistant's turn with a header is
refused: the header would be trained as the reply (`check_generation_prompt`). Turns after the
last reply teach nothing and are left out. The template's end-of-turn token (`end_of_turn_id`)
is also where a saved model's generation stops.

A record longer than data.seq_len is cut from the right and kept when a reply token survives,
else dropped; both are counted in the dataset's `facts` (results.json's `data`). With
data.pack=true, records are packed into rows of data.seq_len in file order, with position ids
that restart at each record so that no record attends to another (see `pack_rows`). Rendering
many records uses several processes (data.num_proc). A stream (data.streaming, `ChatRows` in
`data/sources/chat.py`) renders, cuts and packs its records one at a time with the same functions
(`parse_records`, `render`, `fit`, `packed`), so in order it gives the whole set's rows.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import pad_rows, special_ids
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.reading import Records, Where
from relaytrain.utils.errors import ConfigError, first_line

ROLES = ("system", "user", "assistant")
TOOL = "tool"  # accepted where the chat template renders it (checked per record)
REPLY = "assistant"
# ShareGPT's `from` names (and the roles themselves); data.roles adds others.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": TOOL, "user": "user",
                  "assistant": REPLY}
EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
PARALLEL_FROM = 20_000  # records from which data.num_proc=0 renders in several processes
MAX_AUTO_PROCESSES = 8


Rendered = tuple[list[int], list[int]]  # a record's token ids and labels


@dataclass
class Record:
    """One conversation, ending with an assistant turn; `where` ("PATH line N", "PATH row N") for errors."""

    where: Where | str
    messages: list[dict]


# --------------------------------------------------------------------------- reading


def read_conversations(records: Records, key: str, roles: Mapping[str, str] | None = None) -> list[Record]:
    """Every row of `records` as a checked `Record`, all of one form; `roles`: data.roles."""
    conversations = list(parse_records(records.rows(), roles or {}))
    if not conversations:
        raise ConfigError(f"{key}={records.location} holds no records; write one conversation a record, "
                          f"e.g. {EXAMPLE}")
    return conversations


def parse_records(rows: Iterable[tuple[Where, dict]], roles: Mapping[str, str]) -> Iterator[Record]:
    """The rows of one file (or stream) as checked `Record`s, one at a time. The first fixes the
    form: a file of several forms is most often files of different datasets run together, and
    its records' fields (a ShareGPT `system`, alpaca's `input`) would be read by another form's
    rules, so a record of another form is one line naming both."""
    first: tuple[str, Where] | None = None
    for where, record in rows:
        form = record_form(record, where)
        if first is None:
            first = (form, where)
        elif form != first[0]:
            raise ConfigError(f"{where} holds a record of the {form} form, {first[1]} one of the {first[0]} form; "
                              f"one file holds records of one form: convert them to one, or split the file by form "
                              f"and give the files as data.mix")
        yield parse_record(record, where, roles)


def record_form(record, where) -> str:
    """Which of the known shapes the record is in: "messages", "ShareGPT" or "alpaca"."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(record).__name__}; write e.g. {EXAMPLE}")
    if _given(record, "messages"):
        return "messages"
    if _given(record, "conversations"):
        return "ShareGPT"
    if _given(record, "instruction") or _given(record, "output"):
        return "alpaca"
    raise ConfigError(f"{where}: neither a 'messages' list, a ShareGPT 'conversations' list nor an alpaca "
                      f"'instruction'/'output' record; write e.g. {EXAMPLE}")


def parse_record(record, where, roles: Mapping[str, str]) -> Record:
    """One record of any known shape as a conversation (`where` names it in every error)."""
    form = record_form(record, where)
    if form == "alpaca":
        messages = _alpaca(record, where)
    else:
        field = "messages" if form == "messages" else "conversations"
        messages = _turns(record[field], where, field, roles)
    messages = _with_system(record, messages, where)
    if not any(m["role"] == REPLY for m in messages):
        raise ConfigError(f"{where}: no assistant turn, so nothing to learn from; add the reply as "
                          f'{{"role": "assistant", "content": "..."}}')
    if messages[0]["role"] == REPLY:
        raise ConfigError(f"{where}: the conversation opens with an assistant turn, which has no prompt; "
                          f"start it with a user (or system) turn")
    return Record(where, messages)


def _given(record: dict, field: str) -> bool:
    """Present and not null: columnar files give every record every column, null where it had none."""
    return record.get(field) is not None


def _turns(value, where, field: str, roles: Mapping[str, str]) -> list[dict]:
    """A list of turns, each {"role", "content"} (OpenAI) or {"from", "value"} (ShareGPT)."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {field!r} must be a non-empty list of turns, e.g. {EXAMPLE}")
    turns = []
    for number, turn in enumerate(value, start=1):
        if not isinstance(turn, dict):
            raise ConfigError(f"{where}: message {number} is not a {{\"role\": ..., \"content\": ...}} object")
        if isinstance(turn.get("role"), str):
            role = _role(turn["role"], roles, {r: r for r in (*ROLES, TOOL)}, where, number)
            content = turn.get("content")
        elif isinstance(turn.get("from"), str):
            role = _role(turn["from"], roles, SHAREGPT_ROLES, where, number)
            content = turn.get("value")
        else:
            raise ConfigError(f"{where}: message {number} has neither a 'role' nor a ShareGPT 'from'; write "
                              f'{{"role": ..., "content": ...}} or {{"from": ..., "value": ...}}')
        if not isinstance(content, str):
            raise ConfigError(f"{where}: message {number} ({role}) needs its 'content' (ShareGPT: 'value') as text")
        turns.append({"role": role, "content": content})
    return turns


def _role(name: str, roles: Mapping[str, str], known: Mapping[str, str], where, number: int) -> str:
    if name in roles:
        return roles[name]
    if name in known:
        return known[name]
    if known is SHAREGPT_ROLES:
        raise ConfigError(f"{where}: message {number} is from {name!r}, which names no role; map it with "
                          f"data.roles={{{name}: assistant}} (or user, system, tool), or use human, gpt, system, tool")
    raise ConfigError(f"{where}: message {number} has unknown role {name!r}; use system, user or "
                      f"assistant (or tool, where the chat template renders it), or map it with data.roles")


def _with_system(record: dict, messages: list[dict], where) -> list[dict]:
    system = record.get("system")
    if system is None or system == "" or messages[0]["role"] == "system":
        return messages
    if not isinstance(system, str):
        raise ConfigError(f"{where}: 'system' must be text")
    return [{"role": "system", "content": system}, *messages]


def _alpaca(record: dict, where) -> list[dict]:
    def text(field: str, required: bool) -> str:
        value = record.get(field)
        value = "" if value is None else value
        if not isinstance(value, str) or (required and not value.strip()):
            need = "non-empty text" if required else "text"
            hint = "; add the reply as 'output'" if field == "output" else ""
            raise ConfigError(f"{where}: alpaca '{field}' must be {need}{hint}")
        return value

    instruction, given, output = text("instruction", True), text("input", False), text("output", True)
    prompt = f"{instruction}\n\n{given}" if given.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": REPLY, "content": output}]


# --------------------------------------------------------------------------- rendering


def render(tokenizer, record: Record) -> tuple[list[int], list[int]]:
    """The record's token ids and labels: the ids on the assistant's replies, -100 elsewhere."""
    last = max(i for i, m in enumerate(record.messages) if m["role"] == REPLY)
    messages = record.messages[: last + 1]
    text = _template(tokenizer, messages, False, record.where)
    _check_tools_rendered(messages, text, record.where)
    spans = [_reply_span(tokenizer, messages, i, text, record.where)
             for i, m in enumerate(messages) if m["role"] == REPLY]
    # apply_chat_template(tokenize=True) tokenizes its text exactly so: no special tokens added.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    # A token is the reply's when its characters overlap a reply: one that starts in the prompt
    # and ends in the reply (" Paris" after "Answer:") is what the model must produce.
    labels = [token if any(start < end and stop > begin for begin, end in spans) else IGNORE_INDEX
              for token, (start, stop) in zip(ids, encoded["offset_mapping"], strict=True)]
    labels[0] = IGNORE_INDEX  # nothing predicts a record's first token, packed or not
    return ids, labels


def _template(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        reason = first_line(e)
        raise ConfigError(f"{where}: the chat template refuses this conversation ({reason}); "
                          f"fix the record or use data.tokenizer=DIR with a template that takes it") from e


def _reply_span(tokenizer, messages: list[dict], turn: int, text: str, where: str) -> tuple[int, int]:
    """Characters [begin, end) of the reply in turn `turn` within the whole conversation's `text`."""
    prompt = _template(tokenizer, messages[:turn], True, where)
    through = _template(tokenizer, messages[: turn + 1], False, where)
    if not (text.startswith(through) and through.startswith(prompt)):
        raise ConfigError(f"{where}: the chat template renders turn {turn + 1} differently once the conversation "
                          f"goes on, so its reply cannot be located; split the record into one per reply")
    # Whitespace after the end-of-turn token separates turns; generation stops before it.
    return len(prompt), max(len(prompt), len(through.rstrip()))


def check_generation_prompt(tokenizer, record: Record) -> None:
    """A reply starts where the generation prompt ends. A template that renders the same text with
    and without `add_generation_prompt`, yet opens the assistant's turn with a header (ChatML's
    "<|im_start|>assistant\n" written only inside the turn), would put that header into the loss
    and leave `generate` without it. Templates whose reply follows the prompt directly (Llama 2's
    and Mistral's "[/INST]") ignore the flag rightly. Checked once, on the first record's first reply: a template either honours
    the flag or not."""
    first = next(i for i, m in enumerate(record.messages) if m["role"] == REPLY)
    prefix = record.messages[:first]
    prompt = _template(tokenizer, prefix, True, record.where)
    if prompt != _template(tokenizer, prefix, False, record.where):
        return
    turn = _template(tokenizer, record.messages[: first + 1], False, record.where)[len(prompt):]
    if turn.lstrip().startswith(record.messages[first]["content"].strip()):
        return
    raise ConfigError(f"the chat template of the tokenizer {tokenizer.name_or_path or '(unnamed)'} ignores "
                      f"add_generation_prompt, so the assistant's header would be trained as its reply; use "
                      f"data.tokenizer=DIR with a template that writes the header when add_generation_prompt is true")


# A reply the template has no reason to alter (no surrounding whitespace, nothing to escape).
PROBE = [{"role": "user", "content": "What is 2+2?"}, {"role": REPLY, "content": "It is 4."}]


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template ends a reply with: where generation must stop, which need not
    be the tokenizer's eos (Qwen2.5: <|im_end|>, not <|endoftext|>; Llama 3.1: <|eot_id|>, not
    <|end_of_text|>). Read from the template itself: the first token after a rendered reply,
    whitespace between turns aside, when it is a special (added) token; a plain-text marker
    would stop generation wherever that text occurs. None without a template or such a token."""
    from jinja2.exceptions import TemplateError

    if not tokenizer.chat_template:
        return None
    reply = PROBE[-1]["content"]
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError):  # e.g. a template that insists on a system turn
        return None
    if reply not in text:
        return None
    tail = text[text.rindex(reply) + len(reply):].strip()
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    return ids[0] if ids and ids[0] in tokenizer.added_tokens_decoder else None


def _check_tools_rendered(messages: list[dict], text: str, where: str) -> None:
    for number, m in enumerate(messages, start=1):
        if m["role"] == TOOL and m["content"] not in text:
            raise ConfigError(f"{where}: message {number} has role 'tool', which this chat template does not "
                              f"render; drop the turn or use data.tokenizer=DIR with a template that renders it")


# --------------------------------------------------------------------------- rows


def encode_records(records: list[Record], tokenizer, seq_len: int, pack: bool, key: str,
                   num_proc: int = 1) -> TokenDataset:
    """The records as rows of seq_len (packed or one per row), long ones cut or dropped and counted;
    rendered in `num_proc` processes (0: by the records' number and the cores)."""
    rendered = render_all(tokenizer, records, processes(num_proc, len(records)))
    kept = [fitted for fitted in (fit(ids, labels, seq_len) for ids, labels in rendered) if fitted]
    dropped = len(rendered) - len(kept)
    if not kept:
        raise ConfigError(f"{key}: every record's first reply starts past data.seq_len={seq_len} tokens, so all "
                          f"{dropped} were dropped; raise data.seq_len")
    pad = special_ids(tokenizer).pad
    dataset = pack_rows(kept, seq_len, pad) if pack else one_per_row(kept, seq_len, pad)
    truncated = sum(len(ids) > seq_len for ids, _ in rendered) - dropped
    dataset.facts = {"records": len(kept), "tokens": sum(len(ids) for ids, _ in kept), "truncated": truncated,
                     "dropped": dropped, "rows": len(dataset), "packed": pack}
    return dataset


def fit(ids: list[int], labels: list[int], seq_len: int) -> tuple[list[int], list[int]] | None:
    """A rendered record within seq_len: cut from the right, or None (dropped) when no reply
    token survives the cut."""
    if len(ids) <= seq_len:
        return ids, labels
    ids, labels = ids[:seq_len], labels[:seq_len]
    return None if all(label == IGNORE_INDEX for label in labels) else (ids, labels)


def processes(num_proc: int, records: int) -> int:
    """data.num_proc, or for 0 one process a core (up to MAX_AUTO_PROCESSES) once there are
    enough records to repay starting them."""
    if num_proc > 0:
        return num_proc
    if records < PARALLEL_FROM:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_PROCESSES))


def render_all(tokenizer, records: list[Record], workers: int) -> list[tuple[list[int], list[int]]]:
    """Every record rendered, in order: here, or in `workers` forked processes, each a contiguous
    share (a fork shares the tokenizer and records without pickling them; the first bad record of
    a share raises there and again here, as the same one line)."""
    if workers <= 1 or len(records) < 2 * workers:
        return [render(tokenizer, record) for record in records]
    global _SHARED  # what the forked workers read: set before the fork, cleared after
    _SHARED = (tokenizer, records)
    bounds = [len(records) * k // workers for k in range(workers + 1)]
    # The Rust tokenizer's own thread pool must not be running across a fork (it would deadlock the
    # child; tokenizers then warns and turns it off): the workers are the parallelism here.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            shares = pool.map(_render_share, list(zip(bounds[:-1], bounds[1:], strict=True)))
    finally:
        _SHARED = None
    return [rendered for share in shares for rendered in share]


_SHARED = None


def _render_share(bounds: tuple[int, int]) -> list[tuple[list[int], list[int]]]:
    tokenizer, records = _SHARED
    return [render(tokenizer, record) for record in records[bounds[0]: bounds[1]]]


def one_per_row(records: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> TokenDataset:
    ids, attention = pad_rows([r[0] for r in records], seq_len, pad)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, (_, record_labels) in enumerate(records):
        labels[row, : len(record_labels)] = torch.tensor(record_labels, dtype=torch.long)
    return TokenDataset(input_ids=ids, labels=labels, attention_mask=attention)


def pack_rows(records: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> TokenDataset:
    """Records (each at most seq_len) packed in order into rows of seq_len: a record that does not
    fit the current row starts the next. Position ids restart at 0 at every record, which is how
    the model's mask keeps records apart (Hugging Face reads packing from them only when there is
    no attention mask, so there is none); a row's unused tail is padding, one more segment of its
    own whose labels are -100, so it changes nothing the records compute."""
    return packed_tensors(list(packed(records, seq_len)), seq_len, pad)


def packed(records: Iterable[Rendered], seq_len: int) -> Iterator[list[Rendered]]:
    """Records (each at most seq_len) gathered in order into rows: a record that does not fit
    the current row starts the next. One at a time, so a stream packs as the whole set does."""
    row, used = [], 0
    for record in records:
        if used + len(record[0]) > seq_len:
            yield row
            row, used = [], 0
        row.append(record)
        used += len(record[0])
    if row:
        yield row


def packed_tensors(rows: list[list[Rendered]], seq_len: int, pad: int) -> TokenDataset:
    """Rows of packed records (`packed`) as tensors: ids, labels and positions restarting at each record."""
    ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for row, records in enumerate(rows):
        start = 0
        for record_ids, record_labels in records:
            end = start + len(record_ids)
            ids[row, start:end] = torch.tensor(record_ids, dtype=torch.long)
            labels[row, start:end] = torch.tensor(record_labels, dtype=torch.long)
            positions[row, start:end] = torch.arange(len(record_ids))
            start = end
        positions[row, start:] = torch.arange(seq_len - start)
    return TokenDataset(input_ids=ids, labels=labels, position_ids=positions)
