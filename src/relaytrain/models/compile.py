"""`train.compile=true`: the block function compiled once, one graph for every block of the model.

Regional compilation, as torch recommends for models made of repeated layers: not the whole
model (a graph of N blocks, compiled in N times one block's time, and broken wherever a
strategy moves weights, sends activations or recomputes), but the one function every strategy
calls for every block, `Block.run_layer`. Dynamo inlines the block's modules and lifts their
parameters into graph inputs, so the graph does not depend on which block (or which copy of
its weights) runs it: the blocks of the model share one compiled graph, compiled in about one
block's time; L2L's `functional_call` with the relayed weights, FSDP's unsharded parameters,
a pipeline's stage and its weight versions (deep copies) and DDP's replicas all run it, and
recompute runs it again under `torch.utils.checkpoint`. Guards add a graph only where the
computation differs: training or evaluation, gradients or not (L2L's forward), a new
micro-batch shape (then one graph with a dynamic batch), a decoder's layer type.

The keyed dropout draws stay outside the compiled region: `Block.forward` seeds torch's
generators for (micro-batch, block) and then calls the compiled function. Inside, inductor is
told to draw with eager's random ops from those generators (`fallback_random`) instead of its
own Philox stream: the dropout masks are then eager's, bit for bit (measured on the CPU; on a
GPU not yet measured), so a compiled run equals an eager one to fp32 rounding with dropout on,
whichever strategy runs it.

The device is decided once, by the caller (`compile_blocks(..., device)`): a dry run on the
meta device computes nothing and is not compiled. What this machine cannot compile is refused
before any process starts (`check`), in one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from relaytrain.models.layered import DRAW, LayeredModel
from relaytrain.utils.errors import ConfigError, first_line

# Inductor draws dropout masks with eager's ops from torch's generators: keyed draws stay exact.
OPTIONS = {"fallback_random": True}


def check(device: torch.device) -> None:
    """ConfigError, in one line, where `train.compile=true` cannot compile on the run's device."""
    if device.type == "meta":  # a dry run computes nothing: compiling is skipped (compile_blocks)
        return
    from torch._dynamo import is_dynamo_supported

    if not is_dynamo_supported():
        raise ConfigError("train.compile=true: torch.compile does not support this Python; drop train.compile")
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as err:  # inductor's own error type differs between torch releases
            raise ConfigError(f"train.compile=true needs a C++ compiler on the CPU (torch inductor: "
                              f"{first_line(err)}); install g++ or drop train.compile") from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError("train.compile=true needs triton on CUDA (torch inductor); "
                              "pip install triton or drop train.compile")


def _run_layer(block, hidden: torch.Tensor, shared: dict):
    """What is compiled: the block's layer on the micro-batch's shared inputs (no draw key)."""
    return block.run_layer(hidden, shared)


_compiled = None  # one compiled function per process: its graphs (cached on its code) serve every model


def compiled_run_layer():
    """The process's compiled `_run_layer`, made on first use (torch.compile itself is lazy)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_run_layer, options=OPTIONS)
    return _compiled


def run_compiled(block, hidden: torch.Tensor, ctx: dict):
    """`Block.forward`'s call under train.compile, inside the keyed draws: the compiled layer.
    The draw key is left out of what the compiled code sees: it changes every micro-batch and
    would otherwise be guarded on (a recompile per micro-batch); the draws are already seeded."""
    return compiled_run_layer()(block, hidden, {key: value for key, value in ctx.items() if key != DRAW})


@dataclass
class CompileStats:
    """This process's compiling: seconds spent in torch.compile (Dynamo's trace, the graphs'
    and their backward's lowering; measured between torch's compile callbacks), how many
    frames were compiled (the first and every recompile) and how many graphs they made."""

    seconds: float = 0.0
    compiles: int = 0
    first_step_s: float | None = None  # compile seconds within the first step (None until it ends)
    _graphs_before: int = 0
    _started: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import counters

        self._graphs_before = counters["stats"]["unique_graphs"]
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        self._started = time.perf_counter()
        if args.callback_trigger == CallbackTrigger.DYNAMO:  # not a lazily compiled backward
            self.compiles += 1

    def _end(self, args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    @property
    def graphs(self) -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"] - self._graphs_before

    def step_done(self) -> None:
        """The trainer finished a step: the first one's compile time is fixed then."""
        if self.first_step_s is None:
            self.first_step_s = self.seconds

    def close(self) -> None:
        """Stop counting (this process's run is over)."""
        from torch._dynamo.callback import callback_handler as handler

        for callbacks, fn in ((handler.start_callbacks, self._start), (handler.end_callbacks, self._end)):
            if fn in callbacks:
                callbacks.remove(fn)

    def report(self) -> dict:
        return {"first_step_s": self.first_step_s, "total_s": self.seconds, "compiles": self.compiles,
                "graphs": self.graphs}


def compile_blocks(model: LayeredModel, enabled: bool, device: torch.device) -> CompileStats | None:
    """Under `train.compile=true`, every block of `model` runs the one compiled block function
    (copies a strategy makes later keep it); returns what counts the compiling. None when off,
    or on the meta device (a dry run: nothing is computed, so nothing is compiled)."""
    if not enabled or device.type == "meta":
        return None
    for block in model.blocks:
        block.compiled = run_compiled
    return CompileStats()


def results_entry(reports: list[dict | None]) -> dict:
    """results.json's `compile` entry from every process's `CompileStats.report()`: the slowest
    process's seconds (each compiles its own blocks, at once), the most compiles and graphs."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    first = [r["first_step_s"] for r in reports if r["first_step_s"] is not None]
    return {"compile": {"first_step_s": max(first) if first else None,
                        "total_s": max(r["total_s"] for r in reports),
                        "compiles": max(r["compiles"] for r in reports),
                        "graphs": max(r["graphs"] for r in reports),
                        "processes": len(reports)}}
