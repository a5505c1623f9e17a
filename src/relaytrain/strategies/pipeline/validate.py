"""Check a schedule before anything runs it: invariants per stage, then a replay of all stages
together (an event replay of the programs; the meta-device dry run is `relaytrain.planner.dryrun`).

The per-stage invariants are one incremental checker (`StageInvariants`): the validator
replays each program through it, and the message-driven executor asks it before each choice,
so the executor only ever picks an order the validator accepts. `check_message_driven` goes
further: it explores every state the stages can reach together when each runs whichever
permitted unit has its message, under every order of arrival, and fails on a broken invariant
or a state where no stage can move.

The replay executes every program against modelled channels with the runtime's
semantics: sends never block (isend), receives block until the matching send happened
(irecv + wait), and a stage's OPTIMIZER_STEP(b) waits until every stage it shares weights
with (first and last stage: tied embeddings) has started REDUCE_GRADS(b). If no stage can
move while some still have work, the schedule deadlocks. The same run, with a forward
costing 1 and a backward 2 time units (the paper's figures), yields the timeline the viewer
draws and the bubble the schedule predicts.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

from relaytrain.strategies.pipeline.schedule import (
    COMPUTE,
    Action,
    Op,
    Schedule,
    SlicePlan,
    message,
    one_f_one_b_depth,
    stop_points,
    virtual_stage,
)


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


def check_schedule(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Raise ScheduleError on the first broken invariant; return the replay's timeline."""
    for stage in range(schedule.stages):
        _check_stage(schedule, stage)
    return replay(schedule, forward_time, backward_time)


# ----------------------------------------------------------------------- per stage


def _check_stage(schedule: Schedule, stage: int) -> None:
    actions = schedule.actions(stage)
    _check_counts(schedule, stage, actions)
    invariants = StageInvariants(schedule, stage)
    for action in actions:
        invariants.record(action)
    invariants.finish()


def _check_counts(schedule: Schedule, stage: int, actions: list[Action]) -> None:
    """Every chunk of the stage computes every micro-batch once each way, with the transfers its
    place in the pipeline has (the first virtual stage receives nothing forward, the last sends
    nothing forward)."""
    expected = list(schedule.microbatches)
    last_place = schedule.stages * schedule.chunks - 1
    for chunk in range(schedule.chunks):
        mine = [a for a in actions if a.chunk == chunk]
        for op in COMPUTE:
            seen = sorted(a.microbatch for a in mine if a.op is op)
            if seen != expected:
                raise ScheduleError(f"stage {stage}: {op.value} of chunk {chunk} runs micro-batches {seen}, "
                                    f"expected each of {expected} once")
        place = virtual_stage(stage, chunk, schedule.stages)
        for op, present in ((Op.RECV_ACT, place > 0), (Op.SEND_ACT, place < last_place),
                            (Op.RECV_GRAD, place < last_place), (Op.SEND_GRAD, place > 0)):
            count = sum(a.op is op for a in mine)
            if count != (len(expected) if present else 0):
                raise ScheduleError(f"stage {stage}: {count} {op.value} actions of chunk {chunk} for "
                                    f"{len(expected)} micro-batches")


