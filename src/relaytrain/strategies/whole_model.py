"""The whole-model strategy: every worker runs the whole model; how its weights are placed over
the workers is the one thing its presets differ in.

Its order of work is Algorithm 1 of the L2L paper: for each micro-batch, forward and backward
through the whole model; gradients accumulate over the micro-batches; one optimizer step per
minibatch. `strategy.recompute=block` checkpoints each block (its activations are recomputed in
backward), the fair in-memory comparison for L2L, which always recomputes; with
`strategy.stash=host` each block's input then waits for its recompute in host memory, as L2L's
stash can (`strategies/stash.py`).

Where the weights live is its placement, along the run's layout (`placement.layout`):
- replicate (`strategy=baseline`, baseline.py): every worker holds all of them; R replicas sum
  their gradients with torch's `DistributedDataParallel`;
- shard (`strategy=fsdp`, fsdp.py): each of R workers holds 1/R of every weight, gradient and
  optimizer state (FSDP2's `fully_shard` over the layout's shard dim);
- tensor (`strategy.tensor_parallel=T`, under either): each block's attention heads and MLP
  width split over T workers (DTensor's `parallelize_module` over the layout's tensor dim),
  applied first (`_parallelize_tensors`), the placement above then running along the other dims.

Each worker trains on its share of every micro-batch's rows (`Layout.row_share`). Every
micro-batch's loss is already divided by the item count of the *whole* minibatch, so the
workers' gradients are summed, not averaged, and the update equals the plain loop's over the
whole minibatch, clipping and the fp16 overflow check included (both see the summed gradients).
With `strategy.sequence_parallel=S` every replica's sequences are cut over S workers (the
layout's sequence dim, `strategies/sequence_parallel.py`): each runs its tokens through the whole
model, an all-to-all around attention giving it whole sequences for its share of the heads;
their loss shares are divided by the same item count, so the sum over all of them is again the
plain loop's gradient.

With `strategy.tensor_parallel=T` (not with sequence parallelism: both split the heads) the
gradients of split weights are each worker's parts (DTensors): clipping takes the norm over
every worker's parts (`tensor_parallel.clip_grad_norm_`) and the workers agree on one fp16
overflow answer, so both decide as the plain loop does. A dry run (no mesh) runs the model
unsplit and reports a tensor rank's share of the trained state (`simulated_memory`).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from relaytrain.dryrun import meta_autocast
from relaytrain.models.family import family_spec
from relaytrain.models.layered import LayeredModel, MicroBatch, eval_mode
from relaytrain.objectives.base import Divisor
from relaytrain.placement.experts import expert_parallel
from relaytrain.placement.layout import Layout
from relaytrain.placement.tensor_parallel import (
    block_plan,
    kept_fraction,
    local,
    parallelize_blocks,
    split_parameters,
    tensor_parallel,
)
from relaytrain.placement.tensor_parallel import clip_grad_norm_ as clip_split_grad_norm_
from relaytrain.schema.config import Recompute
from relaytrain.step.evaluation import EvalStats
from relaytrain.step.lowbit import check_quantized_shards, state_bits
from relaytrain.step.optim import build_optimizer, set_lr
from relaytrain.step.precision import LossScaler, Precision
from relaytrain.strategies.base import ReplicatedStrategy, StepResult, minibatch_divisor, replica_rows, scalar
from relaytrain.strategies.sequence_parallel import (
    WholeSequence,
    check_sequence_parallel,
    cut_sequences,
    sequence_parallel,
    uninstall,
)
from relaytrain.strategies.stash import HostStash, stash_on_host
from relaytrain.strategies.transfers import Transfers
from relaytrain.strategies.whole_model_cost import recomputes_blocks
from relaytrain.utils.errors import ConfigError

DATA_DIMS = ("replicate", "shard", "sequence")  # the layout's dims whose workers' gradients are summed
STATE = ("weights", "gradients", "optimizer state")  # the dry run's kinds a placement divides


def check_stash(cfg) -> None:
    """The host stash holds the inputs a block recompute starts from: without recompute there are none."""
    if stash_on_host(cfg.strategy) and not recomputes_blocks(cfg):
        raise ConfigError(f"strategy.stash=host keeps each block's input on the host until its recompute, and "
                          f"strategy.recompute={cfg.strategy.recompute} recomputes none; add strategy.recompute=block")


def host_stash_transfers(cfg, device: torch.device) -> Transfers | None:
    """The copy streams of a host stash (`strategy.stash=host`); None: the inputs stay on the device."""
    return Transfers(device) if stash_on_host(cfg.strategy) else None


def check_tensor_parallel(cfg) -> None:
    """`strategy.tensor_parallel`: at least 1; above 1, not with what splits attention another way
    or is untried with split weights. What the model itself refuses (its plan, its widths) is
    `block_plan`'s, when the worker builds it."""
    size = tensor_parallel(cfg.strategy)
    if size < 1:
        raise ConfigError(f"strategy.tensor_parallel={size} must be at least 1")
    if size == 1:
        return
    if sequence_parallel(cfg.strategy) > 1:
        raise ConfigError(f"strategy.tensor_parallel={size} with strategy.sequence_parallel="
                          f"{sequence_parallel(cfg.strategy)}: both split attention's heads over workers, and they "
                          f"do not compose yet; set one of them to 1")
    if cfg.train.compile:
        raise ConfigError("strategy.tensor_parallel with train.compile=true is not supported yet (DTensor blocks are "
                          "not compiled here); drop one")


