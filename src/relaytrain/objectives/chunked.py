"""A causal LM's head and cross-entropy over chunks of tokens: the whole sequence's logits never exist.

At 8,192 tokens a 128 k vocabulary makes 4 GiB of fp32 logits per sequence, and their softmax
and gradient as much again each: more than a 7 B model's block. So the head (the final norm,
the LM head, a family's scalars and soft-capping: whatever `head(hidden)` computes, token by
token) and the loss run over `chunk` tokens at a time (`ChunkedHeadLoss`), so one chunk's
logits, softmax and gradient are alive at a time. The sum is the whole sequence's to float noise
(the order of a sum of chunks), loss and every gradient.

The loss is the graph's last node, so its gradients can be taken in the forward, while each
chunk's logits exist anyway, and held until the backward scales them by the gradient it brings
(the loss scale, 1/items): one forward of the head per token, as the whole sequence's loss takes.
They take what the recompute would keep (the head input's gradient in place of the head's input)
plus the trained weights' gradient sum. Where a second loss's forward comes before the first one's
backward (GPipe's last stage runs every micro-batch's forward first) those sums would pile up, one
per micro-batch: while one loss's gradients wait, the next keeps only the head's input and computes
its chunks' logits again in its backward; so does a loss under torch.utils.checkpoint (a stage
recomputed in its backward), whose recompute must save what its forward saved. So the price of
chunking is at most a second weight-sized gradient while the chunks' gradients are summed. `model.loss_chunk_tokens`:
`auto` chunks where that saves memory (`Chunking.tokens`), `0` never, a number always in chunks
of that many tokens. The dry run and the planner's closed form count what the run holds.

The head is run through `functional_call` on the tensors the forward saw (the parameters and
buffers it read, saved for the backward), not on whatever the module holds when the backward
runs: L2L's relay swaps device copies into the head only while its forward runs, and FSDP
holds the gathered parameters only inside the root's forward and backward. The head must draw
nothing at random (a causal LM's head has no dropout): its recompute draws nothing again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call

from relaytrain.dryrun import meta_autocast
from relaytrain.utils.errors import ConfigError

AUTO = "auto"
LOSS_CHUNK_BYTES = 2**28  # auto: one chunk's fp32 logits take at most this (256 MiB)
LOGIT_COPIES = 3  # fp32 values a token's logits hold at the loss's peak: the logits, their softmax, the gradient
FP32 = 4


def chunk_setting(value) -> int | None:
    """`model.loss_chunk_tokens` read: None for auto, 0 for the whole sequence at once, else a
    chunk's tokens; anything else is one line."""
    text = str(value).strip().lower()
    if text == AUTO:
        return None
    if not text.isdigit():
        raise ConfigError(f"model.loss_chunk_tokens={value} must be auto, 0 (the whole sequence's logits at once) "
                          f"or a number of tokens per chunk of the LM head and its loss")
    return int(text)


