"""`model.quantize=nf4`: the blocks' linear weights held as NormalFloat-4 under an adapter (QLoRA).

The QLoRA paper's format, through bitsandbytes (`quantize_4bit` to make it, its
`dequantize_4bit` op to read it): 16 code values, one absmax scale per block of 64 weights;
with `model.quantize_double` the scales are quantized again (8 bits, blocks of 256, an fp32
offset), as bitsandbytes' `compress_statistics`. Embeddings, norms and the LM head stay as
they are, as bitsandbytes leaves them.

Each quantized layer is an `NF4Linear`: one frozen uint8 parameter, `nf4`, holds everything
(the packed codes, then the scales' bytes), so every strategy carries it as an opaque frozen
tensor: the EPS keeps it once on the host, the relay uploads its 4-bit bytes as they are (a
cast applies to floating tensors only), FSDP2 shards it, pipelines share it between weight
versions, and the fingerprint hashes its bytes. The forward dequantizes it on whatever device
it is on, in the dtype of its input, just before the matmul, and backward dequantizes it again
(`NF4Matmul`, as bitsandbytes' MatMul4Bit): no dense copy outlives either call, so a strategy
that keeps activations for backward keeps the 4-bit bytes, not a dense weight per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from relaytrain.models.adapter.layers import is_conv1d
from relaytrain.utils.errors import ConfigError

NF4 = "nf4"
BLOCK = 64  # weights per absmax scale (the QLoRA paper's)
NESTED_BLOCK = 256  # scales per second-level scale under double quantization (bitsandbytes')
ALIGN = 16  # every stretch of the storage starts here, so a view as fp32 is aligned


def bitsandbytes():
    """bitsandbytes, imported quietly (on a CPU it warns that an optional kernel package is absent)."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    return bnb


