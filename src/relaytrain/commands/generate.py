"""`relaytrain generate`: what a saved model answers to a prompt.

    relaytrain generate model.pretrained=DIR prompt="What is 2+2?" [max_new_tokens=64] [chat=auto]
                        [do_sample=true temperature=0.7 top_p=0.9 seed=0]

DIR is a Hugging Face causal-LM directory with its tokenizer: a run's RUN_DIR/model
(`train.save_model=true`), or any checkpoint `relaytrain train model.pretrained=DIR` takes.
Hugging Face's own `generate` decodes, on the GPU when there is one, so what this prints is
what anyone who loads the directory with transformers gets. Only the new text is printed. It
stops at the generation config's stop ids (a run's saved model lists its chat template's
end-of-turn token there) and, for a chat prompt, at that end-of-turn token in any case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from relaytrain.utils.errors import ConfigError, first_line

KEYS = ("model.pretrained", "prompt", "max_new_tokens", "do_sample", "temperature", "top_p", "seed", "chat")
CHAT = ("auto", "true", "false")
BOOLEANS = {"true": True, "false": False}


@dataclass(frozen=True)
class Request:
    """One `relaytrain generate` call, checked."""

    model: str
    prompt: str
    max_new_tokens: int = 64
    do_sample: bool = False  # false: greedy, the same text every time
    temperature: float | None = None  # sampling only; None: the model's generation config decides
    top_p: float | None = None
    seed: int = 0  # sampling draws from it: the same command prints the same text
    chat: str = "auto"  # auto: the tokenizer's chat template when it has one


def parse_request(items: list[str]) -> Request:
    """The KEY=VALUE arguments of `relaytrain generate`, each checked; a mistake is one line."""
    given = key_values(items, KEYS, "generate", 'prompt="What is 2+2?"')
    if not given.get("model.pretrained"):
        raise ConfigError("model.pretrained=DIR is required: a run's model/ directory (train.save_model=true) "
                          "or another Hugging Face causal-LM directory")
    if not given.get("prompt", "").strip():
        raise ConfigError("prompt is empty; give the text the model answers, e.g. prompt=\"What is 2+2?\"")
    do_sample = _choice(given, "do_sample", "false", BOOLEANS)
    for key in ("temperature", "top_p"):
        if key in given and not do_sample:
            raise ConfigError(f"{key}={given[key]} shapes sampling, and decoding is greedy; add do_sample=true "
                              f"or drop {key}")
    return Request(
        model=given["model.pretrained"],
        prompt=given["prompt"],
        max_new_tokens=_number(given, "max_new_tokens", int, 64, lambda v: v >= 1, "a positive integer"),
        do_sample=do_sample,
        temperature=_number(given, "temperature", float, None, lambda v: v > 0, "a positive number"),
        top_p=_number(given, "top_p", float, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        seed=_number(given, "seed", int, 0, lambda v: v >= 0, "an integer >= 0"),
        chat=str(_choice(given, "chat", "auto", {c: c for c in CHAT})),
    )


def key_values(items: list[str], keys: tuple[str, ...], command: str, example: str) -> dict[str, str]:
    """A command's KEY=VALUE arguments by key (`keys`: those it takes); a mistake is one line
    naming `relaytrain COMMAND` and an `example` argument."""
    given: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"{item!r} is not KEY=VALUE; e.g. {example} (see relaytrain {command} --help)")
        if key not in keys:
            raise ConfigError(f"unknown key {key!r} for relaytrain {command}; keys: {', '.join(keys)}")
        given[key] = value
    return given


def _number(given: dict, key: str, kind: type, default, valid, what: str):
    if key not in given:
        return default
    try:
        value = kind(given[key])
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)) or not valid(value):
        raise ConfigError(f"{key}={given[key]} must be {what}")
    return value


def _choice(given: dict, key: str, default: str, choices: dict):
    value = given.get(key, default).lower()
    if value not in choices:
        raise ConfigError(f"{key}={given[key]} must be one of {', '.join(choices)}")
    return choices[value]


# ----------------------------------------------------------------------------- loading


def load(path: str):
    """The causal LM and its tokenizer in `path`, the weights in the dtype they were saved in; a
    peft adapter directory (adapter=lora) on the base it names."""
    from relaytrain.models import adapter

    if adapter.is_adapter_dir(path):
        return _load_adapted(path)
    return _load_model(path)


def _load_adapted(path: str):
    """An adapter directory's base (peft's base_model_name_or_path) with the adapter on it; the
    adapter's tokenizer where it has one (a relaytrain run saves it there), else the base's."""
    from peft import PeftModel

    from relaytrain.data.tokenizer import TOKENIZER_FILES
    from relaytrain.models import adapter

    base = adapter_base_of(path)
    model, tokenizer = _load_model(base)
    if any((Path(path).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = load_tokenizer(path)
    try:
        with adapter.quiet_peft():
            model = PeftModel.from_pretrained(model, _local_or_id(path))
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError(f"model.pretrained={path}: the adapter does not fit its base {base} ({first_line(err)})") from err
    return model.eval(), tokenizer


def adapter_base_of(path: str, remedy: str = "set base_model_name_or_path in its adapter_config.json") -> str:
    """The base model of the adapter directory `path`: one a run saved beside it, else the one
    adapter_config.json names; one line, ending with `remedy`, where it names none or one gone."""
    from relaytrain.models import adapter

    base = _base_beside(path) or adapter.adapter_base(path)
    if not base:
        raise ConfigError(f"model.pretrained={path} is a LoRA adapter that names no base model; {remedy}")
    if Path(base).is_absolute() and not Path(base).exists():
        raise ConfigError(f"model.pretrained={path} is a LoRA adapter whose base {base} does not exist; "
                          f"put the base there, or {remedy}")
    return base


def _base_beside(path: str) -> str | None:
    """The base a run saved beside its adapter (one trained over a model made from scratch), where
    the directory is now: the adapter names it by the absolute path it was saved at, which a
    moved or copied run no longer has."""
    from relaytrain.records.export import FRESH_BASE

    beside = Path(path).expanduser() / FRESH_BASE
    return str(beside) if (beside / "config.json").is_file() else None


def _load_model(path: str):
    from transformers import AutoModelForCausalLM

    from relaytrain.models.pretrained import checkpoint_objective, load_hf_config
    from relaytrain.objectives import objectives

    config = load_hf_config(path)  # one line for a directory without config.json, or a model that brings code
    head = checkpoint_objective(config)
    if head is None or not head.predicts_next_token:
        causal = " or ".join(name for name, spec in objectives().items() if spec.predicts_next_token and ":" not in name)
        raise ConfigError(f"model.pretrained={path} holds a {', '.join(config.architectures or [config.model_type])} "
                          f"({head.name if head else 'no head'}); generate needs a causal language model "
                          f"(model.task={causal})")
    tokenizer = load_tokenizer(path)
    quiet = quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(_local_or_id(path), dtype="auto")
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.pretrained={path}: its weights could not be loaded ({first_line(err)})") from err
    finally:
        quiet()
    return model.eval(), tokenizer


def load_tokenizer(path: str):
    """The tokenizer saved beside the model; generation needs one to read the prompt and write the answer."""
    from transformers import AutoTokenizer

    from relaytrain.data.tokenizer import TOKENIZER_FILES

    local = Path(path).expanduser()
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"model.pretrained={path} has no tokenizer; save one beside the model (tokenizer."
                          f"save_pretrained), or train on text data or from a checkpoint that has one")
    try:
        return AutoTokenizer.from_pretrained(_local_or_id(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.pretrained={path}: its tokenizer could not be loaded ({first_line(err)})") from err


def _local_or_id(path: str) -> str:
    local = Path(path).expanduser()
    return str(local) if local.exists() else path


def quiet_transformers():
    """Hugging Face's loading bars and notices off (stdout carries only the answer); returns what restores them."""
    from transformers.utils import logging

    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()

    def restore() -> None:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()

    return restore


