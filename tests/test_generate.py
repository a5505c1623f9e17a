"""A run's saved model is a Hugging Face directory users load as it is, and `relaytrain generate`
prints what transformers' own `generate` gives for it.

Checkpoints are tiny real ones (tests/checkpoints.py), each with a byte-level BPE tokenizer and a
ChatML chat template; runs are 3 steps on synthetic data, which reads no tokenizer, so the saved
tokenizer can only come from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from relaytrain.commands.cli import main
from relaytrain.commands.generate import device, load, new_token_ids, parse_request, stop_ids
from relaytrain.models import build_model
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import CHATML, chat_tokenizer, tiny_decoder
from tests.conftest import train_plain_loop

STEPS = 3
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPT = "What is 2+2?"


def saved_cfg(checkpoint, *overrides: str):
    """What `relaytrain train model.pretrained=DIR train.save_model=true ...` runs with."""
    given = [f"model.pretrained={checkpoint}", "data.seq_len=16", "data.num_samples=64", "strategy.microbatch_size=2",
             "strategy.num_microbatches=2", f"train.steps={STEPS}", "train.untimed_steps=1", "train.save_model=true",
             "optim.lr=1e-3", *overrides]
    return resolve(compose_config(given), given)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"llama": tiny_decoder(root / "llama", "llama"), "gemma2": tiny_decoder(root / "gemma2", "gemma2"),
            "llama_bf16": tiny_decoder(root / "llama_bf16", "llama", dtype=torch.bfloat16),
            "bare": tiny_decoder(root / "bare", "llama", tokenizer=False)}


@pytest.fixture(scope="module")
def llama_run(checkpoints, tmp_path_factory):
    """A baseline run's saved model, for the generate tests."""
    run_dir = tmp_path_factory.mktemp("llama_run")
    run(saved_cfg(checkpoints["llama"]), run_dir, table=False)
    return run_dir / "model"


# ----------------------------------------------------------------------------- the saved directory


