"""Tensor parallelism (`strategy.tensor_parallel=T`): every block's attention and MLP split over the
T ranks of a 1-D "tensor" `DeviceMesh`, through torch's DTensor (`parallelize_module`).

Megatron's split, from the family's plan (`Family.tp_plan`: a decoder's is transformers' own
`base_model_tp_plan` of its config class, BERT's is written out, GPT-2 has none):
- "colwise" layers (attention's q, k, v; the MLP's gate and up) keep 1/T of their output features:
  each rank holds whole heads (H/T query heads, K/T key/value heads) and 1/T of the MLP's width,
  and the attention and the activation run on them alone (the layers view their heads as -1);
- "rowwise" layers (attention's o, the MLP's down) keep the matching 1/T of their input features:
  their partial outputs are summed over the ranks (an all-reduce) into the whole output;
- the module that holds colwise layers (the attention, the MLP) takes its input as one replicated
  DTensor, so the backward sums its colwise layers' input gradients in one all-reduce: two
  all-reduces a block forward (after o and down), two backward (into attention and MLP);
- "replicated_with_grad_allreduce" norms (Qwen3's per-head q/k norms) keep their whole weight,
  and each backward's gradient of it, a sum over this rank's heads only, is summed over the ranks.

Everything else is replicated, not split: the embeddings and the head (no vocabulary split), the
blocks' layer norms, biases of rowwise layers. Every rank computes them whole from the same
inputs, so their gradients are the same on every rank without a collective.

Dropout is keyed, as everywhere (`models.layered.keyed_draws`): every rank of a tensor group runs a
micro-batch under one key (they must share its replica index), so dropout on replicated tensors
(BERT's hidden dropout, the embeddings') draws the unsplit run's mask on every rank. Attention's
dropout is over this rank's heads: its draws are made over every head, as the unsplit run makes
them, and this rank keeps its heads' slice (`_HeadShare`: T times the memory of its own share of
the mask, only while dropout is on). That is torch's dropout over the probabilities (eager
attention, sdpa's math path: the CPU's); a GPU's fused sdpa kernels draw inside the kernel, where
the masks agree with the unsplit run's only statistically.

Checkpoints are by Hugging Face name and whole (`full_state`, `full_optimizer_state`); loading
splits them again as the plan places them (`load_full_state`, `load_full_optimizer_state`), so a
run saved at any T resumes at any other. Clipping over split gradients (DTensors of this mesh, or
of FSDP's 2-D one, beside plain ones) is `clip_grad_norm_`'s: the plain loop's global norm on
every rank. A dry run, which makes no mesh, counts a rank's share instead (`split_parameters`,
`kept_fraction`).

Refused in one line: mixtures of experts (their replicas share the experts instead:
strategy.expert_parallel), adapters and quantized
layers, a family without a plan, a plan style other than the three above, and heads, key/value
heads or MLP width that T does not divide.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from relaytrain.models import dry_attention
from relaytrain.models.family import Family
from relaytrain.models.layered import LayeredModel
from relaytrain.records.checkpoint import unique_named_parameters
from relaytrain.records.optimizer_state import host_copy, load_optimizer_state
from relaytrain.step.lowbit import is_quantized, owned, placed_moment, whole_moment
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.tensors import local

COLWISE, ROWWISE, NORM = "colwise", "rowwise", "replicated_with_grad_allreduce"
SPLIT = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
KEY = "strategy.tensor_parallel"
# The attention kernels whose dropout `_HeadShare` draws as the unsplit run's, and the dry run's
# stand-in for sdpa (on the meta device: nothing drawn).
KERNELS = ("sdpa", "eager", dry_attention.NAME)
PREFIX = "relaytrain_tensor_parallel_"


def tensor_parallel(strategy) -> int:
    """T, from the `strategy` config node (1: nothing split; a strategy without the key splits nothing)."""
    return int(getattr(strategy, "tensor_parallel", 1))


# --------------------------------------------------------------------------- the plan, checked


def block_plan(model: LayeredModel, family: Family, size: int) -> dict[str, str]:
    """The family's plan for the model's blocks, checked for a split over `size` ranks: one line
    for what cannot be split exactly."""
    config = model.hf_config
    if getattr(model, "routing", None) is not None:
        raise ConfigError(f"{KEY}={size} does not split mixtures of experts yet (the baseline's replicas can share "
                          f"their experts instead: strategy.expert_parallel); set {KEY}=1")
    plan = family.tp_plan(config)
    if not plan:
        raise ConfigError(f"{KEY}={size}: model.family={family.name} ({config.model_type}) has no tensor-parallel "
                          f"plan; set {KEY}=1")
    _check_styles(config, plan, size)
    _check_widths(config, size)
    _check_attention(config, size)
    for block in model.blocks:
        for path, style in plan.items():
            _check_module(block.layer, path, style, size)
    return plan


def _check_styles(config, plan: dict[str, str], size: int) -> None:
    """A plan of the three styles split here, which splits its layers both ways."""
    odd = sorted({style for style in plan.values() if style not in (COLWISE, ROWWISE, NORM)})
    if odd:
        raise ConfigError(f"{KEY}={size}: a {config.model_type} model's tensor-parallel plan has {', '.join(odd)} "
                          f"layers, which are not split here (only {COLWISE}, {ROWWISE} and {NORM}); set {KEY}=1")
    if COLWISE not in plan.values() or ROWWISE not in plan.values():
        raise ConfigError(f"{KEY}={size}: a {config.model_type} model's tensor-parallel plan splits its layers one "
                          f"way only, not {COLWISE} then {ROWWISE}; set {KEY}=1")


def _check_widths(config, size: int) -> None:
    heads = config.num_attention_heads
    widths = {"model.num_heads": heads, "model.num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
              "model.intermediate_size": getattr(config, "intermediate_size", None)}
    for key, width in widths.items():
        if width is not None and width % size:
            raise ConfigError(f"{key}={width} must be a multiple of {KEY}={size}: each tensor rank holds an equal "
                              f"whole share of it")


def _check_module(layer: nn.Module, path: str, style: str, size: int) -> None:
    """A planned module is not wrapped by an adapter, and a split one is a plain linear layer whose
    split dimension T divides."""
    module = layer.get_submodule(path)
    if hasattr(module, "base_layer"):  # peft's wrappers (lora.Linear, ...)
        raise ConfigError(f"{KEY} does not split adapter-wrapped layers ({path}) yet; drop adapter=lora or set {KEY}=1")
    if style == NORM:
        return
    if type(module) is not nn.Linear:
        raise ConfigError(f"{KEY} splits torch.nn.Linear layers, and {path} is a {type(module).__name__} "
                          f"(model.quantize?); set {KEY}=1")
    features = module.out_features if style == COLWISE else module.in_features
    if features % size:
        raise ConfigError(f"{KEY}={size} must divide the {features} features {path} splits; set {KEY}=1")


# --------------------------------------------------------------------------- splitting the blocks


def parallelize_blocks(model: LayeredModel, mesh: DeviceMesh, family: Family) -> None:
    """Split every block of `model` over `mesh` (1-D, its T tensor ranks) by `family`'s plan (the run's
    resolved family), in place; the embeddings and the head stay whole on every rank. The parameters
    that split become DTensors (new parameter objects: an optimizer is built after this, and the
    model is on its device already, the mesh's device type), their Hugging Face names kept. Nothing
    to do for T=1."""
    size = mesh.size()
    if size == 1:
        return
    plan = block_plan(model, family, size)
    _route_attention(model, plan, HeadSplit(mesh.get_local_rank(), size))
    for block in model.blocks:
        _split_layer(block.layer, mesh, plan)
    model.rename_parameters()


def _split_layer(layer: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    parallelize_module(layer, mesh, {path: SPLIT[style]() for path, style in plan.items() if style in SPLIT})
    for holder in _holders(plan):
        layer.get_submodule(holder).register_forward_pre_hook(_ReplicatedInput(mesh), with_kwargs=True)
    for path in (path for path, style in plan.items() if style == NORM):
        layer.get_submodule(path).register_forward_pre_hook(_SummedOver(mesh))


def _holders(plan: dict[str, str]) -> list[str]:
    """The modules that hold colwise layers (the attention, the MLP), by path inside the layer."""
    return sorted({path.rpartition(".")[0] for path, style in plan.items() if style == COLWISE})


class _ReplicatedInput:
    """Forward pre-hook of a module holding colwise layers: its hidden states (first positional
    argument, else `hidden_states`) as one replicated DTensor. Its colwise layers then take that
    one tensor, and the backward sums their input gradients (partial on each rank) in one all-reduce."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def __call__(self, module, args, kwargs):
        if args and torch.is_tensor(args[0]):
            return (self._replicated(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._replicated(kwargs["hidden_states"])}

    def _replicated(self, hidden: torch.Tensor) -> DTensor:
        return hidden if isinstance(hidden, DTensor) else DTensor.from_local(hidden, self.mesh, [Replicate()],
                                                                             run_check=False)


class _SummedOver:
    """Forward pre-hook of a replicated module used on this rank's heads only (Qwen3's q/k norms):
    its parameters' gradients, each backward's before it is accumulated, summed over the tensor
    ranks. The gradient hooks are put on at forward time, so that a parameter another placement
    puts in a parameter's place (FSDP's unsharded one) is summed too."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()

    def __call__(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=False):
            if p.requires_grad and getattr(p, "summed_over", None) is not self:
                p.register_hook(self.summed)
                p.summed_over = self

    def summed(self, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total, group=self.group)
        return total


# --------------------------------------------------------------------------- attention's dropout


@dataclass(frozen=True)
class HeadSplit:
    """This rank's place among the `parts` tensor ranks, each holding 1/`parts` of the heads."""

    part: int
    parts: int


def _route_attention(model: LayeredModel, plan: dict[str, str], split: HeadSplit) -> None:
    """Where attention drops out: the model's attention through `split_attention`, which draws
    each rank's share of the unsplit run's masks. The split is kept on each attention module
    (the holders of colwise layers), which the attention function is handed."""
    config = model.hf_config
    if not _attention_drops(config):
        return
    for block in model.blocks:
        for holder in _holders(plan):
            block.layer.get_submodule(holder).tensor_split = split
    config._attn_implementation = PREFIX + config._attn_implementation  # private: save_pretrained does not write it


def _attention_drops(config) -> bool:
    p = getattr(config, "attention_dropout", None) or getattr(config, "attention_probs_dropout_prob", None)
    return float(p or 0.0) > 0.0


def _check_attention(config, size: int) -> None:
    """Attention's dropout is drawn as the unsplit run draws it by the kernels `_HeadShare` knows."""
    kernel = config._attn_implementation
    if _attention_drops(config) and kernel not in KERNELS:
        raise ConfigError(f"{KEY}={size} draws attention's dropout as the unsplit run does with sdpa or eager "
                          f"attention, not {kernel}; set model.attn_implementation=sdpa or model.dropout=0")


def split_attention(module, query, key, value, attention_mask, dropout: float = 0.0, **kwargs):
    """Hugging Face's attention-function contract on this rank's heads: the model's own kernel,
    its dropout drawn over every head and this rank's share kept."""
    inner = own_kernel(module, module.config._attn_implementation.removeprefix(PREFIX))
    if dropout == 0.0:
        return inner(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    with _HeadShare(module.tensor_split):
        return inner(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


def own_kernel(module, kernel: str):
    """The attention function `module` runs with `kernel`: its modelling file's eager one, or the registered one."""
    if kernel == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[kernel]


for _kernel in KERNELS:
    AttentionInterface.register(PREFIX + _kernel, split_attention)
    AttentionMaskInterface.register(PREFIX + _kernel, ALL_MASK_ATTENTION_FUNCTIONS[_kernel])


class _HeadShare(TorchDispatchMode):
    """Inside the attention kernel of this rank's heads (dimension 1 of its probabilities): each
    dropout draw made over every head, as the unsplit run makes it, and this rank's heads kept.
    torch's dropout fills a tensor of the probabilities' shape with Bernoulli draws in memory order
    (`bernoulli_`, the CPU's; `native_dropout`, a GPU's), so the slice of the whole draw is the
    unsplit run's mask of these heads, and the generator moves on as it does there."""

    def __init__(self, split: HeadSplit):
        super().__init__()
        self.split = split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bernoulli_.float:
            whole = func(self._whole(args[0]), *args[1:], **kwargs)
            return args[0].copy_(self._mine(whole))
        if func is torch.ops.aten.native_dropout.default:
            x, p = args[0], args[1]
            _, whole_mask = func(self._whole(x).fill_(1), *args[1:], **kwargs)
            mask = self._mine(whole_mask)
            return x * mask * (1.0 / (1.0 - p)), mask
        return func(*args, **kwargs)

    def _whole(self, mine: torch.Tensor) -> torch.Tensor:
        shape = (mine.shape[0], mine.shape[1] * self.split.parts, *mine.shape[2:])
        return torch.empty(shape, dtype=mine.dtype, device=mine.device)

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        heads = whole.shape[1] // self.split.parts
        return whole[:, self.split.part * heads:(self.split.part + 1) * heads]


# --------------------------------------------------------------------------- gradients and memory of split weights


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` (the 2-norm of every gradient together) where the gradients mix
    DTensors of several meshes (split blocks, FSDP's shards over another dim) with plain ones, which
    torch's cannot stack. Each rank sums the squares of its own parts, a sum over every mesh dim
    they are split along (plain and replicated parts are whole on every rank: counted once), so
    every rank finds the plain loop's norm and scales its parts alike. Returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    by_split: dict[tuple, tuple[list, list]] = {}
    for g in grads:
        groups = _split_along(g)
        by_split.setdefault(tuple(map(id, groups)), (groups, []))[1].append(local(g))
    total = torch.zeros((), device=grads[0].device) if grads else torch.zeros(())
    for groups, parts in by_split.values():
        squares = torch.stack([n.float() for n in torch._foreach_norm(parts)]).square().sum()
        for group in groups:  # summed along one dim, then the next: over the whole split
            dist.all_reduce(squares, group=group)
        total += squares
    norm = total.sqrt()
    torch._foreach_mul_([local(g) for g in grads], (max_norm / (norm + 1e-6)).clamp(max=1.0))  # torch's epsilon
    return norm


def _split_along(t: torch.Tensor) -> list:
    """The process groups of the mesh dims a DTensor is split along (none for a plain tensor)."""
    if not isinstance(t, DTensor):
        return []
    if any(placement.is_partial() for placement in t.placements):  # a sum not yet made: no norm of its parts
        raise ValueError(f"a gradient placed {t.placements} is partial: its norm needs the sum first")
    # Not replicated: split, as `Shard` or as FSDP's `_StridedShard` over a dim tensor parallelism split first.
    return [t.device_mesh.get_group(dim) for dim, placement in enumerate(t.placements) if not placement.is_replicate()]


def split_parameters(model: LayeredModel, plan: dict[str, str]) -> set[int]:
    """The ids of the parameters `plan` (`block_plan`'s) splits over the tensor ranks: colwise
    layers' weights and biases, rowwise layers' weights (their biases stay whole)."""
    split = set()
    for block in model.blocks:
        for path, style in plan.items():
            if style in SPLIT:
                module = block.layer.get_submodule(path)
                kept = [module.weight] + ([module.bias] if style == COLWISE and module.bias is not None else [])
                split.update(id(p) for p in kept)
    return split


def kept_fraction(module: nn.Module, split: set[int], size: int) -> float:
    """Of `module`'s parameters, by count (each tied one once), the fraction each of `size` tensor
    ranks holds when those in `split` (`split_parameters`) are cut in `size` equal parts."""
    counts = [(p.numel(), id(p) in split) for p in module.parameters()]
    total = sum(n for n, _ in counts)
    return sum(n / size if cut else n for n, cut in counts) / total if total else 1.0


# --------------------------------------------------------------------------- checkpoints: whole tensors by name


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor gathered from its ranks (a collective every rank of its mesh makes)."""
    if not isinstance(t, DTensor):
        return t
    if is_quantized(t):  # torchao's 8- or 4-bit moment: codes and scales joined run by run
        return whole_moment(t)
    # FSDP's shards of a split weight gather in two steps, one per mesh dim, and DTensor warns of it
    # on every rank: expected for a checkpoint, off the training step, so not shown to the user.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return t.full_tensor()
    finally:
        log.setLevel(level)


def placed_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`full` as `p` holds it: this rank's share where `p` is split (cut locally, every rank holding
    `full`: no collective), else `full` itself."""
    if not isinstance(p, DTensor):
        return full
    return distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def full_state(model: LayeredModel) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, by Hugging Face name (each tied one once): what a run at
    T=1 holds, whatever T this one runs at. Every tensor rank calls it (the split ones are gathered)."""
    return {name: whole(p.detach()).cpu().clone() for name, p in unique_named_parameters(model)}


@torch.no_grad()
def load_full_state(model: LayeredModel, state: dict[str, torch.Tensor]) -> None:
    """The parameters `state` names (whole tensors by Hugging Face name, as `full_state` gives them),
    each split as the plan placed it."""
    for name, p in unique_named_parameters(model):
        if name in state:
            p.copy_(placed_like(state[name].to(p.device), p))


def full_optimizer_state(model: LayeredModel, optimizers) -> dict[str, dict]:
    """The optimizers' per-parameter state whole, by parameter name (records.checkpoint's layout):
    Adam's moments of a split parameter gathered; its step count as it is."""
    by_name = {}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            by_name[model.hf_name(p)] = {key: host_copy(whole(v)) if torch.is_tensor(v) else v
                                         for key, v in state.items()}
    return by_name


def load_full_optimizer_state(model: LayeredModel, optimizers, by_name: dict[str, dict]) -> None:
    """The inverse of `full_optimizer_state`: each state tensor shaped like its parameter split as
    the parameter is; the rest (step counts) as saved. The optimizers own copies: torch's load
    would keep a tensor given it, and a step would then write into the caller's."""
    placed = {}
    for optimizer in optimizers:
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            name = model.hf_name(p)
            if name in by_name:
                placed[name] = {key: _state_like(v, p) for key, v in by_name[name].items()}
    load_optimizer_state(optimizers, model.hf_name, placed)


def _state_like(value, p: torch.Tensor):
    if not torch.is_tensor(value):
        return value
    split = isinstance(p, DTensor) and value.shape == p.shape
    if is_quantized(value):  # torchao's 8- or 4-bit moment: its codes and scales of this rank's part, or a copy
        return placed_moment(value, p) if split else owned(value)
    if split:
        return placed_like(value.to(p.device_mesh.device_type), p)  # a share is cut as a copy
    return value.clone()
