"""Baseline: Algorithm 1 of the L2L paper, and plain data parallelism around it.

All weights on the device; for each micro-batch, forward and backward through the whole
model; gradients accumulate over the micro-batches; one optimizer step per minibatch.
`strategy.recompute=block` checkpoints each block (its activations are recomputed in
backward), the fair in-memory comparison for L2L, which always recomputes; with
`strategy.stash=host` each block's input then waits for its recompute in host memory, as L2L's
stash can (`strategies/stash.py`).

With `strategy.replicas=R`, R workers each run this on their share of every micro-batch, the
model wrapped in torch's `DistributedDataParallel`: gradients are summed over the workers in
buckets while the last micro-batch's backward runs (`no_sync` for the micro-batches before it),
so each step makes one all-reduce, overlapped with compute. Every micro-batch's loss is
already divided by the item count of the *whole* minibatch, so the workers' gradients are
summed, not averaged (`_sum_hook`), and the update equals the plain loop's over the whole
minibatch, clipping and the fp16 overflow check included (both see the summed gradients).

With `strategy.sequence_parallel=S` every replica's sequences are cut over S workers (R x S in
all, `strategies/sequence_parallel.py`): each runs its tokens through the whole model, an
all-to-all around attention giving it whole sequences for its share of the heads. Their loss
shares are divided by the same minibatch item count, so DDP's sum over all R x S workers is
again the plain loop's gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from relaytrain import meta_autocast
from relaytrain.checkpoint import (
    load_model_state,
    model_state,
    trained_named_parameters,
    unique_named_parameters,
)
from relaytrain.config import Recompute, SequenceParallelConfig, StrategyConfig, WorkersConfig
from relaytrain.errors import ConfigError
from relaytrain.evaluation import EvalStats
from relaytrain.models.layered import LayeredModel, MicroBatch, eval_mode
from relaytrain.objectives.base import Divisor
from relaytrain.optim import build_optimizer, set_lr
from relaytrain.precision import LossScaler, Precision
from relaytrain.strategies import register
from relaytrain.strategies.base import (
    ReplicatedStrategy,
    StepResult,
    minibatch_divisor,
    optimizer_tensors,
    replica_rows,
    scalar,
)
from relaytrain.strategies.sequence_parallel import (
    CutSequenceCost,
    WholeSequence,
    check_sequence_parallel,
    cut_sequences,
    describe_worker,
    sequence_parallel,
    uninstall,
)
from relaytrain.strategies.stash import HostStash, Stash, stash_on_host
from relaytrain.strategies.transfers import Transfers
from relaytrain.strategies.whole_model_cost import BUCKET_BYTES, BaselineCost, recomputes_blocks


@dataclass
class BaselineConfig(SequenceParallelConfig, WorkersConfig, StrategyConfig):
    name: str = "baseline"
    recompute: Recompute = Recompute.none  # none, or block: keep each block's input, recompute it in backward
    stash: Stash = Stash.device  # with recompute=block, where each block's input waits for its recompute: device, or host (out after its forward, back prefetched before its backward)


def check_stash(cfg) -> None:
    """The host stash holds the inputs a block recompute starts from: without recompute there are none."""
    if stash_on_host(cfg.strategy) and not recomputes_blocks(cfg):
        raise ConfigError(f"strategy.stash=host keeps each block's input on the host until its recompute, and "
                          f"strategy.recompute={cfg.strategy.recompute} recomputes none; add strategy.recompute=block")


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


def host_stash_transfers(cfg, device: torch.device) -> Transfers | None:
    """The copy streams of a host stash (`strategy.stash=host`); None: the inputs stay on the device."""
    return Transfers(device) if stash_on_host(cfg.strategy) else None


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


def _sum_hook(group, bucket):  # no annotations: DDP checks them, and these would be strings
    """All-reduce a bucket of gradients as a sum (DDP's own hook averages over the workers)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


class BaselineSequenceCost(CutSequenceCost, BaselineCost):
    """BaselineCost, on each worker's tokens where sequences are cut."""


@register("baseline")
class Baseline(ReplicatedStrategy):
    Config = BaselineConfig
    cost_model = BaselineSequenceCost  # what the planner asks: whole_model_cost.py's closed forms

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.strategy.recompute == Recompute.stage:
            raise ConfigError("strategy.recompute=stage is for pipelines (the baseline is one stage); "
                              "use strategy.recompute=block")
        check_stash(cfg)
        check_sequence_parallel(cfg.strategy, cfg.model, cfg.train.compile)

    @classmethod
    def describe_process(cls, cfg, rank: int) -> str:
        return describe_worker(rank, cfg.strategy.replicas, sequence_parallel(cfg.strategy))

    # -- one worker -------------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        model.to(self.device)
        self.optimizer = build_optimizer(model.named_parameters(), cfg.optim)
        self.scaler = LossScaler(self.precision.needs_loss_scaling, cfg.precision.loss_scale,
                                 cfg.precision.growth_interval)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replica, self.num_replicas = world.rank // sequence_parallel(cfg.strategy), cfg.strategy.replicas
        split = cut_sequences(model, world, cfg.strategy)  # its group made by every process before DDP's
        self.net = MicrobatchLoss(model, recomputes_blocks(cfg), self.precision, host_stash_transfers(cfg, self.device),
                                  split)
        # A dry run has no process group to sum over; with gradients as bucket views DDP adds no
        # device memory, so the dry run's figure holds for the real run.
        self.synced = world.distributed and not world.simulated
        self.loss_of = self.net
        if self.synced:
            # The module is on its device already and a micro-batch is moved there before the call.
            self.loss_of = DistributedDataParallel(self.net, device_ids=None, gradient_as_bucket_view=True,
                                                   bucket_cap_mb=BUCKET_BYTES / 2**20)
            self.loss_of.register_comm_hook(None, _sum_hook)

    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        divisor = minibatch_divisor(self.model, minibatch, self.num_replicas)  # every replica's rows
        mine = replica_rows(minibatch, self.replica, self.num_replicas)
        loss_sum = torch.zeros((), device=self.device)
        with self.timer.phase("forward+backward"):
            for u, mb in enumerate(mine):
                self.progress(f"micro-batch {u + 1}/{len(mine)}")
                last = u == len(mine) - 1  # the one whose backward sums the gradients over the replicas
                with self.loss_of.no_sync() if self.synced and not last else contextlib.nullcontext():
                    loss = self.loss_of(mb.to(self.device, non_blocking=True), divisor)
                    self.scaler.scale_loss(loss).backward()
                loss_sum += loss.detach()
        self.sum_over_replicas(loss_sum)  # every replica's share of the minibatch's mean loss
        with self.timer.phase("optimizer"):
            skipped = self._update(lr)
        return StepResult(loss=scalar(loss_sum), skipped=skipped)

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        if self.synced:
            dist.all_reduce(values)
        return values

    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats:
        """Each replica its rows; the sums over the replicas on every one of them."""
        return evaluate_replicated(self.net, batches, self.replica, self.num_replicas, self.device,
                                   self.world.control if self.synced else None)

    def memory_holders(self) -> dict[str, list]:
        # Every weight: an adapter's frozen base (4-bit or not) is on the device as well as what trains.
        return {"weights": list(self.net.model.parameters()), "gradients": [p.grad for p in self.params],
                "optimizer state": optimizer_tensors([self.optimizer])}

    def report(self) -> dict:
        phases = dict(self.timer.totals)
        measured = max(self.timer.counts.get("optimizer", 0), 1)
        return {"phase_times_s": phases,
                "summary": {f"{name} (mean s/step)": f"{seconds / measured:.3f}" for name, seconds in phases.items()}}

    def _update(self, lr: float) -> bool:
        """One optimizer step over the whole model, skipped on an fp16 overflow; returns it."""
        overflow = self._overflowed([p.grad for p in self.params if p.grad is not None])
        if not overflow:
            if self.cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip, foreach=True)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return overflow

    def _overflowed(self, grads: list[torch.Tensor]) -> bool:
        """Unscale this process's gradients; whether any overflowed (every replica holds them all)."""
        return self.scaler.unscale_and_check(grads)

    # -- state ----------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return [name for name, _ in trained_named_parameters(self.model)]

    def close(self) -> None:
        uninstall(self.model)

    def weights(self) -> dict[str, torch.Tensor] | None:
        if self.world.rank != 0:  # every worker holds the same weights
            return None
        return {name: p.detach() for name, p in unique_named_parameters(self.model)}

    def state_dict(self) -> dict | None:
        if self.world.rank != 0:  # and the same optimizer state
            return None
        params = [p for _, p in trained_named_parameters(self.model)]
        return model_state(self.model, params, [self.optimizer], self.scaler)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, [self.optimizer], self.scaler, state)
