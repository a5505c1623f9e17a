"""How a stage runs a slice of its program (`strategy.execution`).

`static`: the program's own order, action by action, with each receive posted one action ahead
per direction where the backend allows it. A stage whose next action waits for a message
waits, even when the other kind of work could run.

`message_driven` (AxoNN's scheduling, its Algorithm 2): the stage runs whichever unit has its
message — the next forward once its activation has arrived, the next backward once its
gradient has — and when both could run, `preferred` picks one. What may change is only
how forwards and backwards interleave (`schedule.SlicePlan`): forwards keep micro-batch order
among themselves and so do backwards, so the gradients accumulate in the same order in every
run (bit-for-bit reproducible whatever the timing) and each channel carries its messages in
the order the peer posts its receives. Before each choice the executor asks the validator's
own invariant checker (`validate.StageInvariants`: the version rule, at most two versions,
the stash bound, updates after their batch's last backward) whether the unit may run, so it
never picks an order the validator would refuse, and `validate.check_message_driven` proves
for small shapes that no order it may pick deadlocks.

Both run exactly the slice they are given (`runtime.Segment`: from the stage's first action
of batch c to its first of batch c+1), so `step` and `drain` keep their meaning: after a
slice the stage has done the same actions in either mode.
"""

from __future__ import annotations

from typing import Protocol

from relaytrain.step.metrics import PhaseTimer
from relaytrain.strategies.pipeline.comms import Comms, Mailbox
from relaytrain.strategies.pipeline.schedule import Action, Op, SlicePlan
from relaytrain.strategies.pipeline.validate import ScheduleError, StageInvariants

RECEIVE = (Op.RECV_ACT, Op.RECV_GRAD)
RECVS_AHEAD = 1  # receives posted ahead of their action, per direction (see Comms.async_p2p)


class Stage(Protocol):
    """What an executor needs of the stage it drives (`runtime.PipelineStrategy`)."""

    stage: int
    comms: Comms
    mailbox: Mailbox
    timer: PhaseTimer

    def do(self, action: Action) -> None: ...


class StaticExecutor:
    """The program's order."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def run(self, program: list[Action], start: int, end: int, invariants: StageInvariants) -> None:
        ahead = start
        for i in range(start, end):
            if self.stage.comms.async_p2p:
                ahead = self._post_receives(program, max(ahead, i), end)
            self.stage.do(program[i])

    def _post_receives(self, program: list[Action], start: int, horizon: int) -> int:
        """Post the receives of program[start:horizon] in program order (each peer sends in that
        order), at most RECVS_AHEAD per direction outstanding, so the data arrives while this
        stage computes instead of after it asks. Returns the index up to which all are posted.

        Never past `horizon`, the end of this step's slice: the stages may drain there instead,
        and a receive posted for a transfer that never comes would be left behind.
        """
        mailbox, i = self.stage.mailbox, start
        while i < horizon:
            a = program[i]
            if a.op in RECEIVE and not mailbox.is_posted(a):
                if sum(1 for posted in mailbox.posted if posted.op is a.op) >= RECVS_AHEAD:
                    break
                mailbox.post(a)
            i += 1
        return i

    def report(self) -> dict:
        return {}


def preferred(plan: SlicePlan, ready: list[Action], invariants: StageInvariants) -> Action:
    """Of the permitted units whose messages are here, the one to run now.

    A backward goes first once the stage holds as many stashed activations as 1F1B would
    (`StageInvariants.steady_depth`): it frees one and sends a gradient to the stage before,
    which may be waiting for it. That is AxoNN's order (its last stage runs each backward right
    after its forward; its first stage injects a forward per backward once the pipeline is
    full). Below that depth, the program's order. Under 1F1B's bound a forward could not run
    there anyway, so only GPipe's order changes: a stage whose next activation is late runs
    backwards meanwhile, and while gradients come back in time its stash stays at 1F1B's depth
    instead of growing to m. (A timing model of both preferences, `scripts/bench_axonn.py`:
    GPipe on 2-4 stages with one stage jittered by U[0, 30 %) gains 1.08-1.10 over static
    against 1.04-1.06 for the program's order; 1F1B is unchanged.)
    """
    backward = next((u for u in ready if u.op is Op.BACKWARD), None)
    if backward is not None and len(invariants.in_flight) >= invariants.steady_depth:
        return backward
    static = plan.static_next()
    return static if static in ready else ready[0]


class MessageDrivenExecutor:
    """Whichever permitted unit has its message; `preferred`'s choice when both have."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.units = 0  # units run
        self.out_of_order = 0  # of which, run while the program's next unit was another one

    def run(self, program: list[Action], start: int, end: int, invariants: StageInvariants) -> None:
        plan = SlicePlan.of(program[start:end])
        while not plan.finished():
            unit = self._next_unit(plan, invariants)
            self.units += 1
            self.out_of_order += unit != plan.static_next()
            self._run(plan.take(unit), invariants)
        self._run(plan.leftover(), invariants)

    def _next_unit(self, plan: SlicePlan, invariants: StageInvariants) -> Action:
        """The unit to run now, waiting for a message when no permitted one has its message yet."""
        mailbox = self.stage.mailbox
        while True:
            for unit in plan.candidates():  # post both receives: data lands while the stage computes
                r = plan.receive(unit)
                if r is not None and not mailbox.is_posted(r):
                    mailbox.post(r)
            allowed = [u for u in plan.candidates() if invariants.allows(plan.entails(u))]
            if not allowed:
                raise ScheduleError(f"stage {self.stage.stage}: none of {plan.candidates()} may run next")
            receives = {u: plan.receive(u) for u in allowed}
            ready = [u for u, r in receives.items() if r is None or mailbox.arrived(r)]
            if ready:
                return preferred(plan, ready, invariants)
            with self.stage.timer.phase("message_wait"):
                mailbox.wait_any(list(receives.values()))

    def _run(self, actions: list[Action], invariants: StageInvariants) -> None:
        for action in actions:
            invariants.record(action)
            self.stage.do(action)

    def report(self) -> dict:
        return {"units": self.units, "out_of_order": self.out_of_order}
