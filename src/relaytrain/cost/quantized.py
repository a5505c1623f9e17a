"""What a 4-bit base (`model.quantize=nf4`, adapter=qlora) weighs, for the cost models.

The blocks' linear weights and a mixture's fused experts are held as NF4 (`models.quantize`,
`models.quantize_experts`): packed 4-bit codes and their
absmax scales (or, doubly quantized, 8-bit scales and their own), about 4.5 bits a weight
(4.13 doubly). A part's parameter count in `models.part_parameters` counts that storage's bytes
(a uint8 tensor); the cost models need both what the weights are (values, for the FLOPs and
the trained share) and what they weigh (bytes, for what the host holds and the relay uploads).
Both are read off the quantized layers of a one-block model on the meta device, as built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaytrain.cost.work import one_block_on_meta
from relaytrain.models.quantize import NF4Linear
from relaytrain.models.quantize_experts import quantized_values


@dataclass(frozen=True)
class QuantizedPart:
    """The weights of one part (embeddings, a block, the head) held in 4 bits."""

    values: int = 0  # weights stored quantized, counted as dense values
    nbytes: int = 0  # the bytes that store them (codes and scales)

    def without(self, values: int) -> QuantizedPart:
        """The part less `values` of its weights (another worker's experts), their bytes in proportion."""
        return QuantizedPart(self.values - values, self.nbytes - self.nbytes * values // max(self.values, 1))

    @property
    def counted(self) -> int:
        """What `models.part_parameters` counts for them: their uint8 storage, a byte a parameter."""
        return self.nbytes


def quantized_parts(m, adapter) -> tuple[QuantizedPart, QuantizedPart, QuantizedPart] | None:
    """Each part's quantized weights under `m.quantize=nf4` (None: nothing is quantized), from a
    one-block model built on the meta device as a run builds it (the adapter injected after)."""
    if adapter is None or str(getattr(m, "quantize", "none")) == "none":
        return None
    model = one_block_on_meta(m, adapter=adapter)
    return tuple(_quantized_in(part) for part in (model.embed, model.blocks[0], model.head))


def _quantized_in(module: torch.nn.Module) -> QuantizedPart:
    """The part's linear layers and fused experts held in NF4."""
    layers = [layer for layer in module.modules() if isinstance(layer, NF4Linear)]
    experts = [quantized_values(m) for m in module.modules()]
    return QuantizedPart(sum(layer.in_features * layer.out_features for layer in layers) + sum(v for v, _ in experts),
                         sum(layer.nf4.numel() for layer in layers) + sum(b for _, b in experts))
