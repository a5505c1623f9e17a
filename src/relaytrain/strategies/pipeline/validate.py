"""Check a schedule before anything runs it: invariants per stage, then a dry run of all stages.

The dry run executes every program against simulated channels with the runtime's
semantics: sends never block (isend), receives block until the matching send happened
(irecv + wait), and a stage's OPTIMIZER_STEP(b) waits until every stage it shares weights
with (first and last stage: tied embeddings) has started REDUCE_GRADS(b). If no stage can
move while some still have work, the schedule deadlocks. The same run, with a forward
costing 1 and a backward 2 time units (the paper's figures), yields the timeline the viewer
draws and the bubble the schedule predicts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relaytrain.strategies.pipeline.schedule import COMPUTE, Action, Op, Schedule, weight_version


class ScheduleError(ValueError):
    """A schedule breaks an invariant; the message names the stage and the action."""


@dataclass(frozen=True)
class Event:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    events: tuple[tuple[Event, ...], ...]  # [stage] -> compute and optimizer events in order

    @property
    def makespan(self) -> float:
        return max((e.end for stage in self.events for e in stage), default=0.0)

    def busy(self, stage: int) -> float:
        return sum(e.end - e.start for e in self.events[stage] if e.action.op in COMPUTE)

    def bubble_fraction(self) -> float:
        """Idle share of stage-time between the first start and the last end (all stages)."""
        span = self.makespan * len(self.events)
        return 1.0 - sum(self.busy(s) for s in range(len(self.events))) / span if span else 0.0


def bubble_formula(stages: int, m: int) -> float:
    """Idle share of a flushed pipeline with uniform stages: (d - 1) / (m + d - 1)."""
    return (stages - 1) / (m + stages - 1)


def check_schedule(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Raise ScheduleError on the first broken invariant; return the dry run's timeline."""
    for stage in range(schedule.stages):
        _check_stage(schedule, stage)
    return simulate(schedule, forward_time, backward_time)


# ----------------------------------------------------------------------- per stage


def _check_stage(schedule: Schedule, stage: int) -> None:
    actions = schedule.actions(stage)
    _check_counts(schedule, stage, actions)
    _check_versions_and_stash(schedule, stage, actions)
    _check_updates(schedule, stage, actions)


def _check_counts(schedule: Schedule, stage: int, actions: list[Action]) -> None:
    expected = list(schedule.microbatches)
    for op in COMPUTE:
        seen = sorted(a.microbatch for a in actions if a.op is op)
        if seen != expected:
            raise ScheduleError(f"stage {stage}: {op.value} runs micro-batches {seen}, expected each of {expected} once")
    first, last = stage == 0, stage == schedule.stages - 1
    for op, present in ((Op.RECV_ACT, not first), (Op.SEND_ACT, not last), (Op.RECV_GRAD, not last),
                        (Op.SEND_GRAD, not first)):
        count = sum(a.op is op for a in actions)
        if count != (len(expected) if present else 0):
            raise ScheduleError(f"stage {stage}: {count} {op.value} actions for {len(expected)} micro-batches")


def _check_versions_and_stash(schedule: Schedule, stage: int, actions: list[Action]) -> None:
    """Forward before backward, the version rule action by action, <= 2 live versions, stash bound."""
    d, m, kind = schedule.stages, schedule.num_microbatches, schedule.kind
    stash_limit = m if kind == "gpipe" else min(d - stage, m)
    in_flight: dict[int, int] = {}  # micro-batch -> version its forward used
    latest = schedule.first_batch  # the newest version this stage holds: optimizer steps done
    for action in actions:
        if action.op is Op.OPTIMIZER_STEP:
            latest = action.version
        if action.op not in COMPUTE:
            continue
        k = action.microbatch
        rule = weight_version(kind, k, m)
        if action.version != rule:
            raise ScheduleError(f"stage {stage}: {action} breaks the version rule (expected v={rule})")
        if not latest - 1 <= rule <= latest or (kind != "pipe_2bw" and rule != latest):
            raise ScheduleError(f"stage {stage}: {action} needs version {rule} but the stage holds up to {latest}")
        if action.op is Op.FORWARD:
            in_flight[k] = rule
            if len(in_flight) > stash_limit:
                raise ScheduleError(f"stage {stage}: {len(in_flight)} stashed activations exceed {stash_limit}")
        elif in_flight.pop(k, None) is None:
            raise ScheduleError(f"stage {stage}: {action} before its forward")
        live = set(in_flight.values()) | {latest}
        if len(live) > 2:
            raise ScheduleError(f"stage {stage}: weight versions {sorted(live)} live at {action}; at most 2 allowed")