def auto_chunk_tokens(vocab: int) -> int:
    """Tokens of one chunk under auto: as many as keep its fp32 logits within `LOSS_CHUNK_BYTES`."""
    return max(1, LOSS_CHUNK_BYTES // (FP32 * max(vocab, 1)))


@dataclass(frozen=True)
class Chunking:
    """How a model's causal-LM loss is cut: `model.loss_chunk_tokens` and the vocabulary."""

    setting: str | int = AUTO
    vocab: int = 0

    def tokens(self, tokens: int, trained_head_values: int) -> int:
        """Tokens per chunk for a micro-batch predicting `tokens` tokens (0: the whole at once).
        Auto chunks where the whole sequence's logits (three copies at the peak) outweigh one
        chunk's plus the second gradient of the head's `trained_head_values` weights."""
        wanted = chunk_setting(self.setting)
        if wanted is None:
            chunk = auto_chunk_tokens(self.vocab)
            whole = LOGIT_COPIES * tokens * self.vocab
            return chunk if whole > LOGIT_COPIES * chunk * self.vocab + trained_head_values else 0
        return wanted if 0 < wanted < tokens else 0


def chunked_head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                      loss_of_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The summed loss of `head` over `hidden` [tokens, width] against `labels` [tokens], `chunk`
    tokens at a time, the logits recomputed in the backward."""
    names, tensors = zip(*[*head.named_parameters(), *head.named_buffers()], strict=True)

    def run(weights, x, y):
        return loss_of_logits(functional_call(head, dict(zip(names, weights, strict=True)), (x,)), y)

    return ChunkedHeadLoss.apply(run, chunk, hidden, labels, *tensors)


def chunks_of(chunk: int, *tensors: torch.Tensor):
    """The tensors cut along their first dimension into pieces of `chunk`, piece by piece."""
    return zip(*(t.split(chunk) for t in tensors), strict=True)


class ChunkedHeadLoss(torch.autograd.Function):
    """`run(weights, x, labels)` (a chunk's summed loss) over every chunk, one chunk's logits alive
    at a time: the gradients taken in the forward where no other loss's wait for their backward,
    else each chunk's logits computed again in the backward."""

    @staticmethod
    def forward(ctx, run, chunk: int, hidden: torch.Tensor, labels: torch.Tensor, *weights: torch.Tensor):
        ctx.run, ctx.chunk = run, chunk
        wanted = _Wanted.of(ctx)
        ctx.eager = wanted.any() and not _WAITING and not _under_saved_tensor_hooks()
        if ctx.eager:
            total, ctx.gradients = _chunk_gradients(run, chunk, hidden, labels, weights, wanted, None)
            _WAITING.add(ctx)
            return total
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for x, y in chunks_of(chunk, hidden, labels):
            total += run(weights, x, y)
        ctx.autocast = _autocast_state(hidden.device)
        ctx.dry_autocast = meta_autocast.recompute_contexts()[1]  # a dry run's, which torch does not know of
        ctx.save_for_backward(hidden, labels, *weights)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        wanted = _Wanted.of(ctx)
        if ctx.eager:
            _WAITING.discard(ctx)
            grad_hidden, sums = ctx.gradients
            ctx.gradients = None  # a second backward through this graph has nothing to scale
            grad_hidden = grad_hidden.mul_(grad_total) if grad_hidden is not None else None
            sums = {i: grad.mul_(grad_total) for i, grad in sums.items()}
        else:
            hidden, labels, *weights = ctx.saved_tensors
            with ctx.dry_autocast, _autocast(ctx.autocast):
                _, (grad_hidden, sums) = _chunk_gradients(ctx.run, ctx.chunk, hidden, labels, weights, wanted,
                                                          grad_total)
        return (None, None, grad_hidden, None, *(sums.get(i) for i in range(len(wanted.weights))))


# The eager losses whose backward has not run yet (weakly: a graph dropped unused lets its loss go).
_WAITING: weakref.WeakSet = weakref.WeakSet()


def _under_saved_tensor_hooks() -> bool:
    """Whether the forward runs under saved-tensor hooks: torch.utils.checkpoint's, where a
    pipeline stage is recomputed in its backward (`strategy.recompute=stage`). Its recompute must
    save what the forward saved, and whether another loss waits may differ between the two, so
    such a loss keeps its input and recomputes its chunks in its backward, whatever waits."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is None or top_hooks(False) is not None


@dataclass(frozen=True)
class _Wanted:
    """Which gradients the caller wants: the head input's, and the indices of the trained weights."""

    hidden: bool
    weights: tuple[bool, ...]

    @classmethod
    def of(cls, ctx) -> _Wanted:
        return cls(ctx.needs_input_grad[2], tuple(ctx.needs_input_grad[4:]))

    @property
    def trained(self) -> list[int]:
        return [i for i, wanted in enumerate(self.weights) if wanted]

    def any(self) -> bool:
        return self.hidden or bool(self.trained)


def _chunk_gradients(run, chunk: int, hidden: torch.Tensor, labels: torch.Tensor, weights, wanted: _Wanted,
                     grad_total: torch.Tensor | None):
    """Chunk by chunk, the summed loss and its gradients (times `grad_total`, where given) w.r.t. the
    head's input and the trained weights: (loss, (input gradient or None, {weight index: gradient}))."""
    trained = wanted.trained
    leaves = [w.detach().requires_grad_(i in trained) for i, w in enumerate(weights)]
    grad_hidden = torch.empty_like(hidden) if wanted.hidden else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    sums: dict[int, torch.Tensor] = {}
    start = 0
    for x, y in chunks_of(chunk, hidden, labels):
        x = x.detach().requires_grad_(wanted.hidden)
        with torch.enable_grad():
            loss = run(leaves, x, y)
        grads = list(torch.autograd.grad(loss, ([x] if wanted.hidden else []) + [leaves[i] for i in trained],
                                         grad_total, allow_unused=True))
        total += loss.detach()
        if wanted.hidden:
            grad_hidden[start:start + x.shape[0]] = grads.pop(0)
        for i, grad in zip(trained, grads, strict=True):
            if grad is not None:  # the first chunk's gradient becomes the sum: no zeros made
                sums[i] = grad if i not in sums else sums[i].add_(grad)
        start += x.shape[0]
    return total, (grad_hidden, sums)


def _autocast_state(device: torch.device) -> dict | None:
    """The forward's autocast (amp_*), to recompute under in the backward, which runs without it
    (a dry run's, which torch does not know of, is `meta_autocast`'s)."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return None
    return {"device_type": kind, "dtype": torch.get_autocast_dtype(kind)}


def _autocast(state: dict | None):
    return torch.autocast(**state) if state is not None else contextlib.nullcontext()
