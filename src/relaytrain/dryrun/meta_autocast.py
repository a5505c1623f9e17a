"""Autocast for a dry run: torch's own casting rule, applied where torch.autocast cannot go.

`torch.autocast` has no meta device (a meta tensor carries no autocast dispatch key), so a dry
run of `amp_bf16` / `amp_fp16` would compute every operator in fp32 and count fp32 activations
where a GPU keeps half ones. `autocast(dtype, rule)` applies autocast's rule itself, above
autograd (a TorchFunctionMode), so its casts are recorded by autograd exactly as autocast's are
and backward keeps what autocast's would keep (the half copy an operator was given):

- an operator on the rule's lower-precision list runs in `dtype`: its floating inputs are cast
  (an fp32 leaf that requires grad, a weight, is cast once per autocast region and the copy
  reused, as autocast caches it);
- one on the fp32 list runs in fp32 (its half inputs cast up); softmax, log_softmax, sum,
  cumsum, prod get `dtype=float32` where none is given (autocast's fp32_set_opt_dtype);
- a promote operator runs in its widest input type;
- every other operator as its inputs are, by type promotion.

The lists are torch's (`ATen/autocast_mode.h`'s AT_FORALL_* for CUDA, what a dry run stands
for; `ATen/autocast_mode.cpp`'s AutocastCPU registrations for the CPU, against which the
tests check this module with a real run), by operator name; an operator is recognised by the
name of the torch function called (`F.linear`, `Tensor.__matmul__` as matmul, `F.cross_entropy`
as cross_entropy_loss). `torch.utils.checkpoint` recomputes under the autocast state it reads
from torch, which for the meta device is none: a checkpoint whose `context_fn` is
`recompute_contexts` re-enters the region its forward ran in (without, the recompute would run
in fp32 and torch refuse its saved tensors' dtypes).
"""

from __future__ import annotations

import contextlib
import threading
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_CUDA_LOWER = {
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention", "cudnn_convolution", "cudnn_convolution_transpose",
}
_CUDA_FP32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    # cross_entropy_loss is composite on CUDA: log_softmax (fp32 output) then nll_loss (fp32)
    "cross_entropy_loss",
}
_CPU_LOWER = {
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm",
    "linear", "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
}
_CPU_FP32 = {
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile", "stft",
    "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve",
    "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss",
    "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
}
_CUDA_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                 "tensordot", "scatter_add"}
_CPU_PROMOTE = {"stack", "cat", "index_copy"}
_CUDA_FP32_DTYPE = {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                    "linalg_matrix_norm", "sum"}

RULES = {  # device type -> (lower precision, fp32, fp32 by a dtype argument, promote)
    "cuda": (_CUDA_LOWER, _CUDA_FP32, _CUDA_FP32_DTYPE, _CUDA_PROMOTE),
    "cpu": (_CPU_LOWER, _CPU_FP32, set(), _CPU_PROMOTE),
}
# The torch function's name where it is not the ATen operator's.
ALIASES = {"cross_entropy": "cross_entropy_loss", "rpow": "pow"}


