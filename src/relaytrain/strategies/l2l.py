"""L2L: layer-to-layer relay execution with the eager param server (Algorithm 2 of the paper).

The host owns the model (`relaytrain.strategies.eps`); the device holds only the part executing and
the one prefetched after it. One step walks the parts in *relay order*

    embed, block 0 .. block N-1, head, block N-1 .. block 0, embed

and runs every micro-batch through a part before the next is relayed in (the loop
inversion of Algorithm 2: weights cross once per minibatch, not once per micro-batch).

- Forward: each part runs over all micro-batches without autograd; only each block's
  input is stashed (on the device, or on the host for `stash=cpu`).
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

from relaytrain import metrics
from relaytrain.checkpoint import load_model_state, model_state, unique_named_parameters
from relaytrain.config import Choice, StrategyConfig, WorkersConfig
from relaytrain.costmodel import (
    FP32,
    LOOPS_ALWAYS,
    ModelFacts,
    Shape,
    StepCost,
    allreduce_s,
    both,
    powers_of_two_dividing,
    upload_s,
)
from relaytrain.errors import ConfigError
from relaytrain.evaluation import EvalStats
from relaytrain.models.layered import Draw, LayeredModel, MicroBatch, eval_mode
from relaytrain.optim import state_words
from relaytrain.precision import LossScaler
from relaytrain.profile import Profile, Timings
from relaytrain.strategies import register
from relaytrain.strategies.base import (
    Capabilities,
    ReplicatedStrategy,
    StepResult,
    cpu_activation_bytes,
    minibatch_items,
    replica_rows,
    scalar,
)
from relaytrain.strategies.eps import EagerParamServer, Peers, Shipment
from relaytrain.strategies.relay import ActivationStash, WeightRelay
from relaytrain.strategies.transfers import Transfers

_PHASE_LABELS = {"forward": "forward", "recompute_backward": "recompute+backward",
                 "transfer_wait": "transfer wait", "optimizer_exposed": "exposed optimizer"}


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
    """The head as a part: `(hidden, labels, draw) -> summed loss` (the model's `head_loss`), or
    the evaluation sums of the micro-batch with `evaluate=True`.

    `head` is registered so a functional call swaps the head's parameters for device copies;
    `head_loss` reaches the same module object through the model.
    """

    def __init__(self, model: LayeredModel):
        super().__init__()
        self.head = model.head
        object.__setattr__(self, "_model", model)  # not a child: its parameters are not the head's

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, draw: Draw | None = None,
                evaluate: bool = False) -> torch.Tensor:
        if evaluate:
            return self._model.eval_stats(hidden, labels).sums
        return self._model.head_loss(hidden, labels, draw)


# --------------------------------------------------------------------------- the strategy


class Stash(Choice):
    device = "device"
    cpu = "cpu"


class EpsPlacement(Choice):
    replicated = "replicated"  # every replica keeps all gradients and optimizer state and steps every part
    sharded = "sharded"  # each part's gradients and optimizer state live on one owner replica (ZeRO-style)


@dataclass
class L2LConfig(WorkersConfig, StrategyConfig):
    name: str = "l2l"
    stash: Stash = Stash.device  # where each block's input waits for the backward (cpu: the preset l2l_stash_cpu)
    prefetch: bool = True  # relay the next part in while the current one computes
    max_resident_blocks: int = 2  # parts on the device at once: the executing one and the prefetched one
    eps: EpsPlacement = EpsPlacement.sharded  # with replicas: where the EPS state lives


WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each extra worker


@register("l2l")
class L2L(ReplicatedStrategy):
    """Algorithm 2 over the eager param server. The EPS's masters *are* the model's parameters,
    so the model always holds the trained weights; `step` returns only after every update has landed."""

    Config = L2LConfig
    capabilities = Capabilities(cross_precision=True)

    @classmethod
    def stash_on_host(cls, cfg) -> bool:
        """Where the block inputs wait: the one rule the run, its estimates and its cost model read."""
        return cfg.strategy.stash == Stash.cpu

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        s = cfg.strategy
        if s.max_resident_blocks < 1:
            raise ConfigError(f"strategy.max_resident_blocks={s.max_resident_blocks} must be at least 1")

    @classmethod
    def estimate_host_bytes(cls, cfg, num_params: int, device_type: str) -> int:
        s, m = cfg.strategy, cfg.model
        per_worker = cls._eps_state_bytes(cfg, num_params) + num_params * FP32  # + transit copies of what crosses
        per_worker += cpu_activation_bytes(cfg, device_type, live_blocks=1, stash_entries=m.num_layers * s.num_microbatches)
        if device_type != "cpu" and cls.stash_on_host(cfg):  # the stash waits in host memory
            per_worker += cls._host_stash_bytes(cfg, 2 if str(cfg.precision.name).startswith("cmp") else FP32)
        if s.replicas > 1:
            per_worker += WORKER_OVERHEAD_BYTES
        return int(s.replicas * per_worker)

    @classmethod
    def _eps_state_bytes(cls, cfg, num_params: int) -> float:
        """The eager param server on one worker's host: the fp32 masters, and their gradients and
        optimizer state (sharded over the replicas: on each part's owner only)."""
        s = cfg.strategy
        share = s.replicas if s.replicas > 1 and s.eps == EpsPlacement.sharded else 1
        return num_params * FP32 * (1 + (1 + state_words(cfg.optim)) / share)

    @classmethod
    def _host_stash_bytes(cls, cfg, value_bytes: int) -> int:
        """Every block's input for every micro-batch, waiting in host memory (stash on the host)."""
        s, m = cfg.strategy, cfg.model
        return m.num_layers * s.num_microbatches * s.microbatch_size * cfg.data.seq_len * m.hidden_size * value_bytes

    @classmethod
    def state_layout(cls, cfg) -> dict:
        s = cfg.strategy
        return {"replicas": s.replicas, "eps": str(s.eps) if s.replicas > 1 else "local"}

    @classmethod
    def describe_process(cls, cfg, rank: int) -> str:
        return f"rank {rank} (replica {rank} of {cfg.strategy.replicas})"

    @classmethod
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """Replica 0 where the EPS is replicated. Sharded, each replica owns other parts, and a
        part's summed gradients stay on a non-owner's device until its EPS worker drops them:
        every replica's figures are its own."""
        return rank if cfg.strategy.eps == EpsPlacement.sharded else super().dry_run_stand_in(cfg, rank)

    @classmethod
    def combine_reports(cls, cfg, reports: list[dict]) -> dict:
        summary = dict(reports[0])
        if len(reports) > 1:
            summary["per_worker"] = [r["replica"] for r in reports]
            exposed = sum(r["replica"]["reduction_exposed_s"] for r in reports) / len(reports)
            total = sum(r["replica"]["reduction_s"] for r in reports) / len(reports)
            steps = max(summary["eps"]["steps"], 1)
            summary["summary"] = {
                **summary["summary"],
                "replicas": f"{len(reports)}, EPS {cfg.strategy.eps}",
                "gradient sums s/step (exposed)": f"{total / steps:.3f} ({exposed / steps:.3f})",
            }
        return summary

    # -- what the planner asks --------------------------------------------------------------------
    @classmethod
    def shapes(cls, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Any number of replicas w that divides the batch, each micro-batch size b of a worker's
        share (the inner loop u = batch / (w b)), the stash on the device or on the host."""
        return [Shape(cls.name, b, batch // (w * b), w, 1, LOOPS_ALWAYS, cls.shape_options(stash=stash))
                for w in range(1, workers + 1) if batch % w == 0
                for b in powers_of_two_dividing(batch // w) for stash in Stash]

    @classmethod
    def recomputes(cls, cfg) -> bool:
        return True  # every block is recomputed from its stashed input in backward

    @classmethod
    def step_cost(cls, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """L2L paper §2.2.1, equations 1-6: with C the forward of one block on one micro-batch and
        X the transfer of one block, a minibatch of u micro-batches costs N (4uC + 2X): forward
        uC + X, recompute and backward 3uC + X. Here the measured forward and backward replace C
        and 2C, and with `strategy.prefetch` a transfer overlaps the compute of the part before
        it, so each part costs the larger of the two rather than their sum. The stash on the host
        adds, per block, every micro-batch's input down in forward and up in backward. The eager
        param server updates each part on the host while the parts below compute (only what
        outlasts the backward is exposed) and, with replicas, each part's gradients are summed
        over them in the background the same way."""
        s, n = cfg.strategy, facts.num_layers
        b, u, overlap = s.microbatch_size, s.num_microbatches, bool(s.prefetch)
        t = profile.for_workers(s.replicas, cfg.train.threads)
        block, embed, head = (t.part(part, b) for part in ("block", "embed", "head"))
        x_block, x_embed, x_head = (upload_s(params * facts.weight_bytes, profile)
                                    for params in (facts.block_params, facts.embed_params, facts.head_params))
        stash = u * upload_s(facts.boundary_bytes(b), profile) if cls.stash_on_host(cfg) else 0.0
        forward = (_relayed(u * embed.forward_s, x_embed, overlap)
                   + n * _relayed(u * block.forward_s, max(x_block, stash), overlap))
        turnaround = _relayed(u * both(head), x_head, overlap)
        backward = (n * _relayed(u * (block.forward_s + block.backward_s), x_block + stash, overlap)
                    + _relayed(u * both(embed), x_embed, overlap))
        compute = u * (both(embed) + embed.forward_s + n * (2 * block.forward_s + block.backward_s) + both(head))
        transfers = 2 * (n * x_block + x_embed) + x_head + 2 * n * stash
        optimizer, sums = _eps_exposed(cfg, facts, profile, t, backward)
        parts = {"compute": compute, "transfers": transfers, "optimizer (exposed)": optimizer}
        if s.replicas > 1:
            parts["gradient sums (exposed)"] = sums
        notes = [] if profile.host_to_device_bytes_per_s else ["the device is the host: nothing crosses a link"]
        return StepCost(forward + turnaround + backward + optimizer + sums, parts, notes)

    @classmethod
    def device_bytes(cls, cfg, facts: ModelFacts) -> int:
        """Two resident parts with their gradients, the stash (on the device: every block's input
        for every micro-batch; on the host: the entries in transit), the gradients travelling
        down, one block's activations and the head's."""
        b, u = cfg.strategy.microbatch_size, cfg.strategy.num_microbatches
        largest_part = max(facts.embed_params, facts.block_params, facts.head_params)
        resident = 2 * largest_part * facts.weight_bytes * 2  # two parts, weights and gradients
        entries = 2 if cls.stash_on_host(cfg) else u * facts.num_layers
        in_flight = (entries + u) * facts.boundary_bytes(b)
        return int(resident + in_flight + facts.block_activation_bytes(b) + facts.head_activation_bytes(b))

    @classmethod
    def host_state_bytes(cls, cfg, facts: ModelFacts) -> int:
        """The eager param server's state, and the stash where it waits on the host."""
        stash = cls._host_stash_bytes(cfg, facts.activation_bytes) if cls.stash_on_host(cfg) else 0
        return int(cls._eps_state_bytes(cfg, facts.params) + stash)

    # -- one worker ---------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        s = cfg.strategy
        self.replica, self.num_replicas = world.rank, s.replicas
        self.stash_host = self.stash_on_host(cfg)
        self.scaler = LossScaler(self.precision.needs_loss_scaling, cfg.precision.loss_scale,
                                 cfg.precision.growth_interval)
        peers = (Peers(world.rank, world.size, s.eps == EpsPlacement.sharded, world.timeout, dry=world.simulated)
                 if world.distributed else None)
        modules = [("embed", EmbedInput(model)), *((f"block.{i}", b) for i, b in enumerate(model.blocks)),
                   ("head", HeadLoss(model))]
        self.eps = EagerParamServer(modules, cfg.optim, self.scaler, self.precision.weight_dtype,
                                    pin=self.device.type == "cuda", peers=peers)
        self.peers = peers
        self.transfers = Transfers(self.device)
        self.relay = WeightRelay(self.eps.parts, self.transfers, self.device, s.max_resident_blocks, s.prefetch)
        self.head_index = len(self.eps.parts) - 1
        self.stash: ActivationStash | None = None
        table = model.hf_model.get_input_embeddings().weight
        # A dry run leaves it out: its host tensors are on the meta device, and it times nothing.
        self.table = table if self.eps.can_update_table_early(0, table) and not world.simulated else None

    # -- one step -----------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        _check_keyed(minibatch, self.cfg.model.dropout)
        self.eps.set_lr(lr)
        items = minibatch_items(self.model, minibatch)  # of the whole minibatch, every replica's rows
        mine = replica_rows(minibatch, self.replica, self.num_replicas)
        # The table rows this step reads: the early table update leaves them for after the backward.
        looked_up = torch.unique(torch.cat([mb.input_ids.reshape(-1) for mb in mine]).cpu()) if self.table is not None else None
        mbs = [mb.to(self.device, non_blocking=True) for mb in mine]
        self.relay.start_step()
        stash = self.stash = ActivationStash(self.transfers, self.stash_host)
        with self.timer.phase("forward"):
            hidden, ctxs = self._forward(mbs, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("recompute_backward"):
            grads, loss = self._turnaround(hidden, mbs, items, looked_up)
            self._backward(grads, mbs, ctxs, stash)
            metrics.synchronize(self.device)
        with self.timer.phase("optimizer_exposed"):
            self.progress("waiting for the EPS's last updates")
            if self.peers is not None:
                self.peers.backward_finished(time.perf_counter())
                loss = self.peers.sum_over_replicas(loss)
            skipped = self.eps.wait()
            if self.peers is not None:
                self.peers.step_finished()
        return StepResult(loss=scalar(loss), skipped=skipped)

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
                ctxs = [self.model.context(mb, h) for mb, h in zip(mbs, hidden, strict=True)]
        return hidden, ctxs

    def _turnaround(self, hidden: list[torch.Tensor | None], mbs: list[MicroBatch], items: int,
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
                loss = functional_call(module, weights, (x, mb.labels, mb.draw)) / items
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
        for index in range(self.head_index - 1, -1, -1):
            self.progress(f"backward: {self._part_name(index)}")
            if index <= 1 and self.table is not None:  # visiting block 1 may prefetch the embeddings
                self.eps.await_table_early()  # whose recompute reads the table
            weights, leaves = self.relay.next_visit()
            for u, mb in enumerate(mbs):
                x = None if index == 0 else stash.take((index, u), _next_stash_key(index, u, len(mbs)))
                if x is not None:
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
        args = (mb.input_ids, mb.draw) if index == 0 else (hidden, ctx)
        with self._autocast():
            return functional_call(self.eps.parts[index].module, weights, args)

    def _ship(self, index: int, leaves: list[torch.Tensor]) -> None:
        """Hand a part's minibatch gradients to the EPS (downloaded on the offload stream on CUDA),
        summed over the replicas first where there are several."""
        present = [i for i, t in enumerate(leaves) if t.grad is not None]
        grads = [leaves[i].grad for i in present]
        for t in leaves:
            t.grad = None
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
        with eval_mode(self.model), torch.no_grad():
            for minibatch in batches:
                mbs = [mb.to(self.device) for mb in replica_rows(minibatch, self.replica, self.num_replicas)]
                self.relay.start_step()
                hidden: list[torch.Tensor | None] = [None] * len(mbs)
                ctxs: list[dict | None] = [None] * len(mbs)
                for index in range(self.head_index):
                    weights, _ = self.relay.next_visit()
                    hidden = [self._compute(index, weights, mb, h, c) for mb, h, c in zip(mbs, hidden, ctxs, strict=True)]
                    if index == 0:
                        ctxs = [self.model.context(mb, h) for mb, h in zip(mbs, hidden, strict=True)]
                weights, _ = self.relay.next_visit()
                for mb, h in zip(mbs, hidden, strict=True):
                    with self._autocast():
                        stats += EvalStats(functional_call(head, weights, (h, mb.labels), {"evaluate": True}).cpu())
        self.relay.start_step()
        if self.peers is not None:
            dist.all_reduce(stats.sums, group=self.world.control)
        return stats

    # -- state ------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return [name for name, _ in unique_named_parameters(self.model)]

    def weights(self) -> dict[str, torch.Tensor] | None:
        if self.replica != 0:  # every replica holds the same current weights
            return None
        return {name: p.detach() for name, p in unique_named_parameters(self.model)}

    def state_dict(self) -> dict | None:
        """Replicated: replica 0 holds it all. Sharded: every replica its own parts' masters and
        optimizer state."""
        mine = [p for part in self.eps.local_parts() for p in part.owned]
        if not mine or (self.peers is not None and not self.peers.sharded and self.replica != 0):
            return None
        return model_state(self.model, mine, self._optimizers(), self.scaler)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, self._optimizers(), self.scaler, state)
        self.eps.refresh_wires()

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self.eps.parts if part.optimizer is not None]

    def memory_holders(self) -> dict[str, list]:
        resident = [t for r in self.relay.resident.values() for t in r.leaves]
        entries = self.stash.entries.values() if self.stash is not None else []
        return {"weights": resident + [b for buffers in self.relay.buffers for b in buffers.values()],
                "gradients": [t.grad for t in resident],
                "stash": [e for e in entries if isinstance(e, torch.Tensor)]}

    # -- reporting and lifetime ---------------------------------------------------------------
    def report(self) -> dict:
        phases = dict(self.timer.totals)
        eps = self.eps.stats.as_dict()
        steps = max(eps["steps"], 1)
        measured = max(self.timer.counts.get("forward", 0), 1)  # the steps after warm-up
        rate = eps["parameters_per_s"]
        summary = {
            "resident blocks (peak / bound)": f"{self.relay.peak_resident} / {self.relay.capacity}",
            "activation stash": "host" if self.stash_host else "device",
            **{f"{label} (mean s/step)": f"{phases.get(key, 0.0) / measured:.3f}"
               for key, label in _PHASE_LABELS.items() if key in phases},
            "transfer wait (mean s/step, within the phases)": f"{self.transfers.wait_s / steps:.3f}",
            "EPS optimizer": "n/a" if rate is None else f"{rate / 1e6:.1f} M params/s ({eps['host_kernel']})",
            "EPS updates": "deferred to end of backward (clipping / fp16 check)" if self.eps.defer else "eager",
        }
        report = {
            "stash": "cpu" if self.stash_host else "device",
            "max_resident_blocks": self.relay.capacity,
            "peak_resident_blocks": self.relay.peak_resident,
            "deferred_updates": self.eps.defer,
            "phase_times_s": phases,
            "transfer_wait_s": self.transfers.wait_s,
            "eps": eps,
            "loss_scale": self.scaler.scale,
            "summary": summary,
        }
        if self.peers is not None:
            owned = sum(part.num_owned for part in self.eps.local_parts())
            report["replica"] = {"rank": self.replica, "owned_parameters": owned,
                                 "reduction_s": self.peers.reduce_s, "reduction_exposed_s": self.peers.exposed_s,
                                 "eps_busy_s": eps["busy_s"]}
        return report

    def close(self) -> None:
        self.eps.close()


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


# --------------------------------------------------------------------------- the cost model's parts


def _relayed(compute_s: float, transfer_s: float, overlap: bool) -> float:
    """A part's time: its compute and its transfer overlap with prefetch, else they add up."""
    return max(compute_s, transfer_s) if overlap else compute_s + transfer_s


def _eps_exposed(cfg, facts: ModelFacts, profile: Profile, t: Timings, backward_s: float) -> tuple[float, float]:
    """The eager param server's updates and (replicas) gradient sums not hidden by the backward.

    On a GPU machine both run on the host and the links beside the device's backward of the
    parts below; what outlasts the backward (at least the embeddings' own update and sum, the
    last to start) is exposed. On a CPU they run on the cores the backward uses: all of it
    counts. A sharded EPS updates each part once, on its owner: a worker's share is 1 / w.
    """
    s = cfg.strategy
    share = 1 / s.replicas if str(s.eps) == "sharded" else 1.0
    update_embed, updates = _eps_updates_s(facts, profile, t)
    sums = allreduce_s(facts.params * facts.weight_bytes, s.replicas, profile, messages=facts.num_layers + 2)
    last_sum = allreduce_s(facts.embed_params * facts.weight_bytes, s.replicas, profile)
    if profile.device_type == "cpu":
        return updates * share, sums
    return max(update_embed * share, updates * share - backward_s), max(last_sum, sums - backward_s)


def _eps_updates_s(facts: ModelFacts, profile: Profile, t: Timings) -> tuple[float, float]:
    """Seconds of the embeddings' update, and of every part's: on a CPU the optimizer steps timed
    with the worker's threads, on a GPU machine the host's optimizer rate."""
    ends = facts.embed_params + facts.head_params
    if profile.device_type == "cpu":
        embed = t.optimizer_ends_s * facts.embed_params / max(ends, 1)
        return embed, facts.num_layers * t.optimizer_block_s + t.optimizer_ends_s
    per_param = profile.host_optimizer_s_per_param
    return facts.embed_params * per_param, facts.params * per_param


def paper_step_s(num_layers: int, u: int, c: float, x: float) -> float:
    """Equation 4 of the L2L paper: N (u C + X) forward + N (3 u C + X) recompute and backward."""
    return num_layers * (4 * u * c + 2 * x)


def paper_transfer_overhead(u: int, c: float, x: float) -> float:
    """The share of an L2L step spent on transfers, from equation 6: 2X / (4uC + 2X).

    1 when nothing computes, X / (2C + X) without inner looping (u = 1), and falling to 0 as
    u grows: the inner loop amortises each block's transfer over u micro-batches."""
    return 2 * x / (4 * u * c + 2 * x)
