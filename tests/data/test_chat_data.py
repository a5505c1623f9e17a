"""`data=chat`: conversations and instructions rendered with the chat template, the loss on the
assistant's replies only; bad records refused with one line; long records cut or dropped and
counted; packed rows that give the unpacked loss; runs end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.data import build_datasets
from relaytrain.data.chat import end_of_turn_id
from relaytrain.models import build_model
from relaytrain.models.layered import eval_mode
from relaytrain.models.pretrained import resolve
from relaytrain.objectives.base import Divisor
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import CHATML, chat_tokenizer, tiny_decoder

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny llama and gemma2 checkpoints with the ChatML tokenizer; a llama whose tokenizer has no
    chat template; a tokenizer directory that has one."""
    root = tmp_path_factory.mktemp("chat_checkpoints")
    tiny_decoder(root / "llama", "llama", layers=2)
    tiny_decoder(root / "gemma2", "gemma2", layers=2)
    tiny_decoder(root / "plain", "llama", layers=2, tokenizer=False)
    bare = chat_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(root / "plain")
    chat_tokenizer().save_pretrained(root / "templated")
    return root


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_cfg(checkpoint: Path, path: Path, *overrides: str):
    cfg = compose_config([f"model.pretrained={checkpoint}", "data=chat", f"data.path={path}", "data.seq_len=64",
                          "strategy.microbatch_size=2", "strategy.num_microbatches=2", "train.steps=3",
                          "train.untimed_steps=1", *overrides])
    return resolve(cfg)


def label_text(dataset, row: int) -> str:
    labels = dataset.labels[row]
    assert torch.equal(labels[labels != -100], dataset.input_ids[row][labels != -100])  # labels are the ids
    return chat_tokenizer().decode(labels[labels != -100].tolist())


def labelled_runs(labels: torch.Tensor) -> int:
    """How many separate stretches of labelled tokens a row has."""
    on = (labels != -100).int()
    return int((torch.diff(on, prepend=torch.zeros(1, dtype=torch.int)) == 1).sum())


# --------------------------------------------------------------------------- labels


def test_both_forms_put_labels_on_the_reply_and_its_end_of_turn_only(checkpoints, tmp_path):
    messages = write_jsonl(tmp_path / "messages.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                      {"role": "assistant", "content": "It is 5."}]},
    ])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add the numbers.", "input": "4 and 7", "output": "That is 11."},
        {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
    ])
    conversation, held_out = build_datasets(chat_cfg(checkpoints / "llama", messages))
    assert held_out is None and len(conversation) == 1 and label_text(conversation, 0) == "It is 5." + END
    train = build_datasets(chat_cfg(checkpoints / "llama", alpaca))[0]
    assert [label_text(train, row) for row in range(2)] == ["That is 11." + END, "Paris." + END]
    decoded = chat_tokenizer().decode(train.input_ids[0][train.attention_mask[0].bool()].tolist())
    assert decoded == (f"<|im_start|>user\nAdd the numbers.\n\n4 and 7{END}\n"
                       f"<|im_start|>assistant\nThat is 11.{END}\n")
    assert "\n\n" not in chat_tokenizer().decode(train.input_ids[1].tolist())  # an empty input adds nothing


def test_every_reply_of_a_multi_turn_conversation_is_labelled(checkpoints, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "What is 10 - 4?"}, {"role": "assistant", "content": "Six."},
                      {"role": "user", "content": "And 6 + 9?"}, {"role": "assistant", "content": "Fifteen."},
                      {"role": "user", "content": "Thanks!"}]},
    ])
    train, _ = build_datasets(chat_cfg(checkpoints / "llama", path))
    assert label_text(train, 0) == "Six." + END + "Fifteen." + END
    assert labelled_runs(train.labels[0]) == 2
    assert "Thanks" not in chat_tokenizer().decode(train.input_ids[0].tolist())  # nothing learns from it


def test_a_fresh_model_trains_a_chatml_tokenizer_for_chat_data(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"instruction": f"Say {i}.", "output": f"{i}."} for i in range(4)])
    cfg = compose_config(["model=llama_tiny", "model.vocab_size=400", "data=chat", f"data.path={path}"])
    train, _ = build_datasets(cfg, str(tmp_path / "run"))
    saved = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template and saved["eos_token"] == END
    labels = train.labels[2]
    assert tokenizer.decode(labels[labels != -100].tolist()) == "2." + END


# --------------------------------------------------------------------------- bad input