def operator_name(func) -> str:
    """The ATen operator a torch function call reaches: `Tensor.__matmul__` is matmul."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return ALIASES.get(name, name)


class _Region(threading.local):
    depth = 0
    cache: dict | None = None
    rule: AutocastRule | None = None
    paused = False  # inside `paused()`: autocast off, as torch.autocast(enabled=False) turns it off


_region = _Region()


class AutocastRule(TorchFunctionMode):
    """autocast's rule for `rule`'s device type, in `dtype`, on the floating tensors of `device_type`."""

    def __init__(self, dtype: torch.dtype, rule: str, device_type: str):
        super().__init__()
        self.dtype, self.rule, self.device_type = dtype, rule, device_type
        self.lower, self.fp32, self.fp32_dtype, self.promote = RULES[rule]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _region.paused:
            return func(*args, **(kwargs or {}))
        args, kwargs = self.apply(operator_name(func), args, kwargs or {})
        return func(*args, **kwargs)

    def apply(self, name: str, args, kwargs: dict):
        """The arguments operator `name` runs with under the rule."""
        if name in self.lower:
            args, kwargs = self._cast(args, self.dtype), self._cast(kwargs, self.dtype)
        elif name in self.fp32:
            args, kwargs = self._cast(args, torch.float32), self._cast(kwargs, torch.float32)
        elif name in self.fp32_dtype and kwargs.get("dtype") is None and self._first_eligible(args):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif name in self.promote:
            widest = self._widest(args, kwargs)
            if widest is not None:
                args, kwargs = self._cast(args, widest), self._cast(kwargs, widest)
        return args, kwargs

    def _eligible(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                and t.device.type == self.device_type)

    def _first_eligible(self, args) -> bool:
        return bool(args) and self._eligible(args[0])

    def _widest(self, args, kwargs) -> torch.dtype | None:
        dtypes = {t.dtype for t in _flat((args, kwargs)) if self._eligible(t)}
        if len(dtypes) < 2:
            return None
        return torch.float32 if torch.float32 in dtypes else self.dtype

    def _cast(self, tree, dtype: torch.dtype):
        if isinstance(tree, torch.Tensor):
            return self._cast_one(tree, dtype) if self._eligible(tree) and tree.dtype != dtype else tree
        if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
            return type(tree)(self._cast(item, dtype) for item in tree)
        if isinstance(tree, dict):
            return {key: self._cast(value, dtype) for key, value in tree.items()}
        return tree

    def _cast_one(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # autocast's cache: fp32 leaves that require grad (weights) cast down once per region
        cached = (dtype == self.dtype and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                  and not t._is_view() and _region.cache is not None)
        if not cached:
            return t.to(dtype)
        key = id(t)
        if key not in _region.cache:
            _region.cache[key] = (t, t.to(dtype))  # the source kept alive: its id stays its own
        return _region.cache[key][1]


def _flat(tree, found: list | None = None) -> list:
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, list | tuple):
        for item in tree:
            _flat(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _flat(item, found)
    return found


STANDS_FOR = ["cuda"]  # whose rule a meta region follows: a dry run stands for a GPU


@contextmanager
def standing_for(device_type: str):
    """Meta regions follow `device_type`'s rule inside (the tests: the CPU's, to compare with a
    real CPU run); every thread of a dry run alike."""
    saved, STANDS_FOR[0] = STANDS_FOR[0], device_type
    try:
        yield
    finally:
        STANDS_FOR[0] = saved


@contextmanager
def autocast(dtype: torch.dtype, rule: str | None = None, device_type: str = "meta"):
    """An autocast region for `device_type`'s tensors under `rule`'s lists (what torch.autocast
    does on that device; None: the device a dry run stands for, `standing_for`). Nested regions
    are one: the weights' casts live until the outermost ends, as autocast clears its cache there."""
    rule = rule or STANDS_FOR[0]
    if _region.depth:
        _region.depth += 1
        try:
            yield
        finally:
            _region.depth -= 1
        return
    _region.depth, _region.cache, _region.rule = 1, {}, AutocastRule(dtype, rule, device_type)
    try:
        with _region.rule:
            yield
    finally:
        _region.depth, _region.cache, _region.rule = 0, None, None


@contextlib.contextmanager
def paused():
    """No casting inside, in a region or not: what `torch.autocast(device, enabled=False)` does on a
    real device (peft's fold of LoRA into a mixture's experts computes in the weight's dtype)."""
    before, _region.paused = _region.paused, True
    try:
        yield
    finally:
        _region.paused = before


def operands(name: str, *tensors):
    """`tensors` as operator `name` gets them in the region this thread is in (as they are outside
    one): for an operator called through torch.ops, which no TorchFunctionMode sees (the dry run's
    attention kernel stands for `scaled_dot_product_attention`, which autocast casts)."""
    if _region.rule is None or _region.paused:
        return tensors
    return _region.rule.apply(name, tensors, {})[0]


def recompute_contexts():
    """`context_fn` for torch.utils.checkpoint: nothing around the forward; around the recompute
    the region the forward ran in, if any (on a real device torch restores its own autocast)."""
    rule = _region.rule
    if rule is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), autocast(rule.dtype, rule.rule, rule.device_type)
