"""Build a layered model from the `model` config: a fresh one, or `model.pretrained`'s weights.

The run hands the builder what the config's names name, looked up once (`relaytrain.run.resolve`):
the family and the objective (`family=`, `objective=`). A caller that holds only a config (a
test, a script, a notebook, the planner's cost estimates) passes neither, and `_family` and
`_objective` look them up by name.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from omegaconf import OmegaConf

# The families register themselves when their modules are imported: every one is imported here.
from relaytrain.models import adapter as adapters
from relaytrain.models import bert, decoder, gpt2, moe, quantize, quantize_experts  # noqa: F401
from relaytrain.models.adapter.experts import adapted_experts, expert_adapters
from relaytrain.models.family import Family, families, family_of, family_spec
from relaytrain.models.layered import Block, LayeredModel, MicroBatch
from relaytrain.models.pretrained import load_hf_config
from relaytrain.objectives import objective as objective_named
from relaytrain.objectives.chunked import AUTO
from relaytrain.schema.config import Quantize
from relaytrain.utils.errors import ConfigError, first_line

__all__ = ["Block", "Family", "LayeredModel", "MicroBatch", "build_model", "check_model", "count_parameters",
           "families", "check_adapter", "family_of", "family_spec", "hf_config", "part_parameters",
           "Trains", "TrainedParts", "trained_parts", "what_trains"]


def _family(m, family: Family | None) -> Family:
    """`family`, or for a caller without the run's resolved one, the family `model.family` names."""
    return family if family is not None else family_spec(m.family)


def _objective(m, objective):
    """`objective`, or for a caller without the run's resolved one, the one `model.task` names."""
    return objective if objective is not None else objective_named(m.task)


def auto_class(objective):
    """transformers' auto class of the model whose head `objective` trains."""
    return getattr(transformers, objective.head)


def hf_config(m, family: Family | None = None):
    """The Hugging Face config that the `model` keys describe (no weights), as the family maps
    them, with the attention kernel it will run (`model.attn_implementation` where the
    architecture has it)."""
    family = _family(m, family)
    config = family.hf_config(m)
    config._attn_implementation = family.attention(config, m.attn_implementation)
    return config


def build_model(m, seed: int = 0, quiet: bool = False, device: torch.device | None = None,
                adapter=None, compact_base: bool = False, family: Family | None = None,
                objective=None, one_block: bool = False) -> LayeredModel:
    """A layered model on the CPU in fp32; strategies move what they need to the device.

    With `model.pretrained` (after `pretrained.resolve` made the config agree with it) the
    checkpoint's weights; a head the checkpoint lacks (another task, another number of labels)
    is initialised from `seed`, and unless `quiet` one line names the weights that are new.
    On the meta `device` (a dry run) the model is shapes only: no weights are read or made.
    With an `adapter` config (adapter=lora) its adapters are injected and the rest is frozen
    (with `model.quantize=nf4` the blocks' linear weights first become NF4, `models.quantize`);
    `compact_base` then keeps the frozen base in the checkpoint's own half precision (a param
    server that keeps it on the host: half the bytes, every value as stored). `family`,
    `objective`: the run's, resolved (see the module's docstring). `one_block`: the model cut to
    one block of fresh weights (`_one_block_config`), what the cost models read shapes off.
    """
    if one_block:
        m = _one_block_config(m)
    torch.manual_seed(seed)
    family, objective = _family(m, family), _objective(m, objective)
    auto = auto_class(objective)
    if device is not None and device.type == "meta":
        from relaytrain.models import dry_attention  # registers the dry run's attention

        config = hf_config(m, family)
        attention = config._attn_implementation
        experts = {"experts_implementation": moe.DRY_EXPERTS} if moe.expert_count(config) else {}  # grouped_mm's footprint
        with torch.device("meta"):
            hf_model = auto.from_config(config, attn_implementation=dry_attention.NAME if attention == "sdpa" else attention,
                                        **experts)
    elif m.pretrained:
        adapted = adapter is not None and adapters.enabled(adapter)
        half = m.checkpoint_dtype in ("bfloat16", "float16") and adapted and compact_base
        hf_model, fresh, mxfp4 = _load_pretrained(m, auto, family, objective,
                                                  getattr(torch, m.checkpoint_dtype) if half else torch.float32)
        if mxfp4 and not quiet:
            print(f"model.pretrained={m.pretrained}: its experts are stored in MXFP4; loaded dequantized "
                  f"(fp32 masters{', then NF4 under model.quantize=nf4' if adapted else ''})", flush=True)
        if fresh and not quiet:
            shown = ", ".join(fresh[:4]) + (f" and {len(fresh) - 4} more" if len(fresh) > 4 else "")
            print(f"model.pretrained={m.pretrained}: a new {objective.name} head"
                  f"{f' with {m.num_labels} labels' if objective.classifies else ''}; "
                  f"freshly initialised: {shown}", flush=True)
    else:
        config = hf_config(m, family)
        hf_model = auto.from_config(config, attn_implementation=config._attn_implementation)
    hf_model.train()
    model = family.layered(hf_model, objective)
    model.loss_chunks = dataclasses.replace(model.loss_chunks, setting=getattr(m, "loss_chunk_tokens", AUTO))
    if adapter is not None and adapters.enabled(adapter):
        if str(getattr(m, "quantize", "none")) == quantize.NF4:  # the frozen base in 4 bits, before peft wraps it
            quantize.quantize_blocks(model, bool(m.quantize_double), device)
            quantize_experts.quantize_blocks_experts(model, bool(m.quantize_double), device)
        adapters.attach(model, adapter, m.checkpoint_dtype if m.pretrained else None, quiet=quiet)
    return model


