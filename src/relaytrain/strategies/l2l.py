"""L2L: layer-to-layer relay execution with the eager param server (Algorithm 2 of the paper).

The host owns the model (`relaytrain.strategies.eps`); the device holds only the part executing and
the one prefetched after it. One step walks the parts in *relay order*

    embed, block 0 .. block N-1, head, block N-1 .. block 0, embed

and runs every micro-batch through a part before the next is relayed in (the loop
inversion of Algorithm 2: weights cross once per minibatch, not once per micro-batch).

- Forward: each part runs over all micro-batches without autograd; only each block's
  input is stashed (on the device, or on the host for `stash=host`).
- Turn-around: the head runs forward and backward at once per micro-batch (nothing to
  recompute), giving the gradient w.r.t. the last block's output.
- Backward: each block is recomputed per micro-batch from its stash (its dropout keyed by
  the micro-batch and the block, `MicroBatch.draw`: the masks of its first forward, and the
  baseline's), backpropagated, its gradients summed over the
  micro-batches by autograd, shipped to the EPS and freed; the EPS updates it on the host
  while the blocks below run.

The embeddings and the head are relayed like blocks rather than kept resident: the
embedding table is the largest single part (31 M parameters in BERT-Large, the size of 2.5
blocks; GPT-2's is also the LM head), so holding it through the step would cost more
device memory than the executing block itself, and it has to cross after every update
anyway. Relaying it costs one extra upload per step, prefetched during block 0's backward.

With `strategy.replicas=R` (the paper's multi-GPU runs), R workers relay the same parts over
their own rows of every minibatch; each part's gradients are summed over the workers while
the parts below compute, and the part is updated once (`eps.Peers`: the EPS state
replicated on every worker, or sharded across them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from relaytrain.models.layered import Draw, LayeredModel, MicroBatch, eval_mode
from relaytrain.objectives.base import Divisor, LossTerms
from relaytrain.records.checkpoint import (
    load_model_state,
    model_state,
    trained_named_parameters,
    unique_named_parameters,
)
from relaytrain.schema.config import SequenceParallelConfig, StrategyConfig, WorkersConfig
from relaytrain.step import metrics
from relaytrain.step.evaluation import EvalStats
from relaytrain.step.precision import LossScaler
from relaytrain.step.rounding import Bf16Masters, bf16_masters
from relaytrain.strategies import register
from relaytrain.strategies.base import (
    Capabilities,
    ReplicatedStrategy,
    StepResult,
    minibatch_divisor,
    replica_rows,
    scalar,
)
from relaytrain.strategies.eps import EagerParamServer, EpsStats, Peers, Shipment
from relaytrain.strategies.experts_by_need import check_experts_by_need
from relaytrain.strategies.l2l_cost import EpsPlacement, L2LCost, Stash, stash_on_host
from relaytrain.strategies.relay import ActivationStash, WeightRelay
from relaytrain.strategies.sequence_parallel import (
    CutSequenceCost,
    check_sequence_parallel,
    cut_sequences,
    uninstall,
)
from relaytrain.strategies.transfers import Transfers
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.units import gib


class EmbedInput(nn.Module):
    """The embeddings as a part: `(input_ids, draw) -> hidden` (the model's `embed_input`, its
    dropout keyed by the micro-batch).

    `embed` is registered so a functional call swaps its parameters for device copies;
    `embed_input` reaches the same module object through the model.
    """

    def __init__(self, model: LayeredModel):
        super().__init__()
        self.embed = model.embed
        object.__setattr__(self, "_model", model)  # not a child: its parameters are not the embeddings'

    def forward(self, input_ids: torch.Tensor, draw: Draw | None) -> torch.Tensor:
        return self._model.embed_input(input_ids, draw)


class HeadLoss(nn.Module):
    """The head as a part: `(hidden, micro-batch) -> summed loss` (the model's `head_loss`: the
    objective's, under the micro-batch's draw key), or its evaluation sums with `evaluate=True`.

    `head` is registered so a functional call swaps the head's parameters for device copies;
    `head_loss` reaches the same module object through the model.
    """

    def __init__(self, model: LayeredModel):
        super().__init__()
        self.head = model.head
        object.__setattr__(self, "_model", model)  # not a child: its parameters are not the head's

    def forward(self, hidden: torch.Tensor, mb: MicroBatch, evaluate: bool = False) -> LossTerms | torch.Tensor:
        if evaluate:
            return self._model.eval_stats(hidden, mb).sums
        return self._model.head_loss(hidden, mb)


# --------------------------------------------------------------------------- the strategy


@dataclass
class L2LConfig(SequenceParallelConfig, WorkersConfig, StrategyConfig):
    name: str = "l2l"
    stash: Stash = Stash.device  # where each block's input waits for the backward (host: the preset l2l_stash_cpu)
    prefetch: bool = True  # relay the next part in while the current one computes
    max_resident_blocks: int = 2  # parts on the device at once: the executing one and the prefetched one
    eps_state: EpsPlacement = EpsPlacement.sharded  # with replicas: where the EPS state lives
    overlap_next_step: bool = False  # a step's last updates land during the next forward, each before its part's upload
    experts_by_need: bool = False  # a mixture's frozen experts (LoRA, QLoRA) uploaded only where the router picked them


class L2LSequenceCost(CutSequenceCost, L2LCost):
    """L2LCost, on each worker's tokens where sequences are cut."""