class StageInvariants:
    """The rules every order of one stage's work keeps, checked action by action:

    - each chunk's forwards in micro-batch order, its backwards too, each backward after its forward;
    - the version rule: micro-batch k computes with the schedule's `weight_version(k, m)`, one of
      the `weight_versions` newest the stage holds (2BW: the newest or the one before);
    - at most two weight versions live: the newest and those of micro-batches in flight;
    - the stash bound: at most the schedule's `in_flight` activations on stage i (1F1B:
      min(d - i, m); GPipe: m);
    - per batch, in batch order, one REDUCE_GRADS after its last backward, then one OPTIMIZER_STEP.

    `record` applies an action (ScheduleError if it breaks a rule); `allows` asks whether a
    sequence of actions could run next, without applying it.
    """

    def __init__(self, schedule: Schedule, stage: int):
        d, m, v = schedule.stages, schedule.num_microbatches, schedule.chunks
        self.rules, self.stage, self.m, self.batches = type(schedule), stage, m, schedule.num_batches
        self.steady_depth = one_f_one_b_depth(d, m, stage)  # the stash that keeps the pipeline full
        self.stash_limit = self.rules.in_flight(d, m, stage, v)
        self.in_flight: dict[tuple[int, int], int] = {}  # (chunk, micro-batch) -> version its forward used
        self.latest = schedule.first_batch  # the newest version this stage holds: optimizer steps done
        # The next micro-batch of each kind of work, per chunk.
        self.next = {(op, chunk): schedule.first_batch * m for op in COMPUTE for chunk in range(v)}
        self.reduced = schedule.first_batch  # batches [first, reduced) have been reduced

    def record(self, action: Action) -> None:
        broken = self.violation(action)
        if broken:
            raise ScheduleError(f"stage {self.stage}: {broken}")
        self._apply(action)

    def allows(self, actions: list[Action]) -> bool:
        trial = copy.copy(self)  # the mutable state is the two dicts
        trial.in_flight, trial.next = dict(self.in_flight), dict(self.next)
        for action in actions:
            if trial.violation(action):
                return False
            trial._apply(action)
        return True

    def finish(self) -> None:
        """Every batch reduced and stepped."""
        if self.reduced != self.batches or self.latest != self.batches:
            raise ScheduleError(f"stage {self.stage}: expected one reduction and one step per batch, in order")

    def violation(self, action: Action) -> str | None:
        """What running `action` now would break (None: nothing)."""
        if action.op in COMPUTE:
            return self._compute_violation(action)
        if action.op is Op.REDUCE_GRADS:
            if action.batch != self.reduced:
                return "expected one reduction and one step per batch, in order"
            if any(self.next[key] < (action.batch + 1) * self.m for key in self.next if key[0] is Op.BACKWARD):
                return f"batch {action.batch}'s update runs before its gradients are complete"
        if action.op is Op.OPTIMIZER_STEP and (action.batch != self.latest or action.batch >= self.reduced):
            return f"batch {action.batch}'s update runs before its gradients are complete"
        return None

    def _compute_violation(self, action: Action) -> str | None:
        k, rule = action.microbatch, self.rules.weight_version(action.microbatch, self.m)
        if action.op is Op.BACKWARD and action.unit not in self.in_flight:
            return f"{action} before its forward"
        if k != self.next[action.op, action.chunk]:
            return f"{action} runs out of micro-batch order (next is {self.next[action.op, action.chunk]})"
        if action.version != rule:
            return f"{action} breaks the version rule (expected v={rule})"
        if not self.latest - self.rules.weight_versions < rule <= self.latest:
            return f"{action} needs version {rule} but the stage holds up to {self.latest}"
        in_flight = len(self.in_flight) + (action.op is Op.FORWARD)
        if in_flight > self.stash_limit:
            return f"{in_flight} stashed activations exceed {self.stash_limit}"
        live = set(self.in_flight.values()) | {self.latest, rule}
        if len(live) > 2:
            return f"weight versions {sorted(live)} live at {action}; at most 2 allowed"
        return None

    def _apply(self, action: Action) -> None:
        if action.op is Op.FORWARD:
            self.in_flight[action.unit] = action.version
        elif action.op is Op.BACKWARD:
            del self.in_flight[action.unit]
        elif action.op is Op.REDUCE_GRADS:
            self.reduced += 1
        elif action.op is Op.OPTIMIZER_STEP:
            self.latest = action.version
        if action.op in COMPUTE:
            self.next[action.op, action.chunk] += 1


# ------------------------------------------------------------------------- replay