def _load_pretrained(m, auto, family: Family, objective, dtype: torch.dtype = torch.float32) -> tuple:
    """The checkpoint under `auto`'s head, with the run's dropout and number of labels, in
    `dtype`; the names of the weights the checkpoint did not have (initialised here); and whether
    its experts were stored in MXFP4 (loaded dequantized)."""
    config = load_hf_config(m.pretrained, m.trust_remote_code)
    family.set_dropout(config, m.dropout)
    family.run_settings(config, m)
    attention = family.attention(config, m.attn_implementation)
    if objective.classifies:
        config.num_labels = m.num_labels
    if m.pad_token_id is not None:  # a classifier's padding id the checkpoint lacked (`pretrained.resolve`)
        config.pad_token_id = m.pad_token_id
    local = Path(m.pretrained).expanduser()
    source = str(local) if local.exists() else m.pretrained
    quiet_loading = _no_progress_bars()
    try:
        # fp32 whatever the checkpoint stores (most are bf16): these are the weights the optimizer
        # updates, its masters; train.save_model writes them back in the checkpoint's dtype.
        mxfp4 = quantize.stored_in_mxfp4(config)
        hf_model, info = auto.from_pretrained(source, config=config, attn_implementation=attention,
                                              ignore_mismatched_sizes=True, output_loading_info=True,
                                              dtype=dtype, trust_remote_code=m.trust_remote_code,
                                              **(_dequantized_as_loaded() if mxfp4 else {}))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.pretrained={m.pretrained} could not be loaded ({first_line(err)}); "
            f"give a local Hugging Face model directory, or a hub id while online"
        ) from err
    finally:
        quiet_loading()
    fresh = sorted(set(info.get("missing_keys", [])) | {key for key, *_ in info.get("mismatched_keys", [])})
    return hf_model, fresh, mxfp4


def _dequantized_as_loaded() -> dict:
    """`from_pretrained`'s keys that dequantize MXFP4 experts as they load."""
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _no_progress_bars():
    """Hugging Face's loading bars off (the run prints its own progress); returns what restores them."""
    from transformers.utils import logging

    if not logging.is_progress_bar_enabled():
        return lambda: None
    logging.disable_progress_bar()
    return logging.enable_progress_bar


def count_parameters(m, family: Family | None = None, objective=None) -> int:
    """Parameters of the model the config describes, computed on the meta device (no memory)."""
    with torch.device("meta"):
        hf_model = auto_class(_objective(m, objective)).from_config(hf_config(m, family))
    unique = {id(p): p.numel() for p in hf_model.parameters()}
    return sum(unique.values())