class MicrobatchLoss(nn.Module):
    """The whole model as one module whose forward is a micro-batch's loss over the minibatch's
    items (or, `evaluate`, its evaluation sums): what `DistributedDataParallel` and FSDP wrap
    (they act on what a forward of the module uses). With `transfers`, each recomputed block's
    input waits on the host (`HostStash`). With `split` (sequence parallelism), this worker's
    tokens of each sequence (`sequence_parallel.SequenceSplit`)."""

    def __init__(self, model: LayeredModel, recompute: bool, precision: Precision, transfers: Transfers | None = None,
                 split: WholeSequence | None = None):
        super().__init__()
        self.model, self.recompute, self.precision = model, recompute, precision
        self.transfers = transfers
        self.split = split or WholeSequence()

    def forward(self, mb: MicroBatch, divisor: Divisor | None = None, evaluate: bool = False) -> torch.Tensor:
        mb = self.split.whole(mb)
        with self.precision.autocast_context(mb.input_ids.device):
            hidden, scored = self.split.scored(self.trunk(mb), mb)
            if evaluate:
                return self.model.eval_stats(hidden, scored).sums
            return self.model.head_loss(hidden, scored).over(divisor or Divisor(1))

    def trunk(self, mb: MicroBatch) -> torch.Tensor:
        """Embeddings and every block: the last block's output."""
        hidden = self.model.embed_input(self.split.input_ids(mb), mb.draw)
        ctx = self.split.context(self.model, mb, hidden)
        recompute = self.recompute and torch.is_grad_enabled()
        # A dry run's autocast (the meta device has no torch.autocast) is entered again around the
        # recompute; torch restores a real device's itself.
        context_fn = meta_autocast.recompute_contexts
        stash = HostStash(self.transfers, context_fn) if recompute and self.transfers is not None else None
        for index, block in enumerate(self.model.blocks):
            if stash is not None:
                hidden = stash.checkpoint(block, index, hidden, ctx)
            elif recompute:
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False, context_fn=context_fn)
            else:
                hidden = block(hidden, ctx)
        return hidden


def evaluate_replicated(net: MicrobatchLoss, batches: list[list[MicroBatch]], replica: int, replicas: int,
                        device: torch.device, group) -> EvalStats:
    """Forward only through `net` over this replica's rows of every evaluation batch; the sums
    over the replicas' `group` (None: one worker) on every replica."""
    stats = EvalStats.zeros(net.model.num_labels)
    with eval_mode(net), torch.no_grad():
        for minibatch in batches:
            for mb in replica_rows(minibatch, replica, replicas):
                stats += EvalStats(net(mb.to(device), evaluate=True).cpu())
    if group is not None:
        dist.all_reduce(stats.sums, group=group)
    return stats