@pytest.mark.parametrize("strategy", ["baseline", "pipe_flush"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_saved_directory_loads_as_it_is_with_the_runs_weights_and_tokenizer(checkpoints, tmp_path, arch, strategy):
    cfg = saved_cfg(checkpoints[arch], f"strategy={strategy}")
    run(cfg, tmp_path, table=False)
    out = tmp_path / "model"
    assert not (tmp_path / "tokenizer").exists()  # synthetic data: the tokenizer below is the checkpoint's
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = train_plain_loop(cfg, STEPS).hf_model
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4, msg=name)
    if arch == "gemma2":  # tied: one matrix, stored once
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with safe_open(out / "model.safetensors", "pt") as f:
            assert "lm_head.weight" not in f.keys()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == chat_tokenizer().get_vocab() and tokenizer.chat_template == CHATML
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (
        tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_a_bf16_checkpoint_trains_fp32_masters_and_is_saved_back_in_bf16(checkpoints, tmp_path):
    cfg = saved_cfg(checkpoints["llama_bf16"])
    assert cfg.model.checkpoint_dtype == "bfloat16"
    assert {p.dtype for p in build_model(cfg.model).parameters()} == {torch.float32}
    run(cfg, tmp_path / "auto", table=False)
    run(saved_cfg(checkpoints["llama_bf16"], "train.save_dtype=float32"), tmp_path / "fp32", table=False)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "auto" / "model")
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32" / "model")
    assert (bf16.dtype, fp32.dtype) == (torch.bfloat16, torch.float32)
    for run_name, dtype in (("auto", "bfloat16"), ("fp32", "float32")):
        assert json.loads((tmp_path / run_name / "model" / "config.json").read_text())["dtype"] == dtype
    # The same run, saved twice: bf16 holds the fp32 masters rounded, and nothing else.
    for (name, half), (_, full) in zip(bf16.named_parameters(), fp32.named_parameters(), strict=True):
        assert torch.equal(half, full.to(torch.bfloat16)), name
    assert any(not torch.equal(full, full.to(torch.bfloat16).float()) for full in fp32.parameters())


def test_an_explicit_save_dtype_wins_over_a_float32_checkpoint(checkpoints, tmp_path):
    run(saved_cfg(checkpoints["llama"], "train.save_dtype=float16"), tmp_path, table=False)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").dtype == torch.float16


def test_a_checkpoints_own_stop_ids_are_kept_beside_the_tokenizers_eos(tmp_path):
    """Chat checkpoints often stop at several ids (end of turn, end of text); none may be lost."""
    checkpoint = tiny_decoder(tmp_path / "checkpoint", "llama")
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    generation["eos_token_id"] = [5, chat_tokenizer().eos_token_id]
    (checkpoint / "generation_config.json").write_text(json.dumps(generation))
    run(saved_cfg(checkpoint), tmp_path / "run", table=False)
    saved = json.loads((tmp_path / "run" / "model" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [chat_tokenizer().eos_token_id, 5]


def qwen_style_checkpoint(directory) -> tuple:
    """A tiny checkpoint shaped like a Qwen2.5 base: text ends with <|endoftext|> (its eos, and its
    generation config's only stop id) while its ChatML template ends a turn with <|im_end|>."""
    tokenizer = chat_tokenizer()
    tokenizer.eos_token = "<|endoftext|>"
    tiny_decoder(directory, "llama", layers=2, tokenizer=False, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(directory)
    return directory, tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")


def force_every_token(model_dir, token_id: int) -> None:
    """Rewrite a saved llama's weights so that greedy decoding picks `token_id` whatever it reads:
    with the blocks' output projections zero, the last hidden state is the token's embedding, the
    same for every token, and only `token_id`'s output row is non-zero."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    for name, weight in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weight.zero_()
    state["model.embed_tokens.weight"].fill_(1.0)
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][token_id] = 1.0
    save_file(state, str(path), metadata={"format": "pt"})


def test_a_chat_fine_tune_stops_generating_where_a_turn_ends(tmp_path, capsys):
    checkpoint, end_of_text, end_of_turn = qwen_style_checkpoint(tmp_path / "qwen")
    cfg = saved_cfg(checkpoint, "data=chat", f"data.path={EXAMPLES / 'chat.jsonl'}", "data.seq_len=64")
    run(cfg, tmp_path / "run", quiet=True)
    out = tmp_path / "run" / "model"
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [end_of_text, end_of_turn]
    force_every_token(out, end_of_turn)
    args = [f"model.pretrained={out}", f"prompt={PROMPT}", "max_new_tokens=6"]
    model, tokenizer = load(str(out))
    assert new_token_ids(parse_request(args), model, tokenizer).tolist() == [end_of_turn]
    capsys.readouterr()
    assert main(["generate", *args]) == 0
    captured = capsys.readouterr()  # the reply is empty: stdout holds nothing, stderr says why in one line
    assert captured.out == "" and captured.err == (
        "relaytrain: the model ended its turn at once: its first new token is <|im_end|> "
        f"(id {end_of_turn}), where generation stops, so the reply is empty; a model trained little, or on "
        "replies that are empty, does this\n")
    # Stopping only at the end of text, as the checkpoint did, runs on to max_new_tokens.
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    assert model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          eos_token_id=end_of_text)[0, ids.shape[1]:].tolist() == [end_of_turn] * 6


def test_a_reply_of_special_tokens_only_says_why_it_printed_nothing(tmp_path, capsys):
    checkpoint = tiny_decoder(tmp_path / "llama", "llama", layers=2)
    pad = chat_tokenizer().pad_token_id
    force_every_token(checkpoint, pad)  # not a stop id: generation runs on, and nothing decodes
    capsys.readouterr()
    assert main(["generate", f"model.pretrained={checkpoint}", f"prompt={PROMPT}", "max_new_tokens=3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "relaytrain: the reply is empty: the model's 3 new token(s) are special tokens (<|pad|>), which print "
        "as nothing\n")


def test_a_chat_prompt_stops_at_the_end_of_turn_the_generation_config_lacks(tmp_path):
    """A LoRA adapter directory has no generation config; its base's may stop only at the end of text."""
    checkpoint, end_of_text, end_of_turn = qwen_style_checkpoint(tmp_path / "qwen")
    model, tokenizer = load(str(checkpoint))
    assert model.generation_config.eos_token_id == end_of_text
    assert stop_ids(model.generation_config, tokenizer, "auto") == [end_of_text, end_of_turn]
    assert stop_ids(model.generation_config, tokenizer, "false") == [end_of_text]  # raw text: no turns


# ----------------------------------------------------------------------------- relaytrain generate


def direct_new_ids(model_dir, chat: bool, max_new_tokens: int = 8) -> torch.Tensor:
    """What a user gets from transformers alone: greedy `generate` on the templated or raw prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device())  # where the command runs it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    ids = ids.to(device())
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:].cpu()


@pytest.mark.parametrize("chat", ["auto", "false"])
def test_greedy_generate_prints_what_model_generate_gives(llama_run, capsys, chat):
    expected = direct_new_ids(llama_run, chat == "auto")
    args = [f"model.pretrained={llama_run}", f"prompt={PROMPT}", "max_new_tokens=8", f"chat={chat}"]
    assert len(expected) > 0
    model, tokenizer = load(str(llama_run))
    assert torch.equal(new_token_ids(parse_request(args), model.to(device()), tokenizer).cpu(), expected)
    assert main(["generate", *args]) == 0
    assert capsys.readouterr().out == tokenizer.decode(expected, skip_special_tokens=True) + "\n"


def test_sampling_is_reproducible_from_its_seed(llama_run, capsys):
    args = ["generate", f"model.pretrained={llama_run}", f"prompt={PROMPT}", "do_sample=true", "temperature=1.5",
            "top_p=0.95", "max_new_tokens=12"]
    outputs = []
    for seed in (1, 1, 2):
        assert main([*args, f"seed={seed}"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]


@pytest.mark.parametrize("args, says", [
    (["prompt=hi"], "model.pretrained=DIR is required"),
    (["model.pretrained={tmp}", "prompt=hi"], "has no config.json"),
    (["model.pretrained={bare}", "prompt=hi"], "has no tokenizer"),
    (["model.pretrained={llama}", "prompt="], "prompt is empty"),
    (["model.pretrained={llama}", "prompt=   "], "prompt is empty"),
    (["model.pretrained={llama}", "prompt=hi", "max_new_tokens=ten"], "max_new_tokens=ten must be a positive integer"),
    (["model.pretrained={llama}", "prompt=hi", "max_new_tokens=0"], "max_new_tokens=0 must be a positive integer"),
    (["model.pretrained={llama}", "prompt=hi", "do_sample=true", "temperature=hot"], "temperature=hot must be"),
    (["model.pretrained={llama}", "prompt=hi", "do_sample=true", "top_p=1.5"], "top_p=1.5 must be a number in (0, 1]"),
    (["model.pretrained={llama}", "prompt=hi", "temperature=0.7"], "add do_sample=true"),
    (["model.pretrained={llama}", "prompt=hi", "seed=-1"], "seed=-1 must be an integer >= 0"),
    (["model.pretrained={llama}", "prompt=hi", "chat=maybe"], "chat=maybe must be one of auto, true, false"),
    (["model.pretrained={llama}", "prompt=hi", "top_k=5"], "unknown key 'top_k'"),
    (["model.pretrained={llama}", "hi"], "'hi' is not KEY=VALUE"),
])
def test_a_mistake_is_one_line_and_exit_2(checkpoints, tmp_path, capsys, args, says):
    paths = {"tmp": tmp_path, "bare": checkpoints["bare"], "llama": checkpoints["llama"]}
    assert main(["generate", *(a.format(**paths) for a in args)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("relaytrain: error: ") and says in line and captured.out == ""


def test_chat_true_without_a_template_is_one_line(llama_run, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(llama_run)
    tokenizer.chat_template = None
    plain = tmp_path / "plain"
    AutoModelForCausalLM.from_pretrained(llama_run).save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    assert main(["generate", f"model.pretrained={plain}", "prompt=hi", "chat=true"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "chat=true needs a tokenizer with a chat template" in line


def test_generate_has_its_help_and_is_listed(capsys):
    assert main(["generate", "--help"]) == 0
    assert "model.pretrained=DIR" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "relaytrain generate" in capsys.readouterr().out


def test_generation_never_picks_an_id_no_token_decodes(tmp_path):
    """An embedding table wider than the tokenizer (a padded vocabulary, or a fresh model beside a
    tokenizer trained on a small file): rows past the last token are never generated, since no
    text decodes from them and the answer would print as nothing."""
    checkpoint = tiny_decoder(tmp_path / "padded", "llama", layers=2, vocab_size=len(chat_tokenizer()) + 64)
    model, tokenizer = load(str(checkpoint))
    rows = model.get_output_embeddings().weight.shape[0]
    assert rows == len(tokenizer) + 64
    force_every_token(checkpoint, rows - 1)  # greedy decoding alone would pick that row every time
    model, tokenizer = load(str(checkpoint))
    args = [f"model.pretrained={checkpoint}", f"prompt={PROMPT}", "max_new_tokens=4", "chat=false"]
    ids = new_token_ids(parse_request(args), model, tokenizer).tolist()
    assert len(ids) == 4 and max(ids) < len(tokenizer)