@register("l2l")
class L2L(ReplicatedStrategy):
    """Algorithm 2 over the eager param server. The EPS's masters *are* the model's parameters,
    so the model always holds the trained weights once `drain` returns (with
    `strategy.overlap_next_step`, a step's last updates land during the next step's forward)."""

    Config = L2LConfig
    cost_model = L2LSequenceCost  # what the planner asks: l2l_cost.py's closed forms
    capabilities = Capabilities(cross_precision=True, bf16_masters=True, host_held_policy=True)
    compact_base = True  # the relay casts an adapter's half-precision base to the compute dtype on upload

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        s = cfg.strategy
        if s.max_resident_blocks < 1:
            raise ConfigError(f"strategy.max_resident_blocks={s.max_resident_blocks} must be at least 1")
        check_sequence_parallel(cfg.strategy, cfg.model, cfg.train.compile)
        check_experts_by_need(s, cfg.adapter)

    @classmethod
    def state_layout(cls, cfg) -> dict:
        layout = cls.rank_layout(cfg)
        state = {"replicas": layout.replicate, "eps_state": str(cfg.strategy.eps_state) if layout.size > 1 else "local"}
        if layout.sequence > 1:  # the EPS's peers are every worker: its shards follow their number
            state["sequence_parallel"] = layout.sequence
        return state

    @classmethod
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """Replica 0 where the EPS is replicated. Sharded, each replica owns other parts, and a
        part's summed gradients stay on a non-owner's device until its EPS worker drops them:
        every replica's figures are its own."""
        return rank if cfg.strategy.eps_state == EpsPlacement.sharded else super().dry_run_stand_in(cfg, rank)

    @classmethod
    def combine_reports(cls, cfg, reports: list[dict]) -> dict:
        """Worker 0's figures; with replicas, each worker's own and the mean gradient-sum time."""
        summary = dict(reports[0])
        if len(reports) > 1:
            summary["per_worker"] = [r["replica"] for r in reports]
            exposed = sum(r["replica"]["reduction_exposed_s"] for r in reports) / len(reports)
            total = sum(r["replica"]["reduction_s"] for r in reports) / len(reports)
            steps = max(summary["eps"]["steps"], 1)
            summary["summary"] = {
                **summary["summary"],
                "replicas": f"{len(reports)}, EPS state {cfg.strategy.eps_state}",
                "gradient sums s/step (exposed)": f"{total / steps:.3f} ({exposed / steps:.3f})",
            }
        return summary

    # -- one worker ---------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        s = cfg.strategy
        self.replica, self.num_replicas = self.layout.row_share(world.rank), self.layout.data_parallel
        # Sequence parallelism: this worker's tokens of every sequence (the groups made before the EPS's);
        # every worker is one of the EPS's peers, so each part's gradients are summed over all R x S of them.
        self.split = cut_sequences(model, world, self.layout)
        self.stash_host = stash_on_host(cfg.strategy)
        self.scaler = LossScaler(self.precision.needs_loss_scaling, cfg.precision.loss_scale,
                                 cfg.precision.growth_interval)
        peers = (Peers(world.rank, world.size, s.eps_state == EpsPlacement.sharded, world.timeout, dry=world.simulated)
                 if world.distributed else None)
        modules = [("embed", EmbedInput(model)), *((f"block.{i}", b) for i, b in enumerate(model.blocks)),
                   ("head", HeadLoss(model))]
        # An adapter's frozen base stays on the host as built (never rounded in place: it is the
        # base a merge or a resume must find again); the relay casts the copy it uploads.
        self.eps = EagerParamServer(modules, cfg.optim, self.scaler, self.precision.weight_dtype,
                                    pin=self.device.type == "cuda", peers=peers,
                                    carry=s.overlap_next_step and not world.simulated,
                                    bf16=Bf16Masters(cfg.train.seed, model.hf_name, cfg.optim.host_loops)
                                    if bf16_masters(cfg.optim) else None, device=self.device)
        self.peers = peers
        self.transfers = Transfers(self.device)
        self.relay = WeightRelay(self.eps.parts, self.transfers, self.device, s.max_resident_blocks, s.prefetch,
                                 self.precision.weight_dtype, self.eps, s.experts_by_need)
        self.head_index = len(self.eps.parts) - 1
        self.stash: ActivationStash | None = None
        table = model.hf_model.get_input_embeddings().weight
        # A dry run leaves it out: its host tensors are on the meta device, and it times nothing.
        self.table = table if self.eps.can_update_table_early(0, table) and not world.simulated else None

    # -- one step -----------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        _check_keyed(minibatch, self.cfg.model.dropout)
        self.eps.set_lr(lr)
        divisor = minibatch_divisor(self.model, minibatch, self.num_replicas)  # every replica's rows
        mine = replica_rows(minibatch, self.replica, self.num_replicas)
        # The table rows this step reads: the early table update leaves them for after the backward.
        looked_up = torch.unique(torch.cat([mb.input_ids.reshape(-1) for mb in mine]).cpu()) if self.table is not None else None
        mbs = [self.split.whole(mb.to(self.device, non_blocking=True)) for mb in mine]
        self.relay.start_step()
        stash = self.stash = ActivationStash(self.transfers, self.stash_host)
        with self.timer.phase("forward"):
            hidden, ctxs = self._forward(mbs, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("recompute_backward"):
            grads, loss = self._turnaround(hidden, mbs, divisor, looked_up)
            self._backward(grads, mbs, ctxs, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("optimizer_exposed"):
            self.progress("waiting for the EPS's last updates")
            if self.peers is not None:
                self.peers.backward_finished(time.perf_counter())
                loss = self.sum_over_replicas(loss)
            skipped = self.eps.wait()
            if self.peers is not None:
                self.peers.step_finished()
        return StepResult(loss=scalar(loss), skipped=skipped)

    def drain(self) -> None:  # the updates a step left to the next one's forward land now
        self.eps.drain()

    def reset_measurements(self) -> None:  # the EPS's times and the transfer waits too, as the phases
        super().reset_measurements()
        self.eps.stats = EpsStats(host_kernel=self.eps.stats.host_kernel)
        self.transfers.wait_s = 0.0
        self.relay.counts.clear()

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.peers is None else self.peers.sum_over_replicas(values)

    def _forward(self, mbs: list[MicroBatch], stash: ActivationStash):
        """Every micro-batch through one part before the next part (no autograd, block inputs stashed)."""
        hidden: list[torch.Tensor | None] = [None] * len(mbs)
        ctxs: list[dict | None] = [None] * len(mbs)
        for index in range(self.head_index):
            self.progress(f"forward: {self._part_name(index)}")
            weights, _ = self.relay.next_visit()
            for u, mb in enumerate(mbs):
                if index > 0:
                    stash.put((index, u), hidden[u])
                with torch.no_grad():
                    hidden[u] = self._compute(index, weights, mb, hidden[u], ctxs[u])
            if index == 0:  # the attention masks, shared by every block of a micro-batch
                ctxs = [self.split.context(self.model, mb, h) for mb, h in zip(mbs, hidden, strict=True)]
        return hidden, ctxs

    def _turnaround(self, hidden: list[torch.Tensor | None], mbs: list[MicroBatch], divisor: Divisor,
                    looked_up: torch.Tensor | None):
        """Head forward and backward per micro-batch: the loss and its gradient w.r.t. the last
        block's output. Each output is dropped as soon as its gradient exists: only the gradients
        travel on into the backward."""
        weights, leaves = self.relay.next_visit()
        module = self.eps.parts[self.head_index].module
        grads, loss_sum = [], torch.zeros((), device=self.device)
        for u, mb in enumerate(mbs):
            x, hidden[u] = hidden[u].requires_grad_(True), None
            with self._autocast():
                loss = functional_call(module, weights, self.split.scored(x, mb)).over(divisor)
            self.scaler.scale_loss(loss).backward()
            grads.append(x.grad)
            loss_sum += loss.detach()
        self._ship(self.head_index, leaves)
        if self.table is not None:  # all but the looked-up rows of the embeddings update behind the backward
            self.eps.update_table_early(0, self.table, looked_up)
        return grads, loss_sum

    def _backward(self, grads, mbs, ctxs, stash: ActivationStash) -> None:
        """Blocks in reverse, then the embeddings: recompute (the forward's masks: the draws are
        keyed by micro-batch and part), backpropagate, ship."""
        lowest = self.relay.lowest_trained  # below it nothing trains (adapters on a frozen embedding)
        for index in range(self.head_index - 1, lowest - 1, -1):
            self.progress(f"backward: {self._part_name(index)}")
            if index <= 1 and self.table is not None:  # visiting block 1 may prefetch the embeddings
                self.eps.await_table_early()  # whose recompute reads the table
            weights, leaves = self.relay.next_visit()
            for u, mb in enumerate(mbs):
                x = None if index == 0 else stash.take((index, u), _next_stash_key(index, u, len(mbs)))
                if x is not None and index > lowest:
                    x.requires_grad_(True)
                y = self._compute(index, weights, mb, x, ctxs[u])
                torch.autograd.backward(y, grads[u])
                grads[u] = None if x is None else x.grad
            self._ship(index, leaves)

    def _part_name(self, index: int) -> str:
        blocks = self.head_index - 1
        return "embeddings" if index == 0 else f"block {index}/{blocks}"

    def _compute(self, index: int, weights: dict, mb: MicroBatch, hidden: torch.Tensor | None, ctx: dict | None):
        """One part on one micro-batch: the embeddings read the input ids, a block the hidden state."""
        args = (self.split.input_ids(mb), mb.draw) if index == 0 else (hidden, ctx)
        with self._autocast():
            return functional_call(self.eps.parts[index].module, weights, args)

    def _ship(self, index: int, leaves: list[torch.Tensor]) -> None:
        """Hand a part's minibatch gradients to the EPS (downloaded on the offload stream on CUDA),
        summed over the replicas first where there are several."""
        present = [i for i, t in enumerate(leaves) if t.grad is not None]
        grads = [leaves[i].grad for i in present]
        for t in leaves:
            t.grad = None
        if not leaves:  # a part that does not train (a frozen head under adapters): nothing to ship
            return
        if self.peers is None:
            transfer = self.transfers.offload(grads)
            self.eps.submit(index, _aligned(len(leaves), present, transfer.tensors), transfer.done)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        del grads
        owner = self.eps.owners[index]
        work = self.transfers.collective(lambda: self.peers.start_reduce(flat, owner), flat)
        if not self.eps.owns(index):  # sharded: only the owner needs the sum
            self.eps.submit(index, Shipment([], reduction=work, flat=flat))
            return
        transfer = self.transfers.offload([flat])
        host = transfer.tensors[0]
        shapes = [leaves[i].shape for i in present]
        views = [v.view(shape) for v, shape in zip(host.split([s.numel() for s in shapes]), shapes, strict=True)]
        self.eps.submit(index, Shipment(_aligned(len(leaves), present, views), transfer.done, work, host))

    def _autocast(self):
        return self.precision.autocast_context(self.device)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats:
        """Forward-only relay: each part over every micro-batch of an evaluation batch, no stash,
        no gradients; the head adds up the evaluation sums."""
        stats = EvalStats.zeros(self.model.num_labels)
        head = self.eps.parts[self.head_index].module
        with eval_mode(self.model), torch.no_grad(), self.relay.uncounted():
            for minibatch in batches:
                mbs = [self.split.whole(mb.to(self.device))
                       for mb in replica_rows(minibatch, self.replica, self.num_replicas)]
                self.relay.start_step()
                hidden: list[torch.Tensor | None] = [None] * len(mbs)
                ctxs: list[dict | None] = [None] * len(mbs)
                for index in range(self.head_index):
                    weights, _ = self.relay.next_visit()
                    hidden = [self._compute(index, weights, mb, h, c) for mb, h, c in zip(mbs, hidden, ctxs, strict=True)]
                    if index == 0:
                        ctxs = [self.split.context(self.model, mb, h) for mb, h in zip(mbs, hidden, strict=True)]
                weights, _ = self.relay.next_visit()
                for mb, h in zip(mbs, hidden, strict=True):
                    with self._autocast():
                        stats += EvalStats(functional_call(head, weights, self.split.scored(h, mb),
                                                           {"evaluate": True}).cpu())
        self.relay.start_step()
        if self.peers is not None:
            dist.all_reduce(stats.sums, group=self.world.control)
        return stats

    # -- state ------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return [name for name, _ in trained_named_parameters(self.model)]

    def weights(self) -> dict[str, torch.Tensor] | None:
        if self.world.rank != 0:  # every worker holds the same current weights
            return None
        return {name: p.detach() for name, p in unique_named_parameters(self.model)}

    def state_dict(self) -> dict | None:
        """Replicated: replica 0 holds it all. Sharded: every replica its own parts' masters and
        optimizer state."""
        mine = [p for part in self.eps.local_parts() for p in part.owned]
        if not mine or (self.peers is not None and not self.peers.sharded and self.world.rank != 0):
            return None
        return model_state(self.model, mine, self._optimizers(), self.scaler, self._name_of)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, self._optimizers(), self.scaler, state, self._name_of)
        self.eps.refresh_wires()

    def _name_of(self, p: torch.Tensor) -> str:
        """The model's name of a parameter an EPS optimizer steps (a bf16 master's stand-in: its master's)."""
        return self.model.hf_name(self.eps.master(p))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self.eps.parts if part.optimizer is not None]

    def memory_holders(self) -> dict[str, list]:
        resident = [t for r in self.relay.resident.values() for t in r.leaves]
        frozen = [t for r in self.relay.resident.values() for t in r.frozen]  # an adapter's base, uploaded
        entries = self.stash.entries.values() if self.stash is not None else []
        return {"weights": resident + frozen + [b for buffers in self.relay.buffers for b in buffers.values()],
                "gradients": [t.grad for t in resident],
                "stash": [e for e in entries if isinstance(e, torch.Tensor)]}

    # -- reporting and lifetime ---------------------------------------------------------------
    def report(self) -> dict:
        """This worker's measured figures: the relay's residency, the phases per step, transfer
        waits, the server's rate and, with replicas, its gradient sums."""
        phases, eps = dict(self.timer.totals), self.eps.stats.as_dict()
        figures = {"stash": "host" if self.stash_host else "device", "max_resident_blocks": self.relay.capacity,
                   "peak_resident_blocks": self.relay.peak_resident, "deferred_updates": self.eps.defer,
                   "updates_into_next_step": self.eps.carry,
                   "phase_times_s": phases, "transfer_wait_s": self.transfers.wait_s, "eps": eps,
                   "loss_scale": self.scaler.scale, "summary": _summary(self, phases, eps), **self.relay.report()}
        if self.peers is not None:
            owned = sum(part.num_owned for part in self.eps.local_parts())
            figures["replica"] = {"rank": self.world.rank, "owned_parameters": owned,
                                  "reduction_s": self.peers.reduce_s, "reduction_exposed_s": self.peers.exposed_s,
                                  "eps_busy_s": eps["busy_s"]}
        return figures

    def close(self) -> None:
        self.eps.close()
        self.relay.close()
        uninstall(self.model)


