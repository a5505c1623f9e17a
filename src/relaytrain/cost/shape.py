"""A candidate the planner may try (`Shape`): a strategy, its micro-batches, replicas and stages,
the strategy keys it varies, and the degrees of each placement that puts one replica on several
workers.

Those placements are one kind of thing to the planner: each is a strategy key whose value T
makes every replica span T workers (`DEGREES`: sequence parallelism cuts every sequence,
tensor parallelism splits every block), a field of `Shape` of that key's name, a few letters
in its description. A strategy's cost model says which of them it takes and at which sizes
(`CostModel.degrees`); the planner combines them with replicas (`CostModel.placed_shapes`).
The next one (experts) is one more entry here and one more field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOOPS_ALWAYS = "always"  # a shape's `recompute` when the strategy always recomputes (the L2L relay)

# The placements of one replica over several workers: the strategy key (a `Shape` field of the
# same name) and how a shape's description abbreviates it.
DEGREES = {"sequence_parallel": "sp", "tensor_parallel": "tp"}


@dataclass(frozen=True)
class Shape:
    """How a candidate runs: its strategy, the micro-batch size b and count m per worker, and
    the strategy keys the planner varies (`options`, e.g. l2l's stash). Replicas w, stages d and
    each placement's degree (`DEGREES`) make w x d x S x T workers."""

    strategy: str
    microbatch_size: int  # per worker (strategy.microbatch_size)
    num_microbatches: int  # m, or the L2L relay's inner loop u
    replicas: int = 1  # w: data-parallel width
    stages: int = 1  # d: pipeline depth
    recompute: str = "none"  # none/block (baseline), none/block/stage (pipelines), always (L2L)
    options: tuple[tuple[str, str], ...] = ()  # further strategy.* keys this shape sets
    sequence_parallel: int = 1  # S: workers sharing every sequence of a replica (strategy.sequence_parallel)
    tensor_parallel: int = 1  # T: workers sharing every block of a replica (strategy.tensor_parallel)

    @property
    def placement(self) -> dict[str, int]:
        """The degrees above 1 of the placements that spread a replica (`DEGREES`), by strategy key."""
        return {key: getattr(self, key) for key in DEGREES if getattr(self, key) > 1}

    @property
    def workers(self) -> int:
        return self.replicas * self.stages * math.prod(self.placement.values())

    @property
    def batch(self) -> int:
        """Samples per step (the global minibatch)."""
        return self.microbatch_size * self.num_microbatches * self.replicas

    def overrides(self) -> list[str]:
        """The `relaytrain train` overrides that run this shape: a pipeline's every key, otherwise
        the keys that differ from one worker without recompute (the replicas always where a
        placement spreads them: FSDP's default is 2)."""
        pipeline = self.stages > 1
        out = [f"strategy={self.strategy}", f"strategy.microbatch_size={self.microbatch_size}",
               f"strategy.num_microbatches={self.num_microbatches}"]
        if pipeline:
            out.append(f"strategy.stages={self.stages}")
        if pipeline or self.replicas > 1 or self.placement:
            out.append(f"strategy.replicas={self.replicas}")
        if pipeline or self.recompute not in ("none", LOOPS_ALWAYS):
            out.append(f"strategy.recompute={self.recompute}")
        out += [f"strategy.{key}={degree}" for key, degree in self.placement.items()]
        return out + [f"strategy.{key}={value}" for key, value in self.options]

    def describe(self) -> str:
        """Short: w=2 d=4 b=8 m=16 rc=none (sp=2: each sequence cut over 2 workers; tp=4: each
        block split over 4). A relay (it always recomputes) loops u micro-batches per part."""
        pipeline = self.stages > 1
        width = f"w={self.replicas} " if self.replicas > 1 or pipeline else ""
        width += "".join(f"{DEGREES[key]}={degree} " for key, degree in self.placement.items())
        depth = f"d={self.stages} " if pipeline else ""
        relay = self.recompute == LOOPS_ALWAYS
        redo = "" if relay else f" rc={self.recompute}"
        extra = "".join(f" {key}={value}" for key, value in self.options)
        return f"{width}{depth}b={self.microbatch_size} {'u' if relay else 'm'}={self.num_microbatches}{redo}{extra}"


def powers_of_two_dividing(n: int) -> list[int]:
    """Micro-batch sizes the planner tries for n samples a worker: 1, 2, 4 ... while they divide n."""
    sizes, b = [], 1
    while b <= n and n % b == 0:
        sizes.append(b)
        b *= 2
    return sizes