def cli_error(args: list[str], capsys) -> str:
    """The one line `relaytrain train ARGS` prints, having checked it exits with 2."""
    try:
        code = main(["train", *args])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


GOOD = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}'
SHAREGPT = '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}'
ALPACA = '{"instruction": "Say hello.", "output": "Hello."}'


@pytest.mark.parametrize("bad, message", [
    ('{"messages": [{"role": "user", "content": "Hi"}', "malformed JSON"),
    ('{"text": "a plain text record"}', "neither a 'messages' list, a ShareGPT 'conversations' list nor an alpaca"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', "no assistant turn"),
    ('{"instruction": "Say hi."}', "alpaca 'output' must be non-empty text; add the reply as 'output'"),
    ('{"messages": [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}',
     "message 1 has unknown role 'human'"),
    ('{"messages": [{"role": "assistant", "content": "Hi"}]}', "opens with an assistant turn"),
], ids=["json", "neither-form", "no-assistant", "alpaca-no-output", "unknown-role", "no-prompt"])
def test_a_bad_record_is_one_line_naming_the_file_and_line(checkpoints, tmp_path, capsys, bad, message):
    good = ALPACA if '"instruction"' in bad else GOOD  # a record among others of its form
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, bad])
    line = cli_error([f"model.pretrained={checkpoints / 'llama'}", "data=chat", f"data.path={path}",
                      "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert f"{path} line 3: " in line and message in line


@pytest.mark.parametrize("first, other, forms", [
    (GOOD, SHAREGPT, ("ShareGPT", "messages")),
    (GOOD, ALPACA, ("alpaca", "messages")),
    (ALPACA, SHAREGPT, ("ShareGPT", "alpaca")),
    (SHAREGPT, GOOD, ("messages", "ShareGPT")),
], ids=["messages-then-sharegpt", "messages-then-alpaca", "alpaca-then-sharegpt", "sharegpt-then-messages"])
def test_a_file_of_several_forms_is_one_line_naming_both_records(checkpoints, tmp_path, first, other, forms):
    """The first record fixes the file's form; the first record of another is refused, naming
    its line and form and the first's (each form alone trains: the other tests)."""
    path = write_jsonl(tmp_path / "chat.jsonl", [first, first, "", other, first])
    with pytest.raises(ConfigError) as refused:
        build_datasets(chat_cfg(checkpoints / "llama", path, "data.cache=false"))
    assert str(refused.value) == (
        f"{path} line 4 holds a record of the {forms[0]} form, {path} line 1 one of the {forms[1]} form; one file "
        f"holds records of one form: convert them to one, or split the file by form and give the files as data.mix")


@pytest.mark.slow  # a run's start (seconds): the line itself is checked above
def test_a_file_of_several_forms_is_refused_by_the_command_in_one_line(checkpoints, tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, ALPACA, SHAREGPT])
    line = cli_error([f"model.pretrained={checkpoints / 'llama'}", "data=chat", f"data.path={path}",
                      "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert line.startswith(f"relaytrain: error: {path} line 2 holds a record of the alpaca form, {path} line 1 ")


def test_a_bad_held_out_record_names_the_held_out_file(checkpoints, tmp_path, capsys):
    train = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 8)
    held = write_jsonl(tmp_path / "eval.jsonl", [GOOD, '{"messages": []}'])
    line = cli_error([f"model.pretrained={checkpoints / 'llama'}", "data=chat", f"data.path={train}",
                      f"data.eval_path={held}", "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert f"{held} line 2: 'messages' must be a non-empty list" in line


@pytest.mark.parametrize("data", ["chat", "jsonl"])
def test_a_pretrained_model_without_a_tokenizer_is_refused_rather_than_given_a_new_one(checkpoints, tmp_path,
                                                                                        capsys, data):
    """A tokenizer trained on the file would hand the checkpoint's embeddings ids they never saw."""
    bare = tiny_decoder(tmp_path / "bare", "llama", layers=1, tokenizer=False)
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD if data == "chat" else {"text": "some text"}] * 8)
    base = [f"data={data}", f"data.path={path}", "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    capsys.readouterr()  # save_pretrained's progress
    line = cli_error([f"model.pretrained={bare}", *base], capsys)
    assert line == (f"relaytrain: error: model.pretrained={bare} has no tokenizer, and its weights know only the "
                    f"token ids of the one it was trained with: set data.tokenizer=DIR to that tokenizer's directory "
                    f"(tokenizer.json or tokenizer_config.json), or give records of input_ids")
    cfg = chat_cfg(bare, path, f"data.tokenizer={checkpoints / 'templated'}") if data == "chat" else None
    if cfg is not None:  # ... which data.tokenizer then supplies
        assert label_text(build_datasets(cfg)[0], 0) == "Hello." + END


def test_missing_file_templateless_tokenizer_and_unpackable_models_are_one_line(checkpoints, tmp_path, capsys):
    assert "data=chat needs a file or dataset of records: set data.path=" in cli_error(["model=llama_tiny", "data=chat"], capsys)
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 8)
    base = ["data=chat", f"data.path={path}", "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"]
    line = cli_error([f"model.pretrained={checkpoints / 'plain'}", *base], capsys)
    assert "has no chat template" in line and "data.tokenizer=DIR" in line
    # ... which data.tokenizer then supplies
    cfg = chat_cfg(checkpoints / "plain", path, f"data.tokenizer={checkpoints / 'templated'}")
    assert label_text(build_datasets(cfg)[0], 0) == "Hello." + END
    with pytest.raises(ConfigError, match="data.pack=true needs a model that keeps packed records apart"):
        build_datasets(compose_config(["model=gpt2_tiny", "data.pack=true", *base]))
    assert "data.pack=true packs chat records" in cli_error(["data=jsonl", f"data.path={path}", "data.pack=true"],
                                                            capsys)


def test_a_tool_turn_needs_a_template_that_renders_it(checkpoints, tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": [
        {"role": "user", "content": "Look it up."}, {"role": "tool", "content": "lookup says 42"},
        {"role": "assistant", "content": "It is 42."}]}])
    train, _ = build_datasets(chat_cfg(checkpoints / "llama", path))  # ChatML renders any role
    assert "lookup says 42" in chat_tokenizer().decode(train.input_ids[1].tolist())
    assert label_text(train, 1) == "It is 42." + END
    no_tools = chat_tokenizer()
    no_tools.chat_template = CHATML.replace("{% for message in messages %}",
                                            "{% for message in messages if message['role'] != 'tool' %}")
    no_tools.save_pretrained(tmp_path / "no_tools")
    line = cli_error([f"model.pretrained={checkpoints / 'plain'}", f"data.tokenizer={tmp_path / 'no_tools'}",
                      "data=chat", f"data.path={path}", "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert f"{path} line 2: message 2 has role 'tool', which this chat template does not render" in line


# --------------------------------------------------------------------------- templates


LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
         "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Llama 2 and Mistral: no assistant header, so add_generation_prompt rightly changes nothing.
LLAMA2 = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token }}[INST] {{ message['content'] }}"
          " [/INST]{% else %} {{ message['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