_PHASE_LABELS = {"forward": "forward", "recompute_backward": "recompute+backward",
                 "transfer_wait": "transfer wait", "optimizer_exposed": "exposed optimizer"}


def _summary(l2l: L2L, phases: dict, eps: dict) -> dict:
    """The run summary's lines, per measured step (the figures cover the steps after warm-up)."""
    measured = max(l2l.timer.counts.get("forward", 0), 1)
    rate = eps["parameters_per_s"]
    return {
        "resident blocks (peak / bound)": f"{l2l.relay.peak_resident} / {l2l.relay.capacity}",
        "activation stash": "host" if l2l.stash_host else "device",
        **{f"{label} (mean s/step)": f"{phases.get(key, 0.0) / measured:.3f}"
           for key, label in _PHASE_LABELS.items() if key in phases},
        "transfer wait (mean s/step, within the phases)": f"{l2l.transfers.wait_s / max(eps['steps'], 1):.3f}",
        "EPS optimizer": "n/a" if rate is None else f"{rate / 1e6:.1f} M params/s ({eps['host_kernel']})",
        "EPS updates": _update_mode(l2l.eps),
        "weights uploaded (mean a step)": gib(l2l.relay.counts.total // max(eps["steps"], 1)),
        **l2l.relay.by_need_summary(),
    }


def _update_mode(eps: EagerParamServer) -> str:
    masters = "; bf16 masters, rounded stochastically" if eps.bf16 is not None else ""
    if eps.defer:
        return "deferred to end of backward (clipping / fp16 check)" + masters
    return ("eager, the last into the next step's forward" if eps.carry else "eager") + masters


def _check_keyed(minibatch: list[MicroBatch], dropout: float) -> None:
    """L2L recomputes each part outside torch's checkpoint: the masks of the recompute equal the
    forward's because both are drawn under the micro-batch's key, which the loader sets."""
    if dropout > 0 and any(mb.draw is None for mb in minibatch):
        raise ValueError("with dropout, L2L needs keyed micro-batches (MicroBatch.draw, set by MicroBatchLoader)")


def _aligned(size: int, present: list[int], tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """`tensors` at the positions `present` of a list of `size` (None where a leaf had no gradient)."""
    out: list[torch.Tensor | None] = [None] * size
    for i, t in zip(present, tensors, strict=True):
        out[i] = t
    return out


def _next_stash_key(index: int, u: int, num_microbatches: int) -> tuple[int, int] | None:
    """The stash entry the backward reads after (index, u): micro-batches in order, blocks in reverse."""
    if u + 1 < num_microbatches:
        return index, u + 1
    return (index - 1, 0) if index > 1 else None