class WholeModel(ReplicatedStrategy):
    """One worker of the whole-model strategy. A preset (baseline.py, fsdp.py) is a registered
    subclass that places the weights: `_place_weights` and the hooks under "the placement"."""

    @classmethod
    def rank_layout(cls, cfg) -> Layout:
        s = cfg.strategy  # a node without the keys (another strategy's) cuts and splits nothing
        return Layout(replicate=s.replicas, sequence=sequence_parallel(s), tensor=tensor_parallel(s),
                      experts=expert_parallel(s))

    @classmethod
    def state_layout(cls, cfg) -> dict:
        """As the strategy's, and its T where blocks are split (then a resume at another T, even
        on as many processes, is by name)."""
        layout, size = super().state_layout(cfg), tensor_parallel(cfg.strategy)
        return {**layout, "tensor_parallel": size} if size > 1 else layout

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.strategy.recompute == Recompute.stage:
            raise ConfigError(f"strategy.recompute=stage is for pipelines (strategy={cfg.strategy.name} runs the whole "
                              f"model as one stage); use strategy.recompute=block")
        check_stash(cfg)
        check_sequence_parallel(cfg.strategy, cfg.model, cfg.train.compile)
        check_tensor_parallel(cfg)

    # -- one worker -------------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        self.replica, self.num_replicas = self.layout.row_share(world.rank), self.layout.data_parallel
        self.scaler = LossScaler(self.precision.needs_loss_scaling, cfg.precision.loss_scale,
                                 cfg.precision.growth_interval)
        self.hf_names = {name: model.hf_name(p) for name, p in model.named_parameters()}  # before any placement
        split = cut_sequences(model, world, self.layout)  # its groups made by every process before the placement's
        self.net = MicrobatchLoss(model, recomputes_blocks(cfg), self.precision, host_stash_transfers(cfg, self.device),
                                  split)
        # Whether gradients are summed with other workers: not in a dry run (no process group;
        # the placements' figures hold for the real run), nor where this worker's only peers are
        # its tensor parts.
        self.synced = not world.simulated and self.layout.size // self.layout.tensor > 1
        self.gradient_group, self.stats_group = self._data_groups() if self.synced else (None, None)
        self._parallelize_tensors()
        self.loss_of: nn.Module = self.net  # what a micro-batch's loss is computed with (the placement may wrap it)
        self._place_weights()
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.net.model.named_parameters(), cfg.optim)

    def _data_groups(self) -> tuple[object, object]:
        """The groups the sums over the workers' rows run over: gradients and losses (the default
        backend) and evaluation sums (gloo: they are on the host). Every worker (the default group
        and the world's control group), but with tensor parallelism not this worker's other
        tensor parts, which hold the same sums."""
        if self.layout.tensor == 1:
            return None, self.world.control
        stats = None
        for ranks in self.layout.groups(*DATA_DIMS):  # every process makes every group, in one order
            group = dist.new_group(ranks, timeout=self.world.timeout, backend="gloo")
            stats = group if self.world.rank in ranks else stats
        return self.layout.submesh(self.device.type, *DATA_DIMS).get_group(), stats

    def _parallelize_tensors(self) -> None:
        """The tensor placement (`strategy.tensor_parallel=T`): each block's heads and MLP width
        split over the layout's tensor dim, on the device, before the weights are replicated or
        sharded along the other dims (FSDP's mesh then shares its root with the tensor mesh, as
        DTensor needs). A dry run (no mesh) checks the plan and runs the model unsplit;
        `kept` is then what each tensor rank would hold of it (`simulated_memory`). `split`:
        whether this worker's blocks are split (DTensors)."""
        self.kept = {"model": 1.0, "block": 1.0}
        self.split = self.layout.tensor > 1 and not self.world.simulated
        if self.layout.tensor == 1:
            return
        family = family_spec(self.model.family)  # to come resolved, with the run's (the constructor has no RunSpec)
        if self.world.simulated:
            split = split_parameters(self.model, block_plan(self.model, family, self.layout.tensor))
            self.kept = {"model": kept_fraction(self.model, split, self.layout.tensor),
                         "block": kept_fraction(self.model.blocks[0], split, self.layout.tensor)}
            return
        self.model.to(self.device)
        parallelize_blocks(self.model, self.layout.mesh(self.device.type)["tensor"], family)
        bits = state_bits(self.cfg.optim)
        if bits != 32:  # torchao's blocks of each part the whole tensor's (`lowbit._new_buffer`)
            check_quantized_shards(self.model.named_parameters(), bits)

    # -- one step ---------------------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        divisor = minibatch_divisor(self.model, minibatch, self.num_replicas)  # every worker's rows
        mine = replica_rows(minibatch, self.replica, self.num_replicas)
        loss_sum = torch.zeros((), device=self.device)
        with self.timer.phase("forward+backward"):
            for u, mb in enumerate(mine):
                self.progress(f"micro-batch {u + 1}/{len(mine)}")
                with self._microbatch(last=u == len(mine) - 1):
                    loss = self.loss_of(mb.to(self.device, non_blocking=True), divisor)
                    self.scaler.scale_loss(loss).backward()
                loss_sum += loss.detach()
        self.sum_over_replicas(loss_sum)  # every worker's share of the minibatch's mean loss
        with self.timer.phase("optimizer"):
            skipped = self._update(lr)
        return StepResult(loss=scalar(loss_sum), skipped=skipped)

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        if self.synced:
            dist.all_reduce(values, group=self.gradient_group)
        return values

    def _update(self, lr: float) -> bool:
        """One optimizer step over the whole model, skipped on an fp16 overflow; returns it."""
        self._sum_gradients()
        overflow = self._overflowed([p.grad for p in self.params if p.grad is not None])
        if not overflow:
            if self.cfg.optim.grad_clip > 0:
                self._clip(self.cfg.optim.grad_clip)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return overflow

    def _clip(self, max_norm: float) -> None:
        """Global-norm clipping, the norm the plain loop's: torch's, or over split weights (their
        DTensor gradients and the plain ones together) tensor_parallel.py's."""
        if self.split:
            clip_split_grad_norm_(self.params, max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)

    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats:
        """Each worker its rows (under FSDP through the root's forward, which gathers the
        embeddings and the head); the sums over the workers on every one of them."""
        return evaluate_replicated(self.net, batches, self.replica, self.num_replicas, self.device, self.stats_group)

    def simulated_memory(self, tracker) -> dict:
        """A dry run's figures: as tracked, but with tensor parallelism (the model ran unsplit)
        each tensor rank's weights, gradients and optimizer state are its share (`kept`): the
        blocks' split layers' 1/T, said so."""
        figures = tracker.figures()
        if self.layout.tensor == 1:
            return figures
        by_kind, peak = self._kept_state(figures)
        return {**figures, "peak_allocated_bytes": peak, "by_kind": by_kind, "closed_form": True,
                "note": f"simulated on the unsplit model (the meta device runs no collectives); weights, gradients "
                        f"and optimizer state as each of {self.layout.tensor} tensor ranks holds them (1/"
                        f"{self.layout.tensor} of the blocks' split layers); activations the unsplit model's, an "
                        f"upper bound (a tensor rank holds 1/{self.layout.tensor} of attention's and the MLP's inner "
                        f"ones)"}

    def _kept_state(self, figures: dict, shards: int = 1, scale: dict[str, float] | None = None) -> tuple[dict, int]:
        """The tracker's breakdown with the trained state as one worker keeps it (a tensor rank's
        `kept` share, times its kind's `scale`, then 1/`shards` of that), and the peak moved by as much."""
        by_kind = dict(figures["by_kind"])
        before = sum(by_kind[kind] for kind in STATE)
        for kind in STATE:
            by_kind[kind] = int(by_kind[kind] * self.kept["model"] * (scale or {}).get(kind, 1.0)) // shards
        return by_kind, figures["peak_allocated_bytes"] - before + sum(by_kind[kind] for kind in STATE)

    def report(self) -> dict:
        phases = dict(self.timer.totals)
        measured = max(self.timer.counts.get("optimizer", 0), 1)
        summary = {f"{name} (mean s/step)": f"{seconds / measured:.3f}" for name, seconds in phases.items()}
        if self.layout.tensor > 1:
            summary = {"tensor parallel": f"every block split over {self.layout.tensor} workers", **summary}
        return {"phase_times_s": phases, "summary": summary}

    def close(self) -> None:
        uninstall(self.model)

    # -- the placement: where the weights live ----------------------------------------------------
    @abstractmethod
    def _place_weights(self) -> None:
        """Put the model's weights where this worker keeps them (and wrap `loss_of` if need be)."""

    def _microbatch(self, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: `last` is the one whose backward sums
        the gradients over the workers."""
        return contextlib.nullcontext()

    def _sum_gradients(self) -> None:
        """Sum the gradients over the workers' rows where the placement has not already (after the
        last micro-batch's backward, before the update)."""

    def _overflowed(self, grads: list[torch.Tensor]) -> bool:
        """Unscale this worker's gradients (its parts of split ones); whether any overflowed
        anywhere: with tensor parts, or shards (`_holds_parts`), one worker's gradients are not
        another's, so they agree on one answer and every worker skips the step or none does."""
        overflow = self.scaler.unscale_and_check([local(g) for g in grads])
        if self.scaler.enabled and self._holds_parts():
            flag = torch.tensor([int(overflow)], device=self.device)
            dist.all_reduce(flag, dist.ReduceOp.MAX)
            overflow = bool(flag)
        return overflow

    def _holds_parts(self) -> bool:
        """Whether this worker's gradients are parts of the whole (tensor parts: each its own)."""
        return self.split
