"""The closed-form cost of a pipeline (PipeDream-2BW's planner model, §4.2.1).

Every pipeline strategy names `PipelineCost` as its cost model (bound to its own class): the
schedule class it names composes a minibatch from the stage times and says how many
micro-batches each stage keeps in flight and how many weight versions it holds, so one set of
formulas serves every schedule. `InterleavedCost` adds the chunks per stage the planner tries.
A run's measured figures are the stages' own (`runtime.PipelineStrategy.report`, combined by
`report.combine_reports`). Every figure is a prediction; the shared formulas are
`relaytrain.cost.formulas`'s.
"""

from __future__ import annotations

from relaytrain.cost.formulas import (
    FP32,
    ModelFacts,
    Shape,
    StepCost,
    both,
    cpu_activation_bytes,
    optimizer_s,
    powers_of_two_dividing,
    stage_bytes,
)
from relaytrain.cost.links import allreduce_s, p2p_s
from relaytrain.cost.model import CostModel
from relaytrain.cost.profile import Profile, Timings
from relaytrain.schema.config import Recompute
from relaytrain.step.optim import state_words
from relaytrain.strategies.pipeline.config import Offload
from relaytrain.strategies.whole_model_cost import WORKER_OVERHEAD_BYTES

PLANNED_CHUNKS = (2, 4)  # the chunks per stage the planner tries under an interleaved schedule


