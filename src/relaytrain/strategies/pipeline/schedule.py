"""Pipeline schedules as data: what each stage does, step by step (no tensors, no processes).

A schedule is a class per kind of pipeline (`FlushSchedule`, `TwoBWSchedule`, `GPipeSchedule`)
that owns its rules: the order of each stage's forwards and backwards, which weight version a
micro-batch computes with, how many versions a stage keeps, how many micro-batches a stage
holds in flight, where an update goes, how long the pipeline idles, and how far one stage
may run ahead of another (the stop vote's lag). The runtime (`runtime.py`), the validator
(`validate.py`), the viewer (`view.py`) and the strategies' cost models ask the class; none
of them knows which kind it is. A new schedule is its class here and its strategy module.

Built for a shape (stages d, micro-batches per update m, batches n, or the batches [first, n)
a run resumed at step `first` still has to do), a schedule holds each stage's *program*: a list
of steps, each a short list of `Action`s around one unit of work (receive, compute, send), as
DeepSpeed's instruction generators yield them. The runtime executes a program through a
dispatch table, in program order or as messages arrive (`executor.py`, which sees a slice of
the program as a `SlicePlan`); the validator replays all programs together; the viewer draws
them.

Micro-batches are numbered globally, k = b*m + j for micro-batch j of batch b, so a rule such
as 2BW's "micro-batch k of batch b = k // m uses weight version max(b - 1, 0)" reads directly
off the actions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from relaytrain.cost.formulas import fill_and_drain_bubble
from relaytrain.utils.errors import ConfigError


class Op(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECV_ACT = "recv_act"  # activation of micro-batch k from the previous stage
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"  # gradient of this stage's output from the next stage
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"  # start summing batch b's gradients over replicas and tied copies
    OPTIMIZER_STEP = "optimizer_step"  # wait for that sum, apply it: weight version `version` exists


COMPUTE = (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch: int | None = None  # global micro-batch id k (compute and transfers)
    batch: int | None = None
    version: int | None = None  # weights a forward/backward uses; the version a step creates
    chunk: int = 0  # which of the stage's model chunks computes (interleaved schedules; else 0)

    def __str__(self) -> str:
        what = f"{self.op.value}(mb={self.microbatch}" if self.microbatch is not None else f"{self.op.value}(b={self.batch}"
        return what + (f", chunk={self.chunk}" if self.chunk else "") + (f", v={self.version})" if self.version is not None
                                                                          else ")")

    @property
    def unit(self) -> tuple[int, int]:
        """(chunk, micro-batch): what a stash entry, a message and a compute action are about."""
        return self.chunk, self.microbatch


Step = list[Action]
Work = tuple[Op, int, int]  # (FORWARD or BACKWARD, micro-batch, chunk): one unit of compute


def one_f_one_b_depth(stages: int, m: int, stage: int) -> int:
    """Micro-batches 1F1B keeps in flight on `stage`: its warm-up forwards plus one, at most m.
    The depth that keeps the pipeline full (the message-driven executor aims for it too)."""
    return min(stages - stage, m)


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """Where a stage's chunk sits in the whole pipeline: model chunk c of stage s is the model's
    c x d + s-th, so activations go round the stages v times (Megatron's interleaved layout)."""
    return chunk * stages + stage


TRANSFERS = (Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD)


def message(action: Action, stage: int, stages: int) -> tuple[int, bool, int]:
    """Whom a transfer action talks to and which stream it is on: (peer stage, is a gradient,
    boundary). The boundary is the one between virtual stages e and e + 1 it crosses: a send and
    its receive name the same one, and the messages of one stream arrive in the order they were
    sent. Activations go to the next stage round the ring, gradients to the previous one."""
    place = virtual_stage(stage, action.chunk, stages)
    downstream = action.op in (Op.SEND_ACT, Op.RECV_GRAD)
    peer = (stage + 1) % stages if downstream else (stage - 1) % stages
    return peer, action.op in (Op.RECV_GRAD, Op.SEND_GRAD), place if downstream else place - 1


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: its rules (the class) and, built for a shape, every stage's program.

    Subclasses set the class attributes and say the order of compute (`compute_order`); where
    updates go and what a stage holds follow from the defaults unless a schedule says otherwise.
    """

    stages: int
    num_microbatches: int  # m: micro-batches per weight update
    num_batches: int  # n: weight updates
    programs: tuple[tuple[tuple[Action, ...], ...], ...]  # [stage][step] -> actions
    first_batch: int = 0  # the programs run batches [first_batch, num_batches)
    chunks: int = 1  # v: model chunks per stage (interleaved schedules)

    name: ClassVar[str] = ""  # as users name it: the strategy that runs it
    legend: ClassVar[str] = ""  # one line for `relaytrain schedule`: what the picture shows
    weight_versions: ClassVar[int] = 1  # versions a stage keeps: the newest and (2BW) the one before
    stop_lag: ClassVar[int] = 1  # batches a stage may be ahead of the slowest (see `stop_points`)
    hides_gradient_sums: ClassVar[bool] = False  # the sums run behind the next minibatch (no flush waits)
    reorderable: ClassVar[bool] = True  # message-driven execution may change how forwards and backwards interleave
    batches_shown: ClassVar[int] = 2  # what `relaytrain schedule` draws unless told

    # -- rules -----------------------------------------------------------------------------
    @classmethod
    def refusal(cls, stages: int, m: int, chunks: int = 1) -> str | None:
        """Why this schedule cannot run d stages of v chunks with m micro-batches per update
        (None: it can)."""
        return None if chunks == 1 else f"{cls.name} runs one model chunk per stage, not {chunks}"

    @classmethod
    def weight_version(cls, microbatch: int, m: int) -> int:
        """The weight version micro-batch k computes with (forward and backward alike)."""
        return microbatch // m

    @classmethod
    def last_backward(cls, batch: int, m: int) -> tuple[int, int]:
        """The unit (chunk, micro-batch) of every stage's last backward of `batch`: backwards
        keep micro-batch order, and a micro-batch leaves a stage's backward through chunk 0."""
        return 0, (batch + 1) * m - 1

    @classmethod
    def in_flight(cls, stages: int, m: int, stage: int, chunks: int = 1) -> int:
        """The most units (chunk, micro-batch) `stage` holds between their forward and backward:
        its stash."""
        return one_f_one_b_depth(stages, m, stage)

    @classmethod
    def bubble(cls, stages: int, m: int, chunks: int = 1) -> float:
        """The idle share of stage time its formula predicts for equal stages."""
        return fill_and_drain_bubble(stages, m)

    @classmethod
    def bubble_words(cls, stages: int, m: int, chunks: int = 1) -> str:
        return f"(d-1)/(m+d-1) = {cls.bubble(stages, m):.3f} per flush"

    @classmethod
    def minibatch_time(cls, slots: list[float], m: int, chunks: int = 1) -> float:
        """A minibatch's pipeline time when stage i takes slots[i] per micro-batch: filled and
        drained once (PipeDream-2BW §4.2.1): sum of the slots + (m - 1) x the slowest."""
        return sum(slots) + (m - 1) * max(slots)

    @classmethod
    def compute_order(cls, stages: int, m: int, stage: int, batches: int, first: int, chunks: int = 1) -> list[Work]:
        """The units `stage` computes for batches [first, batches), in order."""
        raise NotImplementedError

    @classmethod
    def place_updates(cls, steps: list[Step], m: int) -> list[Step]:
        """Insert OPTIMIZER_STEP(b), which creates version b + 1: right after batch b's reduction,
        since the next batch computes with the new version at once."""
        placed: list[Step] = []
        for step in steps:
            placed.append(step)
            if step[-1].op is Op.REDUCE_GRADS:
                placed.append([_optimizer_step(step[-1].batch)])
        return placed

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def check_shape(cls, stages: int, m: int, batches: int, chunks: int = 1) -> None:
        """Refuse (stages, micro-batches, chunks) the schedule cannot run, naming the keys to change."""
        if stages < 1 or m < 1 or batches < 1 or chunks < 1:
            raise ConfigError(f"stages={stages}, micro-batches={m}, chunks={chunks} and batches={batches} "
                              f"must be positive")
        refused = cls.refusal(stages, m, chunks)
        if refused:
            raise ConfigError(refused)

    @classmethod
    def build(cls, stages: int, num_microbatches: int, num_batches: int = 1, first_batch: int = 0,
              chunks: int = 1) -> Schedule:
        cls.check_shape(stages, num_microbatches, num_batches, chunks)
        if not 0 <= first_batch < num_batches:
            raise ConfigError(f"a schedule's first batch {first_batch} must be in [0, {num_batches})")
        programs = tuple(
            tuple(tuple(step) for step in cls.stage_program(stages, num_microbatches, stage, num_batches, first_batch,
                                                            chunks))
            for stage in range(stages)
        )
        return cls(stages, num_microbatches, num_batches, programs, first_batch, chunks)

    @classmethod
    def stage_program(cls, stages: int, m: int, stage: int, batches: int, first: int = 0, chunks: int = 1) -> list[Step]:
        """Steps of one stage for batches [first, batches): each forward/backward with its transfers,
        plus the update steps. Ids and versions are the whole run's, so a resumed run's program is
        the rest of the uninterrupted run's work (2BW starts on versions first - 1 and first)."""
        order = cls.compute_order(stages, m, stage, batches, first, chunks)
        last_backward = {k // m: i for i, (op, k, _) in enumerate(order) if op is Op.BACKWARD}
        steps: list[Step] = []
        for i, (op, k, chunk) in enumerate(order):
            steps.append(_compute_step(op, k, chunk, stage, stages, chunks, cls.weight_version(k, m), m))
            if last_backward[k // m] == i:  # this stage's last backward of batch b
                steps.append([Action(Op.REDUCE_GRADS, batch=k // m)])
        return cls.place_updates(steps, m)

    # -- a built schedule -----------------------------------------------------------------------
    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.num_batches

    @property
    def microbatches(self) -> range:
        """The global ids of the micro-batches the programs run."""
        return range(self.num_microbatches * self.first_batch, self.total_microbatches)

    def actions(self, stage: int) -> list[Action]:
        """The stage's program flattened in execution order."""
        return [action for step in self.programs[stage] for action in step]


class FlushSchedule(Schedule):
    """PipeDream-Flush: 1F1B within each batch, then a flush: reduce gradients, one optimizer
    step, and the next batch starts on the new weights (version b for batch b)."""

    name = "pipe_flush"
    legend = "1F1B within each minibatch, then a flush: one weight version, the baseline's updates"

    @classmethod
    def compute_order(cls, stages, m, stage, batches, first, chunks=1):
        return [item for b in range(first, batches) for item in _one_f_one_b(stages, stage, b * m, m)]


class GPipeSchedule(Schedule):
    """GPipe: all forwards of a batch, then all backwards, then the flush (the comparison the
    PipeDream-2BW paper draws in its Figures 1a and 3): every micro-batch's activations alive at once."""

    name = "pipe_gpipe"
    legend = "every forward of a minibatch, then every backward, then a flush: one weight version"

    @classmethod
    def in_flight(cls, stages, m, stage, chunks=1):
        return m

    @classmethod
    def compute_order(cls, stages, m, stage, batches, first, chunks=1):
        return [item for b in range(first, batches)
                for item in [(Op.FORWARD, b * m + j, 0) for j in range(m)] + [(Op.BACKWARD, b * m + j, 0) for j in range(m)]]


class TwoBWSchedule(Schedule):
    """PipeDream-2BW: 1F1B over all n*m micro-batches without flushes. After a stage's last
    backward of batch b its gradients are reduced; the optimizer step that makes version b+1
    runs just before the stage's first forward that uses it (the first micro-batch of batch
    b+2), which is the version switch. Waiting until then lets the reduction run behind later
    micro-batches instead of stalling the pipeline."""

    name = "pipe_2bw"
    legend = "1F1B without flushes: two weight versions, each update one step delayed"
    weight_versions = 2
    # The first stage starts batch c while the last is still in c - 1 (m >= d keeps it there),
    # past c - 2's reduction: the newest vote every stage has cast is c - 2's.
    stop_lag = 2
    hides_gradient_sums = True
    batches_shown = 3  # the first new version is used from batch 3 on

    @classmethod
    def refusal(cls, stages, m, chunks=1):
        # With fewer micro-batches than stages, stage 0 would start batch b+2 before its own
        # last backward of batch b: a third weight version would be needed.
        if m < stages:
            return (f"pipe_2bw needs strategy.num_microbatches >= strategy.stages (got {m} < {stages}); "
                    f"raise strategy.num_microbatches to at least {stages}")
        return super().refusal(stages, m, chunks)

    @classmethod
    def weight_version(cls, microbatch, m):
        return max(microbatch // m - 1, 0)

    @classmethod
    def bubble(cls, stages, m, chunks=1):
        return 0.0

    @classmethod
    def bubble_words(cls, stages, m, chunks=1):
        return "none in steady state (no flush)"

    @classmethod
    def minibatch_time(cls, slots, m, chunks=1):
        return m * max(slots)  # the pipeline stays full: every stage works every slot

    @classmethod
    def compute_order(cls, stages, m, stage, batches, first, chunks=1):
        return _one_f_one_b(stages, stage, first * m, m * (batches - first))

    @classmethod
    def place_updates(cls, steps, m):
        """OPTIMIZER_STEP(b) just before the first forward that uses version b + 1, or at the end
        of the run for the last updates."""
        placed: list[Step] = []
        pending: list[int] = []  # batches reduced but not yet applied
        for step in steps:
            head = step[-1] if step[-1].op is Op.REDUCE_GRADS else _compute_of(step)
            if head.op is Op.FORWARD:
                while pending and pending[0] + 1 <= head.version:
                    placed.append([_optimizer_step(pending.pop(0))])
            placed.append(step)
            if head.op is Op.REDUCE_GRADS:
                pending.append(head.batch)
        return placed + [[_optimizer_step(b)] for b in pending]


class InterleavedSchedule(Schedule):
    """Interleaved 1F1B (Narayanan et al., 2021; the survey's Fig. 9): each stage holds v model
    chunks (stage s: the model's chunks s, s + d, ...), so a micro-batch goes round the stages v
    times and the pipeline fills and drains in 1/v of the time: the bubble is (d - 1) / (v m) of
    the ideal time, for v times the point-to-point messages. Megatron's order per stage: warm-up
    forwards (2 (d - s - 1) + (v - 1) d of them, every one when m = d; one chunk: 1F1B's d - s - 1),
    then one forward and one backward, then the remaining backwards; the k-th forward of a batch runs chunk
    (k mod dv) div d on micro-batch (k div dv) d + k mod d, the backwards visit the chunks in
    reverse. A flush per minibatch, one weight version: the plain loop's updates. m must be a
    multiple of d, as Megatron requires."""

    name = "pipe_interleaved"
    legend = "interleaved 1F1B: v model chunks per stage, a flush per minibatch; one weight version"
    reorderable = False  # the order across chunks is the schedule's: message-driven execution keeps to it

    @classmethod
    def refusal(cls, stages, m, chunks=1):
        if m % stages:
            return (f"pipe_interleaved needs strategy.num_microbatches to be a multiple of strategy.stages "
                    f"(got {m} for {stages} stages); use {max(stages, m - m % stages)} or {m + stages - m % stages}")
        return None

    @classmethod
    def in_flight(cls, stages, m, stage, chunks=1):
        return min(_interleaved_warmup(stages, m, stage, chunks) + 1, m * chunks)

    @classmethod
    def bubble(cls, stages, m, chunks=1):
        return (stages - 1) / (chunks * m + stages - 1)

    @classmethod
    def bubble_words(cls, stages, m, chunks=1):
        return (f"(d-1)/(v m+d-1) = {cls.bubble(stages, m, chunks):.3f} per flush "
                f"(bubble time (d-1)/(v m) = {(stages - 1) / (chunks * m):.3f} of the ideal)")

    @classmethod
    def minibatch_time(cls, slots, m, chunks=1):
        """Filling and draining takes 1/v of a slot per stage: sum / v + (m - 1/v) x the slowest,
        which is (m + (d - 1) / v) slots for equal stages."""
        return sum(slots) / chunks + (m - 1 / chunks) * max(slots)

    @classmethod
    def compute_order(cls, stages, m, stage, batches, first, chunks=1):
        return [item for b in range(first, batches) for item in _interleaved(stages, stage, b * m, m, chunks)]


def _interleaved_warmup(stages: int, m: int, stage: int, chunks: int) -> int:
    """Forwards before the first backward: Megatron's rule for several chunks, 1F1B's for one."""
    if chunks == 1:
        return min(stages - stage - 1, m)
    if m == stages:  # every forward first: the pipeline never reaches a steady state
        return m * chunks
    return min(2 * (stages - stage - 1) + (chunks - 1) * stages, m * chunks)


def _interleaved(stages: int, stage: int, first: int, m: int, chunks: int) -> list[Work]:
    """One batch of interleaved 1F1B on `stage` (micro-batches first .. first + m - 1)."""
    group = stages * chunks

    def unit(op: Op, i: int) -> Work:
        chunk = (i % group) // stages
        return op, first + (i // group) * stages + i % stages, chunk if op is Op.FORWARD else chunks - 1 - chunk

    total, warmup = m * chunks, _interleaved_warmup(stages, m, stage, chunks)
    order = [unit(Op.FORWARD, i) for i in range(warmup)]
    for j in range(total - warmup):
        order += [unit(Op.FORWARD, warmup + j), unit(Op.BACKWARD, j)]
    return order + [unit(Op.BACKWARD, j) for j in range(total - warmup, total)]


def schedules() -> dict[str, type[Schedule]]:
    """Every schedule by name, subclasses of subclasses included (a schedule may refine another);
    each must name itself, or two strategies would run one program under the same name."""
    found: dict[str, type[Schedule]] = {}
    pending = list(Schedule.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending += cls.__subclasses__()
        if "name" not in vars(cls) or not cls.name:
            raise TypeError(f"schedule {cls.__qualname__} does not set its own `name` (its strategy's name)")
        if found.setdefault(cls.name, cls) is not cls:
            raise TypeError(f"schedules {found[cls.name].__qualname__} and {cls.__qualname__} share the name {cls.name!r}")
    return found


def build_schedule(name: str, stages: int, num_microbatches: int, num_batches: int = 1, first_batch: int = 0,
                   chunks: int = 1) -> Schedule:
    """The schedule `name` (a pipeline strategy's name) built for this shape."""
    known = schedules()
    if name not in known:
        raise ConfigError(f"schedule {name!r} is not one of {', '.join(known)}")
    return known[name].build(stages, num_microbatches, num_batches, first_batch, chunks)


def _one_f_one_b(stages: int, stage: int, first: int, count: int) -> list[Work]:
    """Warm-up forwards, then alternate forward/backward, then drain the backwards.

    Stage i runs d - i - 1 forwards ahead, so it never holds more than min(d - i, count)
    activations: the memory bound of 1F1B.
    """
    warmup = min(stages - stage - 1, count)
    order = [(Op.FORWARD, first + j, 0) for j in range(warmup)]
    for j in range(count - warmup):
        order += [(Op.FORWARD, first + warmup + j, 0), (Op.BACKWARD, first + j, 0)]
    order += [(Op.BACKWARD, first + j, 0) for j in range(count - warmup, count)]
    return order


def _compute_step(op: Op, k: int, chunk: int, stage: int, stages: int, chunks: int, version: int, m: int) -> Step:
    """A unit with its transfers: the first virtual stage reads the input ids, the last the labels."""
    place = virtual_stage(stage, chunk, stages)
    first, last = place == 0, place == stages * chunks - 1
    work = Action(op, k, k // m, version, chunk)
    if op is Op.FORWARD:
        recv = [] if first else [Action(Op.RECV_ACT, k, k // m, chunk=chunk)]
        send = [] if last else [Action(Op.SEND_ACT, k, k // m, chunk=chunk)]
    else:
        recv = [] if last else [Action(Op.RECV_GRAD, k, k // m, chunk=chunk)]
        send = [] if first else [Action(Op.SEND_GRAD, k, k // m, chunk=chunk)]
    return [*recv, work, *send]


def _optimizer_step(batch: int) -> Action:
    return Action(Op.OPTIMIZER_STEP, batch=batch, version=batch + 1)


def _compute_of(step: Step) -> Action:
    return next(a for a in step if a.op in COMPUTE)


# ----------------------------------------------------------------------- stopping early


def stop_points(actions: list[Action], m: int) -> dict[int, int]:
    """Where a stage's program (batches [first, n)) can end after batch c - 1 instead: index -> c,
    for every batch c after the first.

    Up to that index the program equals the one for batches [first, c), so a stage that
    decides there switches to that program and only finishes what it has begun. The index is
    the stage's first action of batch c, moved back over the 2BW optimizer steps placed just
    before it: the shorter program runs those at its end, after the last backwards.
    """
    starts: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.op in (Op.RECV_ACT, Op.FORWARD) and a.microbatch % m == 0:
            starts.setdefault(a.batch, i)
    points = {}
    for c, i in sorted(starts.items())[1:]:
        while actions[i - 1].op is Op.OPTIMIZER_STEP and actions[i - 1].batch < c - 1:
            i -= 1
        points[i] = c
    return points


# ----------------------------------------------------------------------- reordering a slice


@dataclass
class SlicePlan:
    """A slice of a stage's program as units the message-driven executor may reorder.

    A *unit* is one compute step with its transfers (receive, compute, send), named by its
    compute action. Forwards keep their program order among themselves, and so do backwards:
    only how the two interleave may change, so gradients still accumulate in micro-batch order
    (results are reproducible run to run) and every channel carries its messages in the order
    the peer posts its receives. The updates stay where the program's rules put them:
    REDUCE_GRADS(b) right after the backward it follows (the batch's last on this stage), an
    OPTIMIZER_STEP right before the first forward that computes with the version it makes,
    and any left when the units are done at the end, in program order. Run in program order,
    a plan gives back exactly the slice.
    """

    forwards: deque[Action]  # compute actions, program order
    backwards: deque[Action]
    order: list[Action]  # every unit in program order
    steps: dict[Action, list[Action]]  # unit -> its receive, compute and send
    reduce_after: dict[Action, Action]  # backward -> the REDUCE_GRADS right after it
    updates: deque[Action] = field(default_factory=deque)  # OPTIMIZER_STEPs not yet run, program order
    done: set[Action] = field(default_factory=set)

    @classmethod
    def of(cls, actions: list[Action]) -> SlicePlan:
        forwards, backwards, order, steps, reduce_after, updates = deque(), deque(), [], {}, {}, deque()
        receive: list[Action] = []  # the receive before the next compute action
        unit: list[Action] = []  # the last compute action's steps: its send follows it
        for a in actions:
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                receive = [a]
            elif a.op in COMPUTE:
                (forwards if a.op is Op.FORWARD else backwards).append(a)
                order.append(a)
                steps[a] = unit = [*receive, a]
                receive = []
            elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                unit.append(a)
            elif a.op is Op.REDUCE_GRADS:
                reduce_after[order[-1]] = a
            else:
                updates.append(a)
        return cls(forwards, backwards, order, steps, reduce_after, updates)

    def candidates(self) -> list[Action]:
        """The units that may run next: the next forward and the next backward."""
        return [queue[0] for queue in (self.forwards, self.backwards) if queue]

    def static_next(self) -> Action | None:
        """The unit the program would run next."""
        return next((u for u in self.order if u not in self.done), None)

    def receive(self, unit: Action) -> Action | None:
        """The unit's receive action, if it has one."""
        first = self.steps[unit][0]
        return first if first.op in (Op.RECV_ACT, Op.RECV_GRAD) else None

    def entails(self, unit: Action) -> list[Action]:
        """Every action running `unit` now takes, in order: the updates it needs first, its steps,
        the reduction that follows it."""
        before = [u for u in self.updates if unit.op is Op.FORWARD and u.version <= unit.version]
        after = [self.reduce_after[unit]] if unit in self.reduce_after else []
        return before + self.steps[unit] + after

    def take(self, unit: Action) -> list[Action]:
        """Mark `unit` run; return `entails(unit)`."""
        actions = self.entails(unit)
        (self.forwards if unit.op is Op.FORWARD else self.backwards).remove(unit)
        for a in actions:
            if a.op is Op.OPTIMIZER_STEP:
                self.updates.remove(a)
        self.done.add(unit)
        return actions

    def finished(self) -> bool:
        return not self.forwards and not self.backwards

    def leftover(self) -> list[Action]:
        """The updates still to run once every unit has (program order)."""
        left, self.updates = list(self.updates), deque()
        return left