PLAIN_TEXT = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
# ChatML whose generation prompt is missing: the assistant's header is written only inside its turn.
NO_GENERATION_PROMPT = CHATML[: CHATML.index("{% if add_generation_prompt %}")]


def styled_tokenizer(template: str, eos: str, *special: str):
    """The test tokenizer with another model family's special tokens, eos and chat template."""
    tokenizer = chat_tokenizer()
    tokenizer.add_tokens(list(special), special_tokens=True)
    tokenizer.eos_token, tokenizer.chat_template = eos, template
    return tokenizer


@pytest.mark.parametrize("template, eos, special, stop", [
    (CHATML, "<|endoftext|>", (), END),  # Qwen2.5: text ends with <|endoftext|>, a turn with <|im_end|>
    (LLAMA3, "<|end_of_text|>", ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
     "<|eot_id|>"),
    (GEMMA, "<eos>", ("<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
    (LLAMA2, "</s>", ("</s>",), "</s>"),
    (PLAIN_TEXT, "<|endoftext|>", (), None),  # a text marker would stop wherever the text occurs
    (None, "<|endoftext|>", (), None),
], ids=["qwen2.5", "llama3.1", "gemma", "llama2", "plain-text", "no-template"])
def test_the_end_of_turn_token_is_read_from_the_template(template, eos, special, stop):
    tokenizer = styled_tokenizer(template, eos, *special)
    expected = None if stop is None else tokenizer.convert_tokens_to_ids(stop)
    assert end_of_turn_id(tokenizer) == expected


def test_a_template_that_ignores_the_generation_prompt_is_refused(checkpoints, tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 4)
    styled_tokenizer(NO_GENERATION_PROMPT, END).save_pretrained(tmp_path / "no_prompt")
    line = cli_error([f"model.pretrained={checkpoints / 'plain'}", f"data.tokenizer={tmp_path / 'no_prompt'}",
                      "data=chat", f"data.path={path}", "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert f"tokenizer {tmp_path / 'no_prompt'} ignores add_generation_prompt" in line
    # ... while a template with no assistant header (Llama 2, Mistral) ignores it rightly
    styled_tokenizer(LLAMA2, END).save_pretrained(tmp_path / "llama2")
    train, _ = build_datasets(chat_cfg(checkpoints / "plain", path, f"data.tokenizer={tmp_path / 'llama2'}"))
    assert label_text(train, 0) == " Hello. " + END


# --------------------------------------------------------------------------- long records


def test_long_records_are_cut_when_a_reply_token_survives_and_dropped_otherwise(checkpoints, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"instruction": "Hi", "output": "Yo."},  # fits
        {"instruction": "Hi", "output": "a long reply " * 20},  # the reply is cut
        {"instruction": "a long question " * 20, "output": "Yes."},  # the reply starts past seq_len
    ])
    train, _ = build_datasets(chat_cfg(checkpoints / "llama", path, "data.seq_len=32"))
    facts = {key: train.facts[key] for key in ("records", "truncated", "dropped", "rows", "packed")}
    assert facts == {"records": 2, "truncated": 1, "dropped": 1, "rows": 2, "packed": False}
    assert train.facts["tokens"] == int(train.attention_mask.sum())
    assert label_text(train, 0) == "Yo." + END
    assert bool(train.attention_mask[1].all()) and label_text(train, 1).startswith("a long reply")


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_packed_rows_give_the_unpacked_loss(checkpoints, architecture):
    """Summed loss over the replies' tokens: packed rows (records apart by their positions) equal one
    record per padded row. gemma2 adds sliding-window layers, whose window counts within a record."""
    cfgs = [chat_cfg(checkpoints / architecture, EXAMPLES / "chat.jsonl", "data.seq_len=128", f"data.pack={pack}")
            for pack in (False, True)]
    unpacked, packed = (build_datasets(cfg)[0] for cfg in cfgs)
    assert packed.attention_mask is None and len(packed) < len(unpacked) == 40
    assert int((packed.position_ids == 0).sum(dim=1).max()) >= 3  # some row holds several records
    assert int((packed.labels != -100).sum()) == int((unpacked.labels != -100).sum())
    model = build_model(cfgs[0].model)
    sums = []
    with torch.no_grad(), eval_mode(model):
        for dataset in (unpacked, packed):
            rows = torch.arange(len(dataset))
            sums.append(sum(float(model(dataset.take(index), Divisor(1))) for index in rows.split(8)))
    assert sums[1] == pytest.approx(sums[0], rel=1e-5)


# --------------------------------------------------------------------------- runs


def test_a_chat_run_on_a_tiny_checkpoint_evaluates_and_reports_the_data(checkpoints, tmp_path):
    cfg = chat_cfg(checkpoints / "llama", EXAMPLES / "chat.jsonl", f"data.eval_path={EXAMPLES / 'chat_eval.jsonl'}",
                   "data.seq_len=128")
    results = run(cfg, tmp_path, quiet=True)
    assert results["steps"] == 3 and all(math.isfinite(loss) for loss in results["loss"])
    assert math.isfinite(results["eval"][-1]["loss"]) and results["eval"][-1]["items"] > 0
    on_disk = json.loads((tmp_path / "results.json").read_text())["data"]
    assert on_disk["records"] + on_disk["dropped"] == 40 and on_disk["eval"]["records"] == 8


def test_a_fresh_model_runs_on_packed_chat_data(tmp_path):
    cfg = compose_config(["model=llama_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                          "model.intermediate_size=64", "model.vocab_size=512", "data=chat",
                          f"data.path={EXAMPLES / 'chat.jsonl'}", f"data.eval_path={EXAMPLES / 'chat_eval.jsonl'}",
                          "data.seq_len=128", "data.pack=true", "strategy.microbatch_size=2",
                          "strategy.num_microbatches=2", "train.steps=2", "train.untimed_steps=1", "strategy=l2l"])
    results = run(cfg, tmp_path, quiet=True)
    assert math.isfinite(results["eval"][-1]["loss"])
    assert results["data"]["packed"] and results["data"]["rows"] < results["data"]["records"] == 40
