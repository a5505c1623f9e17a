"""What an adapted run reads and writes: peft's adapter directory, and the merged model through
peft's own merge.

Out: `save_adapter` writes the directory `PeftModel.from_pretrained(base, DIR)` loads
(`adapter_config.json`, `adapter_model.safetensors`: peft's `get_peft_model_state_dict`, so a
trained copy in modules_to_save is saved under the module's own name, as peft saves it).
`merged_model` is peft's `merge_and_unload` of that adapter on the exact base (LoRA, DoRA,
lora_bias, embeddings and modules_to_save as peft folds them). In: `read_adapter_weights`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from relaytrain.models.adapter.keys import CONFIG_FILE
from relaytrain.models.adapter.layers import ADAPTER, quiet_peft, trains
from relaytrain.utils.errors import ConfigError, first_line

WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel adds before the base model's names in its files


def read_adapter_weights(directory: str) -> dict[str, torch.Tensor]:
    """A peft adapter directory's weights, named as the base model names them (prefix removed)."""
    from safetensors.torch import load_file

    folder = Path(directory).expanduser()
    if (folder / WEIGHTS_FILE).is_file():
        state = load_file(str(folder / WEIGHTS_FILE))
    elif (folder / "adapter_model.bin").is_file():
        state = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"adapter.pretrained={directory} has no {WEIGHTS_FILE}; give a peft adapter directory")
    return {k.removeprefix(PEFT_PREFIX): v.float() for k, v in state.items()}


def adapter_state(hf_model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What peft's save_pretrained writes of the trained adapter, under its names, in `dtype`. The
    frozen embedding tables are not written again (peft's `save_embedding_layers`, which covers
    a vocabulary resized in training: a run never resizes it); the base is `model.pretrained`."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(hf_model, adapter_name=ADAPTER, save_embedding_layers=False)
    return {PEFT_PREFIX + name: t.detach().to(dtype).contiguous() for name, t in state.items()}


def save_adapter(model, out: Path, base: str | None, dtype: torch.dtype) -> None:
    """The adapter directory PeftModel.from_pretrained(base, out) loads: the config (with the base
    it was trained on, and peft's task type) and the adapter's weights in `dtype`."""
    from safetensors.torch import save_file

    config = model.adapter
    config.base_model_name_or_path = base
    config.task_type = model.objective.peft_task_type
    config.inference_mode = True
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(adapter_state(model.hf_model, dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def merged_model(base_hf, adapter_dir: Path, asked_by: str = "adapter.merge_on_save",
                 otherwise: str = "save the adapter instead (adapter.merge_on_save=false)"):
    """peft's own merge: the adapter in `adapter_dir` loaded by PeftModel onto `base_hf` (the
    exact base, a model of its own: it is changed) and folded in by `merge_and_unload`. Where
    peft cannot, one line: what asked for the merge (`asked_by`) and what to do `otherwise`."""
    from peft import PeftModel

    try:
        with quiet_peft():
            return PeftModel.from_pretrained(base_hf, str(adapter_dir)).merge_and_unload()
    except (ValueError, RuntimeError) as err:
        raise ConfigError(f"{asked_by}: peft could not merge the adapter ({_why(err)}); {otherwise}") from err


def _why(err: BaseException) -> str:
    """What a peft error says: the first tensor that does not fit, where torch lists them after a header."""
    lines = [line.strip() for line in str(err).splitlines()]
    return next((line for line in lines if line.startswith("size mismatch")), first_line(err))


def unwrapped_state(hf_model) -> dict[str, torch.Tensor]:
    """The frozen base of an injected model under the base model's own names (what
    AutoModel*.from_pretrained loads): peft's wrappers' originals, no adapter."""
    state = {}
    for name, t in hf_model.state_dict(keep_vars=True).items():
        if not trains(name):
            state[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = t
    return state


def adapter_base(directory: str) -> str | None:
    """The base model an adapter directory names (peft's `base_model_name_or_path`)."""
    return json.loads((Path(directory) / CONFIG_FILE).read_text()).get("base_model_name_or_path")


def is_adapter_dir(directory: str) -> bool:
    return (Path(directory).expanduser() / CONFIG_FILE).is_file()