class PipelineCost(CostModel):
    """A pipeline's answers; `self.strategy` is the `PipelineStrategy` subclass: it names the
    schedule, the chunks per stage and the blocks of each stage."""

    def shapes(self, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Every worker in the pipeline: w x d = workers with 2 <= d <= the model's blocks and w
        dividing the batch; each micro-batch size b of a replica's share with m = batch / (w b) as
        the schedule allows; no recompute, block or stage recompute."""
        return [Shape(self.strategy.name, b, batch // (workers // d * b), workers // d, d, str(recompute),
                      self.shape_options(chunks=v) if v > 1 else ())
                for d in range(2, min(workers, num_layers) + 1) if workers % d == 0 and batch % (workers // d) == 0
                for b in powers_of_two_dividing(batch // (workers // d))
                for v in self.chunk_choices(d, num_layers)
                if self.strategy.schedule.refusal(d, batch // (workers // d * b), v) is None
                for recompute in Recompute]

    def chunk_choices(self, stages: int, num_layers: int) -> list[int]:
        """The model chunks per stage the planner tries on `stages` stages (one: no interleaving)."""
        return [1]

    def recomputes(self, cfg) -> bool:
        return cfg.strategy.recompute != Recompute.none

    def step_cost(self, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """PipeDream-2BW's THROUGHPUT(.) (§4.2.1) for one minibatch of m micro-batches on d stages
        x w replicas: stage i costs t_i = max(T_i^comp, T_i^comm) per micro-batch, compute (with
        recompute) and the activations and gradients exchanged with its neighbours overlapping;
        the schedule composes the minibatch from the t_i (filled and drained once, or kept full).
        Then the all-reduce of each stage's gradients across the replicas (hidden under the next
        minibatch where the schedule lets it) and the stage's optimizer step."""
        s, v, schedule = cfg.strategy, self.strategy.chunks(cfg), self.strategy.schedule
        m, d, b = s.num_microbatches, s.stages, s.microbatch_size
        t = profile.for_workers(self.strategy.processes(cfg), cfg.train.threads)
        compute = self.stage_times(cfg, facts, t)
        exchange = v * p2p_s(facts.boundary_bytes(b), self.strategy.processes(cfg), profile)  # one message per chunk
        slots = [max(work, exchange) for work in compute]
        pipeline = schedule.minibatch_time(slots, m, v)
        each = self.stages(cfg)
        sums = max(allreduce_s(facts.stage_params(*stage) * facts.trained_share * FP32, s.replicas, profile) for stage in each)
        hidden = schedule.hides_gradient_sums and profile.device_type != "cpu"  # a CPU sums on the cores that compute
        exposed_sums = max(0.0, sums - pipeline) if hidden else sums
        optimizer = max(optimizer_s(t, facts, *stage) for stage in each)
        parts = {"compute": m * max(compute), "bubble": pipeline - m * max(slots),
                 "activations exchange": 2 * m * exchange, "gradient sums (exposed)": exposed_sums,
                 "optimizer": optimizer}
        return StepCost(pipeline + exposed_sums + optimizer, parts, [f"bubble {schedule.bubble_words(d, m, v)}"])

    def device_bytes(self, cfg, facts: ModelFacts) -> int:
        """The fullest stage's MEMORY(.): its weight versions, gradients and optimizer state, and
        the activations of the micro-batches its schedule keeps in flight there."""
        s, v, schedule = cfg.strategy, self.strategy.chunks(cfg), self.strategy.schedule
        # A unit in flight holds one chunk's activations: 1/v of the stage's blocks.
        return max(stage_bytes(facts, s.microbatch_size, blocks, facts.stage_params(blocks, first, last), last,
                               schedule.in_flight(s.stages, s.num_microbatches, i, v) / v,
                               schedule.weight_versions, str(s.recompute))
                   for i, (blocks, first, last) in enumerate(self.stages(cfg)))

    def host_state_bytes(self, cfg, facts: ModelFacts) -> int:
        """With `strategy.offload=host`, the fullest stage's fp32 masters, optimizer state and the
        gradients downloaded for the eager param server (AxoNN); otherwise none: every weight,
        gradient and optimizer state lives where the stage computes."""
        if cfg.strategy.offload != Offload.host:
            return 0
        largest = max(facts.stage_params(*stage) for stage in self.stages(cfg)) * facts.trained_share
        return int(largest * FP32 * (2 + facts.state_words))

    def estimate_host_bytes(self, cfg, num_params: int, device_type: str) -> int:
        """Host memory of the whole run, an estimate: each replica's weight versions, gradients,
        optimizer state (and host masters with offload) and the activations of the first stage, which
        keeps the most in flight; every worker builds the whole model once before keeping its stage."""
        s = cfg.strategy
        versions, v = self.strategy.schedule.weight_versions, self.strategy.chunks(cfg)
        # The first stage holds the most; a unit in flight holds a chunk's blocks.
        in_flight = -(-self.strategy.schedule.in_flight(s.stages, s.num_microbatches, 0, v) // v)
        masters = 1 if s.offload == Offload.host else 0  # host copies of the weights, apart from the working ones
        per_replica = num_params * FP32 * (versions + 1 + state_words(cfg.optim) + masters)
        if s.recompute == Recompute.none:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=cfg.model.num_layers * in_flight)
        else:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=s.stages,
                                                stash_entries=cfg.model.num_layers * in_flight)
        # Each worker builds the whole model once before keeping its stage.
        workers = self.strategy.processes(cfg) * (WORKER_OVERHEAD_BYTES + num_params * FP32)
        return int(workers + s.replicas * per_replica)

    def stages(self, cfg) -> list[tuple[int, bool, bool]]:
        """(blocks, holds the embeddings, holds the head) of each stage."""
        d = cfg.strategy.stages
        return [(sum(len(r) for r in self.strategy.stage_blocks(cfg, i)), i == 0, i == d - 1) for i in range(d)]

    def stage_times(self, cfg, facts: ModelFacts, t: Timings) -> list[float]:
        """T_i^comp: each stage's forward + backward (+ recompute) seconds for one micro-batch."""
        b, recompute = cfg.strategy.microbatch_size, cfg.strategy.recompute
        block, embed, head = (facts.part_times(t, part, b) for part in ("block", "embed", "head"))
        times = []
        for blocks, first, last in self.stages(cfg):
            work = blocks * both(block) + (both(embed) if first else 0.0) + (both(head) if last else 0.0)
            if recompute == Recompute.block:
                work += blocks * block.forward_s
            elif recompute == Recompute.stage:
                work += blocks * block.forward_s + (embed.forward_s if first else 0.0) + (head.forward_s if last else 0.0)
            times.append(work)
        return times


class InterleavedCost(PipelineCost):
    """An interleaved schedule's answers: also two and four model chunks a stage."""

    def chunk_choices(self, stages: int, num_layers: int) -> list[int]:
        """Two and four chunks a stage, where every chunk still gets a block."""
        return [v for v in PLANNED_CHUNKS if stages * v <= num_layers]
