"""The closed-form cost of L2L (`strategies/l2l.py`): the paper's step model, §2.2.1, with the
measured part times, the relay's prefetch, the stash's place and the eager param server.

L2L's class names `L2LCost` as its cost model: the relay and the server run in l2l.py and eps/
(which also report what a run measured), what they are predicted to cost is here, beside
`paper_step_s` and `paper_transfer_overhead`, the paper's own equations that the planner's
tests hold the model to. Every figure is a prediction; the shared formulas are
`relaytrain.cost.formulas`'s.
"""

from __future__ import annotations

import torch

from relaytrain.cost.formulas import (
    FP32,
    LOOPS_ALWAYS,
    ModelFacts,
    Shape,
    StepCost,
    both,
    cpu_activation_bytes,
    microbatch_rows,
    optimizer_s,
    powers_of_two_dividing,
    worker_tokens,
)
from relaytrain.cost.links import allreduce_s, upload_s
from relaytrain.cost.model import CostModel
from relaytrain.cost.profile import Profile, Timings
from relaytrain.models import what_trains
from relaytrain.schema.config import Choice
from relaytrain.step.optim import state_words
from relaytrain.step.precision import Precision
from relaytrain.step.rounding import bf16_masters
from relaytrain.strategies.stash import Stash, stash_on_host  # noqa: F401 - the stash's one rule, l2l.py's too
from relaytrain.strategies.whole_model_cost import WORKER_OVERHEAD_BYTES


class EpsPlacement(Choice):
    """Where the eager param server's state lives with replicas (`strategy.eps_state`)."""

    replicated = "replicated"  # every replica keeps all gradients and optimizer state and steps every part
    sharded = "sharded"  # each part's gradients and optimizer state live on one owner replica (ZeRO-style)