# ----------------------------------------------------------------------------- generating


def templated(tokenizer, chat: str) -> bool:
    """Whether the prompt goes in a user turn of the chat template (see `prompt_ids`)."""
    if chat == "true" and not tokenizer.chat_template:
        raise ConfigError("chat=true needs a tokenizer with a chat template, and this one has none; "
                          "use chat=false to continue the raw text")
    return chat == "true" or (chat == "auto" and bool(tokenizer.chat_template))


def stop_ids(generation, tokenizer, chat: str) -> list[int]:
    """The ids generation stops at: the generation config's (a run's saved model lists its chat
    template's end-of-turn token there) and, for a templated prompt, that end-of-turn token too:
    a LoRA adapter directory has no generation config of its own, and its base's may stop only
    at the end of text (Qwen2.5's <|endoftext|>, not <|im_end|>), running the reply on to
    max_new_tokens."""
    from relaytrain.data.chat import end_of_turn_id

    given = generation.eos_token_id
    stops = [given] if isinstance(given, int) else list(given or [])
    turn = end_of_turn_id(tokenizer) if templated(tokenizer, chat) else None
    if turn is not None and turn not in stops:
        stops.append(turn)
    return stops


def prompt_ids(tokenizer, prompt: str, chat: str) -> torch.Tensor:
    """The prompt as a [1, length] id tensor: a user turn in the tokenizer's chat template, ready for
    the assistant's answer (chat=auto when there is a template, chat=true), or the raw text."""
    if not templated(tokenizer, chat):
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    # The template writes every special token it wants (a BOS among them); adding them again would double them.
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def new_token_ids(request: Request, model, tokenizer) -> torch.Tensor:
    """The ids `model.generate` adds to the prompt (1-D), decoded as `request` says."""
    from transformers import set_seed

    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, request.prompt, request.chat).to(device)
    options: dict = {"max_new_tokens": request.max_new_tokens, "do_sample": request.do_sample}
    if request.do_sample:
        options.update({k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p))
                        if v is not None})
    else:  # greedy: a checkpoint's sampling settings (Qwen's, Llama's) do not apply, and would be warned about
        options.update(temperature=None, top_p=None, top_k=None)
    stops = stop_ids(model.generation_config, tokenizer, request.chat)
    if stops:
        options["eos_token_id"] = stops
    if model.generation_config.pad_token_id is None:  # one prompt, no padding: any id will do, eos is customary
        options["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if untokened := wordless_ids(model, tokenizer):
        options["suppress_tokens"] = untokened
    set_seed(request.seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
    return out[0, ids.shape[1]:]


def wordless_ids(model, tokenizer) -> list[int]:
    """The embedding rows past the tokenizer's last token: a vocabulary padded for speed (Qwen's
    151,936 rows for 151,665 tokens) or a fresh model whose tokenizer was trained on a small file
    (8,192 rows, a few hundred tokens). No text decodes from them, so they are never generated:
    an answer of such ids would print as nothing."""
    rows = model.get_output_embeddings().weight.shape[0]
    return list(range(len(tokenizer), rows))


def device() -> torch.device:
    """Where generation runs: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Answer:
    """What `relaytrain generate` prints: the new text, and when it is empty, why (for stderr)."""

    text: str
    empty_because: str = ""


def generate(request: Request) -> Answer:
    """The model's answer to the prompt: only the new text, special tokens left out."""
    model, tokenizer = load(request.model)
    model.to(device())
    ids = new_token_ids(request, model, tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text.strip():
        return Answer(text)
    return Answer(text, why_empty(ids.tolist(), tokenizer, stop_ids(model.generation_config, tokenizer, request.chat)))


def why_empty(ids: list[int], tokenizer, stops: list[int]) -> str:
    """Why an answer printed as nothing: the model ended its turn at once (its first token is one
    generation stops at), or what it generated decodes to no text (special tokens, white space)."""
    first = tokenizer.convert_ids_to_tokens(ids[0])
    if ids[0] in stops:
        return (f"the model ended its turn at once: its first new token is {first} (id {ids[0]}), where generation "
                f"stops, so the reply is empty; a model trained little, or on replies that are empty, does this")
    special = set(tokenizer.all_special_ids)
    what = "special tokens" if all(i in special for i in ids) else "white space and special tokens"
    shown = ", ".join(dict.fromkeys(tokenizer.convert_ids_to_tokens(ids[:8])))
    return f"the reply is empty: the model's {len(ids)} new token(s) are {what} ({shown}), which print as nothing"
