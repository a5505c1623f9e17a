"""`train.save_model=true`: the trained model out as a Hugging Face directory, loadable as it is
by `AutoModel*.from_pretrained`, `AutoTokenizer.from_pretrained`, peft's
`PeftModel.from_pretrained` (an adapter run) and `relaytrain generate`: the weights in
train.save_dtype, the run's tokenizer with its chat template, and a generation config that
stops where the chat template ends a turn."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from relaytrain.models import adapter as adapters
from relaytrain.models import build_model
from relaytrain.utils.errors import ConfigError, first_line

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_model(cfg, strategy, gathered: list[dict | None], run_dir: Path, family=None, objective=None) -> Path:
    """Hugging Face `save_pretrained` into run_dir/model, loadable as it is by AutoModel*.from_pretrained,
    AutoTokenizer.from_pretrained and `relaytrain generate`: the weights every process holds (by
    name) in train.save_dtype, the run's tokenizer with its chat template, and a generation config
    that stops where the tokenizer ends a turn. `family`, `objective`: the run's (`build_model`)."""
    merged = {name: t for weights in gathered if weights is not None for name, t in weights.items()}
    # One process whose model holds plain, whole tensors: write them; otherwise a fresh model
    # (a pipeline stage holds part of the model, a sharded strategy parts of every tensor).
    own = strategy.world.size == 1 and all(type(p.data) is torch.Tensor for p in strategy.model.parameters())
    model = strategy.model if own else build_model(cfg.model, cfg.train.seed, quiet=True, adapter=cfg.adapter,
                                                   family=family, objective=objective)
    return write_model(cfg, model, merged, run_dir, run_dir / "model")