class L2LCost(CostModel):
    """L2L's answers (`strategies/l2l.py`): the relay's step, its two resident parts and stash,
    and the eager param server's host state."""

    def recomputes(self, cfg) -> bool:
        return True  # every block is recomputed from its stashed input in backward

    def shapes(self, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Any number of replicas w that divides the batch, each micro-batch size b of a worker's
        share (the inner loop u = batch / (w b)), the stash on the device or on the host."""
        return [Shape(self.strategy.name, b, batch // (w * b), w, 1, LOOPS_ALWAYS, self.shape_options(stash=stash))
                for w in range(1, workers + 1) if batch % w == 0
                for b in powers_of_two_dividing(batch // w) for stash in Stash]

    def step_cost(self, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """L2L paper §2.2.1, equations 1-6: with C the forward of one block on one micro-batch and
        X the transfer of one block, a minibatch of u micro-batches costs N (4uC + 2X): forward
        uC + X, recompute and backward 3uC + X. Here the measured forward and backward replace C
        and 2C, and with `strategy.prefetch` a transfer overlaps the compute of the part before
        it, so each part costs the larger of the two rather than their sum. The stash on the host
        adds, per block, every micro-batch's input down in forward and up in backward. The eager
        param server updates each part on the host while the parts below compute (only what
        outlasts the backward is exposed) and, with replicas, each part's gradients are summed
        over them in the background the same way."""
        s, n, workers = cfg.strategy, facts.num_layers, self.strategy.processes(cfg)  # R, or R x S cutting sequences
        b, u, overlap = s.microbatch_size, s.num_microbatches, bool(s.prefetch)
        t = profile.for_workers(workers, cfg.train.threads)
        block, embed, head = (facts.part_times(t, part, b) for part in ("block", "embed", "head"))
        x_embed, x_block, x_head = (upload_s(facts.upload_bytes(part), profile) for part in range(3))
        stash = u * upload_s(facts.boundary_bytes(b), profile) if stash_on_host(cfg.strategy) else 0.0
        forward = (_relayed(u * embed.forward_s, x_embed, overlap)
                   + n * _relayed(u * block.forward_s, max(x_block, stash), overlap))
        turnaround = _relayed(u * both(head), x_head, overlap)
        backward = (n * _relayed(u * (block.forward_s + block.backward_s), x_block + stash, overlap)
                    + _relayed(u * both(embed), x_embed, overlap))
        compute = u * (both(embed) + embed.forward_s + n * (2 * block.forward_s + block.backward_s) + both(head))
        transfers = 2 * (n * x_block + x_embed) + x_head + 2 * n * stash
        optimizer, sums = _eps_exposed(cfg, facts, profile, t, backward, workers)
        parts = {"compute": compute, "transfers": transfers, "optimizer (exposed)": optimizer}
        if workers > 1:
            parts["gradient sums (exposed)"] = sums
        notes = [] if profile.host_to_device_bytes_per_s else ["the device is the host: nothing crosses a link"]
        return StepCost(forward + turnaround + backward + optimizer + sums, parts, notes)

    def device_bytes(self, cfg, facts: ModelFacts) -> int:
        """Two resident parts, the gradients of the one computing (the prefetched one has none yet;
        under adapters only the trained share), the stash (on the device: every block's input for
        every micro-batch; on the host: the entries in transit), the gradients travelling down, and
        the activations of the part computing: a block's, or at the turn-around the head's (never
        both at once)."""
        b, u = cfg.strategy.microbatch_size, cfg.strategy.num_microbatches
        resident = max(2 * facts.device_part_bytes(part) + facts.trained_part_bytes(part) for part in range(3))
        entries = 2 if stash_on_host(cfg.strategy) else u * facts.num_layers
        in_flight = (entries + u) * facts.boundary_bytes(b)
        return int(resident + in_flight + max(facts.block_activation_bytes(b), facts.head_activation_bytes(b)))

    def host_state_bytes(self, cfg, facts: ModelFacts) -> int:
        """The eager param server's state, the copies of its masters that travel where the device
        computes in another dtype (`eps.parts._wire`), and the stash where it waits on the host."""
        s = cfg.strategy
        stash = facts.num_layers * s.num_microbatches * facts.boundary_bytes(s.microbatch_size) if stash_on_host(s) else 0
        trained = eps_state_bytes(cfg, facts.trained_params, facts.trained_params, workers=self.strategy.processes(cfg))
        return int(trained + wire_bytes(cfg, facts.trained_params) + facts.frozen_host_bytes + stash)

    def estimate_host_bytes(self, cfg, num_params: int, device_type: str) -> int:
        """Host memory of the whole run, an estimate: on each replica the eager param server's
        state and the copies that travel (`host_state_bytes`' terms), one block's activations
        and every stashed input (on the host with `stash=host`), and the interpreter of each worker
        apart from the first."""
        s, m, workers = cfg.strategy, cfg.model, self.strategy.processes(cfg)  # R x S where sequences are cut
        trains = what_trains(cfg.model, cfg.adapter)  # under adapters; the frozen base counted at fp32 (errs high)
        trained = num_params if trains is None else trains.parameters
        per_worker = eps_state_bytes(cfg, num_params, trained, workers=workers) + wire_bytes(cfg, trained)
        per_worker += cpu_activation_bytes(cfg, device_type, live_blocks=1, stash_entries=m.num_layers * s.num_microbatches)
        if device_type != "cpu" and stash_on_host(cfg.strategy):  # the stash waits in host memory
            per_worker += host_stash_bytes(cfg, 2 if Precision.from_name(str(cfg.precision.name)).cross else FP32)
        if workers > 1:
            per_worker += WORKER_OVERHEAD_BYTES
        return int(workers * per_worker)


def wire_bytes(cfg, trained: int) -> int:
    """The EPS's copies of its masters in the dtype they compute in on the device, where that is
    not the masters' own (fp32 masters under a cross mixed precision: 2 bytes a value; bf16
    masters computing in bf16 travel themselves)."""
    dtype = Precision.from_name(str(cfg.precision.name)).weight_dtype
    return 0 if dtype == master_dtype(cfg.optim) else trained * dtype.itemsize


def master_dtype(o) -> torch.dtype:
    """The eager param server's masters: fp32, or bf16 (`optim.master_dtype`)."""
    return torch.bfloat16 if bf16_masters(o) else torch.float32


def eps_state_bytes(cfg, num_params: int, trained: int | None = None, frozen_bytes: int = FP32, *,
                    workers: int) -> float:
    """The eager param server on one worker's host: the masters (fp32, or bf16), and their fp32
    gradients and optimizer state (sharded over its peers, the run's `workers`: R, or R x S
    cutting sequences; on each part's owner only). Under adapters only the `trained` parameters
    have those; the frozen base is kept once, `frozen_bytes` a value."""
    s = cfg.strategy
    share = workers if workers > 1 and s.eps_state == EpsPlacement.sharded else 1
    trained = num_params if trained is None else trained
    return (num_params - trained) * frozen_bytes + trained * (master_dtype(cfg.optim).itemsize
                                                              + FP32 * (1 + state_words(cfg.optim)) / share)


def host_stash_bytes(cfg, value_bytes: int) -> int:
    """Every block's input for every micro-batch (of a worker's tokens), waiting in host memory
    (stash on the host)."""
    s, m = cfg.strategy, cfg.model
    tokens = worker_tokens(cfg.data.seq_len, s)
    return m.num_layers * s.num_microbatches * microbatch_rows(cfg) * tokens * m.hidden_size * value_bytes


# --------------------------------------------------------------------------- the step model's parts


def _relayed(compute_s: float, transfer_s: float, overlap: bool) -> float:
    """A part's time: its compute and its transfer overlap with prefetch, else they add up."""
    return max(compute_s, transfer_s) if overlap else compute_s + transfer_s


def _eps_exposed(cfg, facts: ModelFacts, profile: Profile, t: Timings, backward_s: float,
                 workers: int) -> tuple[float, float]:
    """The eager param server's updates and (replicas) gradient sums not hidden by the backward.

    On a GPU machine both run on the host and the links beside the device's backward of the
    parts below; what outlasts the backward (at least the embeddings' own update and sum, the
    last to start) is exposed. On a CPU they run on the cores the backward uses: all of it
    counts. A sharded EPS updates each part once, on its owner: a worker's share is 1 / w, of the
    `workers` (R, or R x S cutting sequences: all are the EPS's peers).
    """
    s = cfg.strategy
    share = 1 / workers if s.eps_state == EpsPlacement.sharded else 1.0
    update_embed, updates = _eps_updates_s(facts, profile, t)
    sums = allreduce_s(facts.params * facts.weight_bytes, workers, profile, messages=facts.num_layers + 2)
    last_sum = allreduce_s(facts.embed_params * facts.weight_bytes, workers, profile)
    if profile.device_type == "cpu":
        return updates * share, sums
    return max(update_embed * share, updates * share - backward_s), max(last_sum, sums - backward_s)


def _eps_updates_s(facts: ModelFacts, profile: Profile, t: Timings) -> tuple[float, float]:
    """Seconds of the embeddings' update, and of every part's: on a CPU the optimizer steps timed
    with the worker's threads, on a GPU machine the host's optimizer rate."""
    ends = facts.embed_params + facts.head_params
    if profile.device_type == "cpu":
        embed = t.optimizer_ends_s * facts.embed_params / max(ends, 1)
        return embed * facts.trained_share, optimizer_s(t, facts, facts.num_layers, embed=True, head=True)
    per_param = profile.host_optimizer_s_per_param
    return facts.embed_params * per_param * facts.trained_share, facts.trained_params * per_param


# --------------------------------------------------------------------------- the paper's equations


def paper_step_s(num_layers: int, u: int, c: float, x: float) -> float:
    """Equation 4 of the L2L paper: N (u C + X) forward + N (3 u C + X) recompute and backward."""
    return num_layers * (4 * u * c + 2 * x)


def paper_transfer_overhead(u: int, c: float, x: float) -> float:
    """The share of an L2L step spent on transfers, from equation 6: 2X / (4uC + 2X).

    1 when nothing computes, X / (2C + X) without inner looping (u = 1), and falling to 0 as
    u grows: the inner loop amortises each block's transfer over u micro-batches."""
    return 2 * x / (4 * u * c + 2 * x)