@dataclass(frozen=True)
class Layout:
    """Where each piece of one quantized weight lies in its uint8 storage (fixed by its shape)."""

    shape: tuple[int, int]  # (out_features, in_features), the weight's shape as nn.Linear holds it
    double: bool

    @property
    def blocks(self) -> int:
        return -(-self.shape[0] * self.shape[1] // BLOCK)

    def pieces(self) -> list[tuple[str, torch.dtype, int]]:
        """(name, dtype, count) in storage order."""
        codes = [("codes", torch.uint8, -(-self.shape[0] * self.shape[1] // 2))]  # two 4-bit codes a byte
        if not self.double:
            return codes + [("absmax", torch.float32, self.blocks)]
        return codes + [("absmax", torch.uint8, self.blocks), ("offset", torch.float32, 1),
                        ("absmax2", torch.float32, -(-self.blocks // NESTED_BLOCK)), ("code2", torch.float32, 256)]

    def spans(self) -> dict[str, tuple[int, int, torch.dtype]]:
        """name -> (first byte, byte count, dtype)."""
        spans, start = {}, 0
        for name, dtype, count in self.pieces():
            spans[name] = (start, count * dtype.itemsize, dtype)
            start += -(-count * dtype.itemsize // ALIGN) * ALIGN
        return spans

    @property
    def nbytes(self) -> int:
        start, size, _ = list(self.spans().values())[-1]
        return start + size

    def unpack(self, storage: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: storage[start:start + size].view(dtype) for name, (start, size, dtype) in self.spans().items()}


@torch.no_grad()
def pack(weight: torch.Tensor, layout: Layout, device: torch.device | None = None) -> torch.Tensor:
    """`weight` (fp32 values) quantized by bitsandbytes, on `device` where given (a GPU makes it
    fast), into one uint8 tensor on the host."""
    bnb = bitsandbytes()
    codes, state = bnb.functional.quantize_4bit(weight.to(device or weight.device, torch.float32).contiguous(),
                                                blocksize=BLOCK, quant_type=NF4, compress_statistics=layout.double)
    return packed(codes, state, layout)


@torch.no_grad()
def packed(codes: torch.Tensor, state, layout: Layout) -> torch.Tensor:
    """bitsandbytes' packed codes and QuantState in one uint8 tensor on the host (Layout's order)."""
    pieces = {"codes": codes, "absmax": state.absmax}
    if layout.double:
        pieces |= {"offset": state.offset, "absmax2": state.state2.absmax, "code2": state.state2.code}
    storage = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for name, view in layout.unpack(storage).items():
        view.copy_(pieces[name].reshape(-1).to(view.dtype))
    return storage


def dequantize(storage: torch.Tensor, layout: Layout, dtype: torch.dtype) -> torch.Tensor:
    """The weight, (out, in) in `dtype`, on `storage`'s device, through bitsandbytes' ops.

    The codes are read as rows of one block each (or one row where the weight is not whole
    blocks), then shaped: bitsandbytes quantizes blocks of 64 consecutive values whatever the
    shape, but its CPU kernel (0.50) dequantizes a shape whose rows are not whole blocks (a width
    under 64, or not a multiple of it) as if each row began a block, which is wrong from the
    second block on."""
    piece = layout.unpack(storage)
    absmax = piece["absmax"]
    if layout.double:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(absmax, piece["absmax2"], piece["code2"], NESTED_BLOCK,
                                                             torch.float32) + piece["offset"]
    values = layout.shape[0] * layout.shape[1]
    rows = [values // BLOCK, BLOCK] if values % BLOCK == 0 else [values]
    return torch.ops.bitsandbytes.dequantize_4bit(piece["codes"], absmax, BLOCK, NF4, rows, dtype).view(layout.shape)


class NF4Matmul(torch.autograd.Function):
    """`F.linear(x, weight, bias)` with `weight` dequantized from its NF4 `storage`, which is all
    backward keeps of it: backward dequantizes it again for the input's gradient (the weight is
    frozen: it has none). Bit for bit what autograd gives F.linear over the dequantized weight,
    autocast included: the forward runs under the caller's autocast as F.linear would, and
    backward multiplies in the dtype the forward computed in (that of its output), then casts
    the gradient to the input's dtype, as autograd's record of autocast's cast does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, storage: torch.Tensor, layout: Layout, bias: torch.Tensor | None):
        out = F.linear(x, dequantize(storage, layout, x.dtype), bias)
        ctx.save_for_backward(storage)
        ctx.layout, ctx.x_dtype, ctx.out_dtype = layout, x.dtype, out.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (storage,) = ctx.saved_tensors
        x_grad = bias_grad = None
        if ctx.needs_input_grad[0]:
            # Dequantized in the input's dtype, then cast, as the forward's weight was.
            weight = dequantize(storage, ctx.layout, ctx.x_dtype).to(ctx.out_dtype)
            x_grad = grad.to(ctx.out_dtype).matmul(weight).to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:  # a trained bias (peft's bias="all"): the output's gradient, summed
            bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return x_grad, None, None, bias_grad


class NF4Linear(nn.Linear):
    """A frozen linear layer whose weight is NF4 (`nf4`: uint8, see Layout); its bias as it was.

    An nn.Linear to peft (which wraps it in a lora.Linear) and to every check of layer types;
    `weight` is a read-only view dequantized on request, in the dtype the layer was loaded in.
    """

    def __init__(self, storage: torch.Tensor, layout: Layout, bias: nn.Parameter | None, dtype: torch.dtype):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the dense weight this layer replaces
        self.out_features, self.in_features = layout.shape
        self.layout, self.loaded_dtype = layout, dtype
        self.nf4 = nn.Parameter(storage, requires_grad=False)
        self.register_parameter("bias", bias)

    @classmethod
    def of(cls, layer: nn.Module, double: bool, device: torch.device | None = None) -> NF4Linear:
        """`layer` (nn.Linear, or GPT-2's Conv1D, whose weight is stored transposed) quantized."""
        weight = layer.weight.detach()
        weight = weight.t() if is_conv1d(layer) else weight
        layout = Layout(tuple(weight.shape), double)
        if weight.device.type == "meta":  # a dry run: the storage's size, no values
            storage = torch.empty(layout.nbytes, dtype=torch.uint8, device="meta")
        else:
            storage = pack(weight, layout, device)
        return cls(storage, layout, layer.bias, weight.dtype)

    @classmethod
    def stored(cls, layer: nn.Module, name: str) -> NF4Linear:
        """A bitsandbytes Linear4bit of a checkpoint saved quantized, its NF4 bytes as they are."""
        state = layer.weight.quant_state
        nested = bool(state.nested)
        if state.quant_type != NF4 or state.blocksize != BLOCK or (nested and state.state2.blocksize != NESTED_BLOCK):
            raise ConfigError(f"{name} is stored as bitsandbytes {state.quant_type} in blocks of {state.blocksize}; "
                              f"relaytrain trains over nf4 in blocks of {BLOCK}: give the bf16/fp32 checkpoint "
                              f"with model.quantize=nf4")
        layout = Layout(tuple(state.shape), nested)
        return cls(packed(layer.weight.data, state, layout), layout, layer.bias, state.dtype)

    @property
    def weight(self) -> torch.Tensor:
        if self.nf4.device.type == "meta":
            return torch.empty(self.layout.shape, dtype=self.loaded_dtype, device="meta")
        return dequantize(self.nf4, self.layout, self.loaded_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NF4Matmul.apply(x, self.nf4, self.layout, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nf4{', double' if self.layout.double else ''}"


def work_device(device: torch.device | None) -> torch.device | None:
    """Where quantizing runs: on a CUDA `device` (bitsandbytes' kernels there are fast), else in place."""
    return device if device is not None and device.type == "cuda" else None


def quantize_blocks(model, double: bool, device: torch.device | None = None) -> None:
    """Every linear layer of `model`'s blocks replaced by its NF4Linear (in place: the blocks
    hold the Hugging Face layers themselves); recorded as `model.quantized`. A mixture's fused
    experts are `quantize_experts.quantize_blocks_experts`'."""
    work = work_device(device)
    names = {id(module): name for name, module in model.hf_model.named_modules()}
    for block in model.blocks:
        for parent in list(block.layer.modules()):
            for attribute, child in list(parent.named_children()):
                if stored_4bit(child):  # a checkpoint saved quantized: its bytes, not quantized again
                    setattr(parent, attribute, NF4Linear.stored(child, names[id(child)]))
                elif isinstance(child, nn.Linear) or is_conv1d(child):
                    setattr(parent, attribute, NF4Linear.of(child, double, work))
    left = [name for name, module in model.hf_model.named_modules() if stored_4bit(module)]
    if left:
        raise ConfigError(f"{left[0]} is stored in 4 bits outside the blocks; relaytrain keeps embeddings and the "
                          f"head as they are: give the bf16/fp32 checkpoint with model.quantize=nf4")
    object.__setattr__(model, "quantized", NF4 + ("-double" if double else ""))


def stored_4bit(module: nn.Module) -> bool:
    """bitsandbytes' Linear4bit, as transformers loads a checkpoint saved in 4 bits."""
    return type(module).__name__ == "Linear4bit"


MXFP4 = "mxfp4"  # GPT-OSS's experts as published: loaded dequantized (`stored_in_mxfp4`)


def _stored(hf_config) -> dict:
    """The checkpoint's `quantization_config` as a mapping (empty: stored unquantized)."""
    stored = getattr(hf_config, "quantization_config", None)
    return {} if stored is None else stored if isinstance(stored, dict) else stored.to_dict()


def stored_in_mxfp4(hf_config) -> bool:
    """Whether the checkpoint stores its experts in MXFP4 (GPT-OSS as OpenAI publishes it):
    transformers dequantizes them as it loads (`Mxfp4Config(dequantize=True)`), and the dense
    weights train, or become NF4 under adapter=qlora, as any checkpoint's."""
    return _stored(hf_config).get("quant_method") == MXFP4


def stored_quantization(hf_config) -> dict:
    """The `model.quantize` keys of a checkpoint saved quantized (a quantization_config of
    bitsandbytes 4-bit NF4: its bytes are used as stored; MXFP4 experts: none, they load
    dequantized); one line for any other quantization."""
    stored = _stored(hf_config)
    if not stored or stored.get("quant_method") == MXFP4:
        return {}
    method, kind = stored.get("quant_method", "?"), stored.get("bnb_4bit_quant_type", "fp4")
    if method == "bitsandbytes" and stored.get("load_in_4bit") and kind == NF4:
        return {"quantize": NF4, "quantize_double": bool(stored.get("bnb_4bit_use_double_quant"))}
    what = f"bitsandbytes {'4-bit ' + kind if stored.get('load_in_4bit') else '8-bit'}" if method == "bitsandbytes" else method
    raise ConfigError(f"the checkpoint is saved quantized ({what}); relaytrain trains over bitsandbytes 4-bit nf4 "
                      f"checkpoints and MXFP4 experts (dequantized as they load), or quantizes a bf16/fp32 one "
                      f"itself: give that with model.quantize=nf4")