def write_model(cfg, model, weights: dict, run_dir: Path, out: Path, merge_key: str = "adapter.merge_on_save") -> Path:
    """`model` (a layered model as `cfg` builds it) with `weights` (by Hugging Face name) written
    into `out` as train.save_model writes it: a model directory, a peft adapter directory, or the
    adapter merged (adapter.merge_on_save; `merge_key`: what the user set to ask for it); with
    the tokenizer of the run in `run_dir`."""
    hf_model = model.hf_model
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
            elif p.requires_grad:  # a frozen base is the checkpoint's, as loaded; what trains must be there
                raise ConfigError(f"no process holds the weights of {name}; the model cannot be saved")
    tokenizer = run_tokenizer(cfg.model.pretrained, cfg.model.trust_remote_code, run_dir)
    if tokenizer is not None and hf_model.can_generate():
        _set_special_ids(hf_model.generation_config, tokenizer, hf_model.get_input_embeddings().weight.shape[0],
                         inherited=bool(cfg.model.pretrained))
    dtype = save_dtype(cfg)
    transformers.utils.logging.disable_progress_bar()  # one shard of a small model: a bar is noise
    if adapters.enabled(cfg.adapter) and cfg.adapter.merge_on_save:
        _save_merged(cfg, model, out, dtype, merge_key)
    elif adapters.enabled(cfg.adapter):
        base = _base_source(cfg.model.pretrained) or _save_fresh_base(model.hf_model, out / FRESH_BASE, dtype, tokenizer)
        adapters.save_adapter(model, out, base, SAVE_DTYPES[dtype])
    else:
        _save_pretrained(hf_model, hf_model.state_dict(keep_vars=True), out, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


FRESH_BASE = "base"  # under run_dir/model: the base of an adapter trained over a model made from scratch


def saved_model_facts(m, a, t, run_dir: Path, objective: Objective) -> dict:
    """results.json's `saved_model` (train.save_model=true; `m`, `a`, `t`: the model, adapter and
    train keys): where the model went and in what form (`model`, a peft `adapter` over `base`, or
    the adapter `merged` into it), its dtype, and whether `relaytrain generate` answers with it
    (the run's `objective` predicts the next token)."""
    if not t.save_model:
        return {}
    out = (Path(run_dir) / "model").resolve()
    form = ("merged" if a.merge_on_save else "adapter") if adapters.enabled(a) else "model"
    base = (_base_source(m.pretrained) or str(out / FRESH_BASE)) if form == "adapter" else None
    return {"saved_model": {"path": str(out), "form": form, "base": base, "dtype": dtype_to_save(t, m),
                            "generates": objective.predicts_next_token}}


def write_merged_adapter(adapter_dir: Path, base_hf, out: Path, dtype: str, tokenizer) -> None:
    """`relaytrain export` of a peft adapter directory: peft's merge_and_unload of it on `base_hf`
    (its base, loaded in fp32), saved in `dtype` with `tokenizer` (None: none) and a generation
    config that stops where the tokenizer ends a turn."""
    merged = adapters.merged_model(base_hf, adapter_dir, asked_by=f"model.pretrained={adapter_dir}",
                                   otherwise="give the base it was trained on with base=DIR")
    if tokenizer is not None and merged.can_generate():
        _set_special_ids(merged.generation_config, tokenizer, merged.get_input_embeddings().weight.shape[0],
                         inherited=True)
    transformers.utils.logging.disable_progress_bar()
    _save_pretrained(merged, merged.state_dict(), out, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _save_pretrained(hf_model, state: dict, out: Path, dtype: str) -> None:
    hf_model.save_pretrained(out, state_dict=_cast_state(state, SAVE_DTYPES[dtype]))
    # save_pretrained records the dtype of the model in memory (the fp32 masters); the files hold `dtype`.
    hf_model.config.dtype = dtype
    hf_model.config.save_pretrained(out)


def _save_merged(cfg, model, out: Path, dtype: str, merge_key: str) -> None:
    """adapter.merge_on_save: peft's merge_and_unload of the trained adapter (saved in fp32 beside,
    then removed) on the exact base, built again as the run built it (`model.pretrained` in fp32,
    or the same seed's fresh model): never the strategy's in-memory base, which may be cast."""
    staging = out.parent / f".{out.name}.adapter"
    adapters.save_adapter(model, staging, _base_source(cfg.model.pretrained), torch.float32)
    try:
        base = build_model(cfg.model, cfg.train.seed, quiet=True).hf_model  # no adapter: never quantized
        merged = adapters.merged_model(base, staging)
        if getattr(model, "quantized", None):
            print(f"{merge_key}: merged into the original (unquantized) weights of model.pretrained="
                  f"{cfg.model.pretrained}; the adapter trained over their {model.quantized} quantization", flush=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    merged.generation_config = model.hf_model.generation_config  # its stop ids, set above
    _save_pretrained(merged, merged.state_dict(), out, dtype)


def _save_fresh_base(hf_model, out: Path, dtype: str, tokenizer) -> str:
    """An adapter over a model made from scratch has no base anywhere else: it is written here
    (with the tokenizer), and the adapter names it, so PeftModel and `relaytrain generate` load it."""
    _save_pretrained(hf_model, adapters.unwrapped_state(hf_model), out, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return str(out.resolve())


def _base_source(pretrained: str | None) -> str | None:
    """What an adapter directory names as its base: the checkpoint's absolute path (the adapter
    then loads from any working directory), a hub id as given, None for a model made from scratch."""
    if not pretrained:
        return None
    local = Path(pretrained).expanduser()
    return str(local.resolve()) if local.exists() else pretrained


def save_dtype(cfg) -> str:
    """The dtype the run's model is saved in (`dtype_to_save` of its train and model keys)."""
    return dtype_to_save(cfg.train, cfg.model)


def dtype_to_save(t, m) -> str:
    """train.save_dtype (`t`: the train keys) with `auto` resolved: the checkpoint's dtype (users
    get back what they started from, e.g. bfloat16), else float32, the dtype the masters trained in."""
    chosen = str(t.save_dtype)
    if chosen != "auto":
        return chosen
    return m.checkpoint_dtype if m.checkpoint_dtype in SAVE_DTYPES else "float32"


def _cast_state(tensors: dict, dtype: torch.dtype) -> dict:
    """A state dict with floating tensors in `dtype`. A tied weight stays one tensor under both
    names: save_pretrained finds ties by shared storage and writes them once."""
    cast: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in tensors.items():
        if id(t) not in cast:
            cast[id(t)] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        state[name] = cast[id(t)]
    return state


def run_tokenizer(pretrained: str | None, trust_remote_code: bool, run_dir: Path):
    """The tokenizer of the run in `run_dir`: the one the run's data used (RUN_DIR/tokenizer),
    else model.pretrained's (synthetic data reads no tokenizer); None when there is neither."""
    from transformers import AutoTokenizer

    from relaytrain.data.tokenizer import may_hold_tokenizer

    source = run_dir / "tokenizer"
    if not source.is_dir():
        if not pretrained or not may_hold_tokenizer(pretrained):
            return None
        local = Path(pretrained).expanduser()
        source = local if local.is_dir() else pretrained  # a hub id, while online
    try:
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # a tokenizer it cannot read must not cost the trained weights
        print(f"train.save_model: the model is saved without a tokenizer: {source}'s could not be loaded "
              f"({first_line(err)})", flush=True)
        return None


def _set_special_ids(generation, tokenizer, vocab_size: int, inherited: bool) -> None:
    """The tokenizer's bos/pad ids into the generation config, and the ids generation stops at:
    the tokenizer's eos and its chat template's end-of-turn token, which differ for chat models
    whose base ends text otherwise (Qwen2.5: <|endoftext|> and <|im_end|>), so that generation
    stops where the reply ends rather than at max_new_tokens. A checkpoint's own stop ids
    (`inherited`) are kept too; a model built here had only the architecture's defaults, which
    need not be tokens of the tokenizer trained for it."""
    from relaytrain.data.chat import end_of_turn_id

    for key in ("bos_token_id", "pad_token_id"):
        if _is_token(ours := getattr(tokenizer, key), vocab_size):
            setattr(generation, key, ours)
    ours = [i for i in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)) if _is_token(i, vocab_size)]
    if not ours:
        return
    given = generation.eos_token_id if inherited else None
    given = [given] if isinstance(given, int) else list(given or [])
    stops = list(dict.fromkeys(ours + [i for i in given if _is_token(i, vocab_size)]))
    generation.eos_token_id = stops if len(stops) > 1 else stops[0]


def _is_token(token_id: int | None, vocab_size: int) -> bool:
    return token_id is not None and 0 <= token_id < vocab_size