def part_parameters(m, adapter=None, family: Family | None = None, objective=None) -> tuple[int, int, int]:
    """Parameters of the embeddings, of one block and of the head of the model the config
    describes (a tied weight counted once, with the embeddings), from a one-block model on the
    meta device: what the cost models and the profile scale by the number of blocks. With an
    `adapter` config its adapters are counted too (what trains of them: `trained_parts`)."""
    with torch.device("meta"):
        model = build_model(m, quiet=True, adapter=adapter, family=family, objective=objective, one_block=True)
    seen: set[int] = set()

    def count(module) -> int:
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    return count(model.embed), count(model.blocks[0]), count(model.head)


# The `model.architecture` values that make every layer of a mixture routed: none dense first
# (DeepSeek-V3's, GLM-4.5's first_k_dense_replace), none dense between (Qwen's).
_EVERY_LAYER_ROUTED = {"first_k_dense_replace": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}


def _one_block_config(m):
    """The `model` config `m` cut to one block of fresh weights: shapes for the meta device. A
    mixture with dense layers is cut to an expert layer: the largest block, which the cost models
    scale by the layer count (so they count the dense layers as expert layers, a few per cent
    over; what trains under an adapter is counted on the whole model, `what_trains`)."""
    one_block = copy.deepcopy(m)
    one_block.num_layers, one_block.pretrained, one_block.resolved_from = 1, None, None
    for key, routed in _EVERY_LAYER_ROUTED.items():
        if one_block.architecture and one_block.architecture.get(key):
            one_block.architecture[key] = routed
    return one_block


class Trains(NamedTuple):
    """What trains under an adapter, as peft builds the model: the trained parameters (each once)
    of the embeddings, of every block together and of the head; of the blocks', those of LoRA on
    fused experts (`expert_adapters`: expert parallelism cuts them with the experts); a routed
    block's fused expert tensors (mlp.experts.gate_up_proj) and those no adapter adapts."""

    embed: int
    blocks: int
    head: int
    block_experts: int = 0
    experts: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()

    @property
    def parameters(self) -> int:
        return self.embed + self.blocks + self.head

    @classmethod
    def of(cls, model: LayeredModel) -> Trains:
        """Counted on a built model (on the meta device or not), before any placement cuts it."""
        seen: set[int] = set()

        def trained(*modules) -> int:
            fresh = [p for module in modules for p in module.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in fresh)
            return sum(p.numel() for p in fresh)

        experts, frozen = next((found for block in model.blocks if (found := adapted_experts(block.layer))[0]), ([], []))
        on_experts = trained(*(part for block in model.blocks for part in expert_adapters(block)))
        return cls(trained(model.embed), on_experts + trained(*model.blocks), trained(model.head), on_experts,
                   tuple(experts), tuple(frozen))


_adapted: dict[str, Trains] = {}  # one model per config asked: the planner asks per candidate


def what_trains(m, a, family: Family | None = None, objective=None) -> Trains | None:
    """What trains of the model `m` describes under the adapter `a`; None without one (every
    parameter). Counted on the whole model built on the meta device with every layer as the model
    has it: peft's choice of targets depends on every layer (all-linear names gate_proj where a
    dense MLP or a shared expert has one, and peft then adapts the fused experts of every routed
    layer too), so no single block can stand for the rest."""
    if not adapters.enabled(a):
        return None
    family, objective = _family(m, family), _objective(m, objective)
    key = f"{family.name}\n{objective.name}\n{OmegaConf.to_yaml(m)}\n{OmegaConf.to_yaml(a)}"
    if key not in _adapted:
        whole = copy.deepcopy(m)
        whole.pretrained, whole.resolved_from = None, None  # shapes only: the keys already agree with it
        with torch.device("meta"):
            model = build_model(whole, quiet=True, adapter=a, family=family, objective=objective)
        _adapted.clear()
        _adapted[key] = Trains.of(model)
    return _adapted[key]


class TrainedParts(NamedTuple):
    """Trained parameters of the embeddings, of a block and of the head (`part_parameters`' shape
    for the cost models), and of the block's, those of LoRA on its fused experts."""

    embed: int
    block: int
    head: int
    block_experts: int = 0


