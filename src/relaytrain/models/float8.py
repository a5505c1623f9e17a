"""`precision=amp_fp8` and `precision=cmp_fp8`: the blocks' linear layers compute in FP8.

The algorithm is torchao's float8 training (`torchao.float8.convert_to_float8_training`, its
default recipe: tensorwise dynamic scaling, the inputs and weights cast to e4m3 for the forward,
the output's gradient to e5m2 for the backward, the products in `torch._scaled_mm`, the result
in the input's dtype). Every other operation runs as its bf16 counterpart does: amp_fp8 is
amp_bf16 (fp32 weights, the rest under autocast) with the blocks' projections in FP8, cmp_fp8 is
cmp_bf16 (L2L's bf16 weights on the device, fp32 masters in the eager param server) with them in
FP8. The embeddings, the head and the loss stay in bf16, as torchao advises for the first and last
layers.

The swap happens once, on the built model before any strategy copies or relays a block
(`run.train.train_process`): `Float8Linear` keeps `weight` and `bias` as `nn.Linear` has them, so
checkpoints, the optimizer, DDP, FSDP2's shards and L2L's `functional_call` with relayed weights
see the same parameters under the same names.

FP8 tensor cores are an NVIDIA GPU's of compute capability 8.9 or newer (Ada, Hopper, Blackwell):
elsewhere a run is refused in one line before any process starts (`device_refusal`). A dry run
(the meta device) stands for such a GPU and runs the same modules.
"""

from __future__ import annotations

import torch
from torch import nn

from relaytrain.utils.errors import ConfigError

FP8_CAPABILITY = (8, 9)  # Ada Lovelace: the first with FP8 tensor cores
MULTIPLE = 16  # torch._scaled_mm needs both of a matrix's dimensions divisible by 16


def uses_float8(precision_name) -> bool:
    return str(precision_name).endswith("fp8")


def device_refusal(device_type: str) -> str | None:
    """Why the run's decided device (cpu, cuda or meta) cannot multiply in FP8, or None."""
    if device_type == "meta":
        return None
    if device_type != "cuda":
        return f"this run computes on the {device_type.upper()}" + (
            "" if torch.cuda.is_available() else " (no CUDA device is visible)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < FP8_CAPABILITY:
        return f"this run's {torch.cuda.get_device_name()} has compute capability {major}.{minor}"
    return None


def check_config(precision_name, adapter: str, quantize: str) -> None:
    """What FP8 does not take yet, in one line each: an adapter (its base layers would be swapped
    under LoRA's), a 4-bit base."""
    if not uses_float8(precision_name):
        return
    if adapter != "none":
        raise ConfigError(f"precision={precision_name} with adapter={adapter}: FP8 products for an adapter's "
                          f"frozen base are not built; use precision={_bf16(precision_name)}")
    if quantize != "none":
        raise ConfigError(f"precision={precision_name} with model.quantize={quantize}: a 4-bit base computes "
                          f"in its own kernels; use precision={_bf16(precision_name)}")


def check(precision_name, device_type: str) -> None:
    """One line before any process starts: torchao is missing, or the device has no FP8 units."""
    if not uses_float8(precision_name):
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"precision={precision_name} trains the blocks' linear layers with torchao's float8 "
                          f"recipe, and torchao is not installed ({err}); pip install 'relaytrain[lowbit]'") from err
    why = device_refusal(device_type)
    if why is not None:
        raise ConfigError(f"precision={precision_name} needs FP8 tensor cores, an NVIDIA GPU of compute capability "
                          f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (L40S, RTX 40xx, H100, H200, B200), and "
                          f"{why}; use precision={_bf16(precision_name)}")


def _bf16(precision_name) -> str:
    return str(precision_name).replace("fp8", "bf16")


def float8_blocks(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` inside the model's blocks whose dimensions FP8 products take
    for torchao's `Float8Linear`, in place; the number swapped. An adapter's or a quantized layer
    is not a plain `nn.Linear` and keeps its own."""
    from torchao.float8 import convert_to_float8_training

    swapped = 0

    def takes(module: nn.Module, _name: str) -> bool:
        nonlocal swapped
        if type(module) is not nn.Linear or module.in_features % MULTIPLE or module.out_features % MULTIPLE:
            return False
        swapped += 1
        return True

    for block in model.blocks:
        convert_to_float8_training(block, module_filter_fn=takes)
    if not swapped:
        raise ConfigError(f"the model's blocks have no linear layer FP8 products can take (both dimensions "
                          f"divisible by {MULTIPLE}); use precision=amp_bf16 or cmp_bf16")
    return swapped
