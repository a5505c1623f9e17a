"""`adapter=lora`: low-rank adapters through Hugging Face's peft, on any family, as peft builds them.

peft injects its layers into the Hugging Face model in place (`inject_adapter_in_model`): a
targeted linear layer becomes a `lora.Linear` (`base_layer` + `lora_A`/`lora_B`, DoRA's
`lora_magnitude_vector`, `lora_bias`'s bias on `lora_B`), an embedding table a `lora.Embedding`,
and a module in `modules_to_save` a `ModulesToSaveWrapper` (`original_module`, frozen, and its
trained copy `modules_to_save.default`). The layered model's parts are then pointed at what peft
put in place (`inject.repoint_parts`), so every strategy runs the adapted model without knowing
it; what a strategy must know is only which parameters train (`requires_grad`). Everything else is
the frozen *base*: no gradient, no optimizer state, no master copy, never sent back from the device.

- `layers`: which layers peft adapts and which parameters train (names the others share).
- `keys`: the `adapter.*` keys on their own, against the model and against a continued adapter.
- `inject`: peft's config, the injection, the parts re-pointed, weights of `adapter.pretrained`.
- `files`: what is saved (peft's own adapter files; the merged model through peft's merge).
- `fingerprint`: the hash of every byte of the frozen base a checkpoint was trained on.
"""

from relaytrain.models.adapter.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_base,
    adapter_state,
    is_adapter_dir,
    merged_model,
    save_adapter,
    unwrapped_state,
)
from relaytrain.models.adapter.fingerprint import BaseFingerprint, base_fingerprint, same_base
from relaytrain.models.adapter.inject import attach
from relaytrain.models.adapter.keys import check, enabled, saved_config, saved_targets, set_without_adapter
from relaytrain.models.adapter.layers import ADAPTER, ALL_LINEAR, quiet_peft, trains

__all__ = ["ADAPTER", "ALL_LINEAR", "CONFIG_FILE", "WEIGHTS_FILE", "BaseFingerprint", "adapter_base", "adapter_state",
           "attach", "base_fingerprint", "check", "enabled", "is_adapter_dir", "merged_model", "quiet_peft",
           "same_base", "save_adapter", "saved_config", "saved_targets", "set_without_adapter", "trains", "unwrapped_state"]