def trained_parts(m, a, family: Family | None = None, objective=None) -> TrainedParts:
    """`TrainedParts` under the adapter `a` (enabled), a block's the mean over the blocks (rounded up)."""
    t = what_trains(m, a, family, objective)
    return TrainedParts(t.embed, -(-t.blocks // m.num_layers), t.head, -(-t.block_experts // m.num_layers))


def check_model(m, a, family: Family, objective, defaults) -> None:
    """What the builder says of the model keys `m` and the adapter keys `a` (`defaults`: an
    AdapterConfig, to tell the keys a run sets), with the run's `family` and `objective`: the
    keys describe a model the family takes, the adapter's keys fit it, a quantized base has an
    adapter and a checkpoint. ConfigError, one line, on the first problem."""
    # The keys must describe a model the family takes (a checkpoint's config was asked), with the head.
    config = load_hf_config(m.pretrained, m.trust_remote_code) if m.pretrained else family.hf_config(m)
    _check_head(config, objective)
    stray = adapters.set_without_adapter(a, defaults)
    if stray:
        raise ConfigError(f"{' and '.join(stray)} set, but adapter=none trains every weight in full; "
                          f"add adapter=lora, or drop the adapter.* keys")
    check_adapter(m, a, defaults, family, objective)
    _check_quantize(str(m.quantize), bool(m.quantize_double), adapted=adapters.enabled(a), pretrained=m.pretrained,
                    trust_remote_code=m.trust_remote_code, merge_on_save=a.merge_on_save)


def _check_head(hf_config, objective) -> None:
    """transformers has the objective's head for the model's type (a decoder type may have no
    sequence classifier); a checkpoint with code of its own says so itself."""
    mapping = auto_class(objective)._model_mapping
    if getattr(hf_config, "auto_map", None) or type(hf_config) in mapping:
        return
    raise ConfigError(f"a {hf_config.model_type} model has no {objective.head.removeprefix('AutoModelFor')} head "
                      f"in transformers, which objective={objective.name} trains; use a model type that has one "
                      f"(e.g. llama, qwen3, mistral)")


def check_adapter(m, a, defaults, family: Family | None = None, objective=None) -> None:
    """The adapter keys `a` on their own and against the model `m` describes: named target
    modules against its layers, built on the meta device (shapes, no weights). `defaults`: an
    AdapterConfig, to tell the keys a run sets. ConfigError, one line, on the first problem."""
    named = adapters.enabled(a) and not a.pretrained and (adapters.ALL_LINEAR not in a.target_modules
                                                          or bool(a.target_parameters))  # a mixture's fused experts
    shapes = build_model(m, quiet=True, device=torch.device("meta"), family=family, objective=objective) if named else None
    adapters.check(a, m, shapes, defaults=defaults)


def _check_quantize(quantize: str, double: bool, *, adapted: bool, pretrained: str | None, trust_remote_code: bool,
                    merge_on_save: bool) -> None:
    """A quantized base (model.quantize, model.quantize_double) is frozen: it needs an adapter
    to train (`adapted`), and a checkpoint (model.pretrained) to quantize."""
    if quantize == str(Quantize.none):
        if double:
            raise ConfigError("model.quantize_double=true set, but model.quantize=none; add model.quantize=nf4 "
                              "(or adapter=qlora), or drop model.quantize_double")
        return
    if not adapted:
        raise ConfigError(f"model.quantize={quantize}: a full fine-tune cannot train {quantize} weights "
                          f"(adapter=none); add adapter=lora (or use adapter=qlora), or drop model.quantize")
    if not pretrained:
        raise ConfigError(f"model.quantize={quantize} quantizes the weights of model.pretrained; give one "
                          f"(a model made from scratch has no base worth keeping frozen)")
    saved_quantized = getattr(load_hf_config(pretrained, trust_remote_code), "quantization_config", None) is not None
    if merge_on_save and saved_quantized:
        raise ConfigError(f"adapter.merge_on_save=true: model.pretrained={pretrained} holds only 4-bit weights, no "
                          f"original to merge into; save the adapter (merge_on_save=false), or train over the "
                          f"bf16/fp32 checkpoint with model.quantize=nf4")