def _check_updates(schedule: Schedule, stage: int, actions: list[Action]) -> None:
    """One reduction then one step per batch, in batch order, after the batch's last backward."""
    m = schedule.num_microbatches
    reduces = [i for i, a in enumerate(actions) if a.op is Op.REDUCE_GRADS]
    steps = [i for i, a in enumerate(actions) if a.op is Op.OPTIMIZER_STEP]
    batches = range(schedule.first_batch, schedule.num_batches)
    if [actions[i].batch for i in reduces] != list(batches) or len(steps) != len(reduces):
        raise ScheduleError(f"stage {stage}: expected one reduction and one step per batch, in order")
    last_backward = {a.microbatch // m: i for i, a in enumerate(actions) if a.op is Op.BACKWARD}
    for b, reduce_at, step_at in zip(batches, reduces, steps, strict=True):
        if not last_backward[b] < reduce_at < step_at or actions[step_at].batch != b:
            raise ScheduleError(f"stage {stage}: batch {b}'s update runs before its gradients are complete")


# ------------------------------------------------------------------------- dry run


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run every stage's program together; raise ScheduleError on a deadlock or unpaired transfer."""
    run = _DryRun(schedule, {Op.FORWARD: forward_time, Op.BACKWARD: backward_time})
    run.run_until_stuck()
    stalled = [(s, run.programs[s][p]) for s, p in enumerate(run.position) if p < len(run.programs[s])]
    if stalled:
        waits = "; ".join(f"stage {s} waits at {a}" for s, a in stalled)
        raise ScheduleError(f"{schedule.kind} deadlocks: {waits}")
    unmatched = {key: list(queue) for key, queue in run.channels.items() if queue}
    if unmatched:
        raise ScheduleError(f"sends never received: {unmatched}")
    return Timeline(tuple(tuple(events) for events in run.events))


class _DryRun:
    def __init__(self, schedule: Schedule, durations: dict[Op, float]):
        self.schedule = schedule
        self.durations = durations
        self.programs = [schedule.actions(s) for s in range(schedule.stages)]
        self.position = [0] * schedule.stages
        self.clock = [0.0] * schedule.stages
        self.events: list[list[Event]] = [[] for _ in range(schedule.stages)]
        self.channels: dict[tuple[int, int], deque] = {}  # (from, to) -> (micro-batch, send time)
        self.reduced: dict[int, dict[int, float]] = {}  # batch -> stage -> time its reduction started
        last = schedule.stages - 1
        self.partners = {0: {0, last}, last: {0, last}}  # tied embeddings couple the end stages

    def run_until_stuck(self) -> None:
        """Run the stages round after round, each as far as it can go, until none moves:
        every program is then finished, or the ones that are not are deadlocked."""
        moved = True
        while moved:
            moved = False
            for stage, program in enumerate(self.programs):
                while self.position[stage] < len(program) and self._try(stage, program[self.position[stage]]):
                    self.position[stage] += 1
                    moved = True

    def _try(self, stage: int, action: Action) -> bool:
        op, now = action.op, self.clock[stage]
        if op in COMPUTE:
            self._record(stage, now, now + self.durations[op], action)
        elif op in (Op.SEND_ACT, Op.SEND_GRAD):
            peer = stage + 1 if op is Op.SEND_ACT else stage - 1
            self.channels.setdefault((stage, peer), deque()).append((action.microbatch, now))
        elif op in (Op.RECV_ACT, Op.RECV_GRAD):
            return self._receive(stage, stage - 1 if op is Op.RECV_ACT else stage + 1, action)
        elif op is Op.REDUCE_GRADS:
            self.reduced.setdefault(action.batch, {})[stage] = now
        else:
            arrived = self.reduced.get(action.batch, {})
            partners = self.partners.get(stage, {stage})
            if not partners <= arrived.keys():
                return False
            start = max([now, *(arrived[p] for p in partners)])
            self._record(stage, start, start, action)
        return True

    def _receive(self, stage: int, peer: int, action: Action) -> bool:
        queue = self.channels.get((peer, stage))
        if not queue:
            return False
        microbatch, sent_at = queue.popleft()
        if microbatch != action.microbatch:
            raise ScheduleError(
                f"stage {stage} expects {action} but stage {peer} sent micro-batch {microbatch} first"
            )
        self.clock[stage] = max(self.clock[stage], sent_at)
        return True

    def _record(self, stage: int, start: float, end: float, action: Action) -> None:
        self.events[stage].append(Event(start, end, action))
        self.clock[stage] = end
