"""Which layers peft adapts and which parameters train: the names every other adapter module
shares (so none of them imports another for a name)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

from torch import nn

from relaytrain.utils.errors import ConfigError

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name: the one adapter a run trains
# The names peft gives what trains: LoRA's matrices (and DoRA's magnitudes, LoRA's bias on
# lora_B, an embedding's lora_embedding_A/B), and the trained copy of a module in modules_to_save.
TRAINED_MARKS = (".lora_", ".modules_to_save.")


def trains(name: str) -> bool:
    """Whether a parameter of the injected model trains (the rest is the frozen base)."""
    return any(mark in name for mark in TRAINED_MARKS)


@contextmanager
def quiet_peft():
    """peft's warnings say nothing to a user of relaytrain: transformers 5's deprecation of
    `is_gradient_checkpointing`, and its notes on embeddings, ties and LoRA biases (relaytrain
    refuses in one line what would go wrong: `inject._refuse_tied`, `inject._refuse_unmergeable`).
    And one that is wrong: where peft turns gate_proj / up_proj into LoRA on a mixture's fused
    gate_up_proj, it doubles that parameter's rank by a rank and alpha pattern, applies it (A is
    2r rows an expert), then checks the pattern against module names and calls it unmatched."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*(embedding|fan_in_fan_out|tie_word_embeddings|lora_bias).*")
        warnings.filterwarnings("ignore", message=r".*_pattern keys did not match any targeted module.*gate_up_proj")
        yield


def target_names(model, wanted: list[str]) -> dict[str, nn.Module]:
    """The layers `wanted` names, by full name: all-linear, every linear layer of the blocks (as
    peft's all-linear, which leaves the output layer out); else name endings, which may also name
    an embedding table or the head's linear layer (embed_tokens, lm_head)."""
    names = {id(module): name for name, module in model.hf_model.named_modules()}
    blocks = {names[id(module)]: module for block in model.blocks for module in block.layer.modules()
              if _is_linear(module)}
    if ALL_LINEAR in wanted:
        return blocks
    layers = {name: module for name, module in model.hf_model.named_modules() if _adaptable(module)}
    chosen = {name: module for name, module in layers.items() if any(_ends_with(name, w) for w in wanted)}
    if not chosen:
        endings = sorted({name.rsplit(".", 1)[-1] for name in blocks})
        raise ConfigError(f"adapter.target_modules={wanted} matches no linear layer of the blocks (nor an embedding "
                          f"or head layer); they end in {', '.join(endings)} (or use all-linear)")
    return chosen


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linear layers, weights stored (in, out))."""
    return type(module).__name__ == "Conv1D"


def _is_linear(module: nn.Module) -> bool:
    """A linear layer LoRA can adapt: nn.Linear, or GPT-2's Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _adaptable(module: nn.Module) -> bool:
    return _is_linear(module) or isinstance(module, nn.Embedding)


def _ends_with(name: str, ending: str) -> bool:
    return name == ending or name.endswith("." + ending)


def short_names(model, targets: dict[str, nn.Module]) -> list[str]:
    """The targets as peft writes them in adapter_config.json: their name endings, where those
    name no other layer of the model (BERT's pooler is also a `dense`); else the full names."""
    endings = sorted({name.rsplit(".", 1)[-1] for name in targets})
    matched = {name for name, module in model.hf_model.named_modules()
               if any(_ends_with(name, e) for e in endings) and _adaptable(module)}
    return endings if matched == set(targets) else sorted(targets)