def replay(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run every stage's program together; raise ScheduleError on a deadlock or unpaired transfer."""
    run = _Replay(schedule, {Op.FORWARD: forward_time, Op.BACKWARD: backward_time})
    run.run_until_stuck()
    stalled = [(s, run.programs[s][p]) for s, p in enumerate(run.position) if p < len(run.programs[s])]
    if stalled:
        waits = "; ".join(f"stage {s} waits at {a}" for s, a in stalled)
        raise ScheduleError(f"{schedule.name} deadlocks: {waits}")
    unmatched = {key: list(queue) for key, queue in run.channels.items() if queue}
    if unmatched:
        raise ScheduleError(f"sends never received: {unmatched}")
    return Timeline(tuple(tuple(events) for events in run.events))


class _Replay:
    def __init__(self, schedule: Schedule, durations: dict[Op, float]):
        self.schedule = schedule
        self.durations = durations
        self.programs = [schedule.actions(s) for s in range(schedule.stages)]
        self.position = [0] * schedule.stages
        self.clock = [0.0] * schedule.stages
        self.events: list[list[Event]] = [[] for _ in range(schedule.stages)]
        # (from, to, is a gradient, boundary): a stream of messages -> (micro-batch, send time)
        self.channels: dict[tuple[int, int, bool, int], deque] = {}
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
            peer, gradient, boundary = message(action, stage, self.schedule.stages)
            self.channels.setdefault((stage, peer, gradient, boundary), deque()).append((action.microbatch, now))
        elif op in (Op.RECV_ACT, Op.RECV_GRAD):
            return self._receive(stage, action)
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

    def _receive(self, stage: int, action: Action) -> bool:
        peer, gradient, boundary = message(action, stage, self.schedule.stages)
        queue = self.channels.get((peer, stage, gradient, boundary))
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


# ------------------------------------------------------------------ message-driven execution


def check_message_driven(schedule: Schedule) -> int:
    """Every order the message-driven executor may choose, under every order of arrival.

    Each stage runs its program a slice per batch (`stop_points`), starting batch c only once
    every stage has finished batch c - lag (the trainer's stop vote); within a slice it may run
    any unit its `SlicePlan` offers (the next forward or the next backward) that
    `StageInvariants` allows and whose message has been sent. A unit whose updates wait for the
    tied partner's reduction is committed to and waits, as the executor's OPTIMIZER_STEP does.
    Every state the stages can reach together is explored; a broken invariant, or a state where
    some stage has work left and none can move, is a ScheduleError. Returns the states explored.
    """
    model = _MessageModel(schedule)
    start = model.initial()
    seen, frontier = {start.key}, [start]
    while frontier:
        state = frontier.pop()
        moves = model.moves(state)
        if not moves and not model.finished(state):
            raise ScheduleError(f"{schedule.name} message-driven execution can deadlock: {model.describe(state)}")
        for nxt in moves:
            if nxt.key not in seen:
                seen.add(nxt.key)
                frontier.append(nxt)
    return len(seen)


@dataclass(frozen=True)
class _StageState:
    slice: int  # index into the stage's slices (batches first_batch + slice); the earlier ones are done
    started: bool  # the trainer has begun this slice's step (after the stop vote)
    forwards: int  # units of the slice run, per kind
    backwards: int
    committed: Action | None  # a unit chosen and waiting for its updates' reductions


@dataclass
class _GlobalState:
    stages: tuple[_StageState, ...]
    invariants: tuple[StageInvariants, ...]

    @property
    def key(self) -> tuple[_StageState, ...]:
        return self.stages  # the invariants' state follows from the progress


class _MessageModel:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.lag = schedule.stop_lag
        self.slices = [self._slices(schedule.actions(s)) for s in range(schedule.stages)]
        self.sent = [{(a.op, a.microbatch) for a in schedule.actions(s) if a.op in (Op.SEND_ACT, Op.SEND_GRAD)}
                     for s in range(schedule.stages)]
        last = schedule.stages - 1
        self.partners = {0: {0, last}, last: {0, last}}  # tied embeddings couple the end stages

    def _slices(self, program: list[Action]) -> list[list[Action]]:
        bounds = [0, *sorted(stop_points(program, self.schedule.num_microbatches)), len(program)]
        return [program[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def initial(self) -> _GlobalState:
        d = self.schedule.stages
        return _GlobalState(tuple(_StageState(0, True, 0, 0, None) for _ in range(d)),
                            tuple(StageInvariants(self.schedule, s) for s in range(d)))

    def finished(self, state: _GlobalState) -> bool:
        return all(st.slice == len(self.slices[s]) for s, st in enumerate(state.stages))

    def describe(self, state: _GlobalState) -> str:
        return "; ".join(f"stage {s} in batch {self.schedule.first_batch + st.slice} after {st.forwards} forwards "
                         f"and {st.backwards} backwards" + (f", waiting to run {st.committed}" if st.committed else "")
                         for s, st in enumerate(state.stages) if st.slice < len(self.slices[s]))

    # -- what the stages can do ---------------------------------------------------------------
    def moves(self, state: _GlobalState) -> list[_GlobalState]:
        return [nxt for s in range(self.schedule.stages) for nxt in self._stage_moves(state, s)]

    def _stage_moves(self, state: _GlobalState, s: int) -> list[_GlobalState]:
        st = state.stages[s]
        if st.slice == len(self.slices[s]):
            return []
        if not st.started:
            started = _StageState(st.slice, True, 0, 0, None)
            return [self._replace(state, s, started, state.invariants[s])] if self._vote_allows(state, st.slice) else []
        plan = self._plan(s, st)
        if st.committed is not None:
            ready = self._updates_ready(state, s, plan.entails(st.committed))
            return [self._run(state, s, plan, st.committed)] if ready else []
        if plan.finished():
            if not self._updates_ready(state, s, list(plan.updates)):
                return []
            invariants = self._record(state.invariants[s], plan.leftover())
            return [self._replace(state, s, _StageState(st.slice + 1, False, 0, 0, None), invariants)]
        moves = []
        for unit in plan.candidates():
            if state.invariants[s].allows(plan.entails(unit)) and self._arrived(state, s, unit):
                ready = self._updates_ready(state, s, plan.entails(unit))
                waiting = _StageState(st.slice, True, st.forwards, st.backwards, unit)
                moves.append(self._run(state, s, plan, unit) if ready else self._replace(state, s, waiting,
                                                                                         state.invariants[s]))
        return moves

    def _plan(self, s: int, st: _StageState) -> SlicePlan:
        """The slice's plan with the units run so far taken (their order does not change the plan)."""
        plan = SlicePlan.of(self.slices[s][st.slice])
        for unit in list(plan.forwards)[:st.forwards] + list(plan.backwards)[:st.backwards]:
            plan.take(unit)
        return plan

    def _run(self, state: _GlobalState, s: int, plan: SlicePlan, unit: Action) -> _GlobalState:
        st = state.stages[s]
        invariants = self._record(state.invariants[s], plan.take(unit))
        forward = unit.op is Op.FORWARD
        progress = _StageState(st.slice, True, st.forwards + forward, st.backwards + (not forward), None)
        return self._replace(state, s, progress, invariants)

    @staticmethod
    def _record(invariants: StageInvariants, actions: list[Action]) -> StageInvariants:
        invariants = copy.deepcopy(invariants)
        for action in actions:
            invariants.record(action)
        return invariants

    @staticmethod
    def _replace(state: _GlobalState, s: int, st: _StageState, invariants: StageInvariants) -> _GlobalState:
        stages, kept = list(state.stages), list(state.invariants)
        stages[s], kept[s] = st, invariants
        return _GlobalState(tuple(stages), tuple(kept))

    # -- what a stage waits for ------------------------------------------------------------------
    def _arrived(self, state: _GlobalState, s: int, unit: Action) -> bool:
        """Whether the unit's message has been sent: activation k by the previous stage's forward,
        gradient k by the next stage's backward."""
        k = unit.microbatch
        if unit.op is Op.FORWARD:
            return s == 0 or (self._done(state, s - 1, Op.FORWARD) > k and (Op.SEND_ACT, k) in self.sent[s - 1])
        last = s == self.schedule.stages - 1
        return last or (self._done(state, s + 1, Op.BACKWARD) > k and (Op.SEND_GRAD, k) in self.sent[s + 1])

    def _updates_ready(self, state: _GlobalState, s: int, actions: list[Action]) -> bool:
        """An OPTIMIZER_STEP(b) waits for every stage sharing weights with this one to reduce b."""
        m = self.schedule.num_microbatches
        steps = [a.batch for a in actions if a.op is Op.OPTIMIZER_STEP]
        return all(self._done(state, p, Op.BACKWARD) >= (b + 1) * m for b in steps for p in self.partners.get(s, {s}))

    def _vote_allows(self, state: _GlobalState, next_slice: int) -> bool:
        """Batch c starts only once every stage has finished batch c - lag."""
        return all(st.slice > next_slice - self.lag for st in state.stages)

    @staticmethod
    def _done(state: _GlobalState, s: int, op: Op) -> int:
        """One past the last micro-batch stage s has run `op` for (each kind runs in order; a
        schedule message-driven execution may reorder has one chunk)."""
        return state.invariants[s].next[op, 0]
