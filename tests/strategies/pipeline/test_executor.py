"""Message-driven execution (`strategy.execution=message_driven`, AxoNN).

Without processes: the executor, fed adversarial arrival orders by a scripted mailbox, only
ever runs orders the validator's invariants accept, keeps forwards and backwards each in
micro-batch order, runs exactly its slice, and runs 1F1B's order when every message is there.
With real gloo groups: the weights equal the plain loop (flush, GPipe) and the delayed-gradient
rule (2BW), and two runs with different injected stage delays end bit for bit the same.
"""

import random
import threading
from datetime import timedelta

import pytest
import torch

from relaytrain.step.metrics import PhaseTimer
from relaytrain.strategies.pipeline.comms import Watcher
from relaytrain.strategies.pipeline.executor import MessageDrivenExecutor
from relaytrain.strategies.pipeline.jitter import StageJitter
from relaytrain.strategies.pipeline.schedule import COMPUTE, Op, build_schedule, stop_points
from relaytrain.strategies.pipeline.validate import StageInvariants
from relaytrain.utils.errors import ConfigError
from tests.conftest import train_plain_loop
from tests.strategies.pipeline.test_runtime import (
    STEPS,
    assert_same_weights,
    pipeline_cfg,
    trained_by_delayed_gradients,
    trained_by_pipeline,
    whole_minibatch_cfg,
)

# ------------------------------------------------------------------ the executor, no processes


class ScriptedMailbox:
    """Messages arrive when the script says, within causality: a gradient for micro-batch k only
    after this stage sent k's activation (ran its forward), each direction in order."""

    def __init__(self, stage, rng: random.Random, prefetched: bool):
        self.stage, self.rng, self.prefetched = stage, rng, prefetched
        self.posted: dict = {}
        self.delivered: set = set()

    def is_posted(self, receive):
        return (receive.op, receive.microbatch) in self.posted

    def post(self, receive):
        self.posted[(receive.op, receive.microbatch)] = True

    def arrived(self, receive):
        key = (receive.op, receive.microbatch)
        if self.prefetched and key in self.posted and self._may_arrive(key):
            self.delivered.add(key)  # every message here as soon as causality allows
        return key in self.delivered

    def wait_any(self, receives):
        """Deliver posted messages in a random (adversarial) order until one of `receives` is here."""
        keys = [(r.op, r.microbatch) for r in receives]
        while not any(k in self.delivered for k in keys):
            pending = [k for k in self.posted if k not in self.delivered and self._may_arrive(k)]
            assert pending, f"stage waits for {keys}, which can never arrive"
            self.delivered.add(self.rng.choice(pending))

    def _may_arrive(self, key):
        op, k = key
        return op is Op.RECV_ACT or k in self.stage.forwarded


class FakeStage:
    def __init__(self, stage: int, rng: random.Random, prefetched: bool = False):
        self.stage = stage
        self.timer = PhaseTimer()
        self.forwarded: set[int] = set()
        self.actions = []
        self.mailbox = ScriptedMailbox(self, rng, prefetched)

    def do(self, action):
        if action.op in (Op.RECV_ACT, Op.RECV_GRAD):
            assert (action.op, action.microbatch) in self.mailbox.delivered, f"{action} before its message"
            del self.mailbox.posted[(action.op, action.microbatch)]
        if action.op is Op.FORWARD:
            self.forwarded.add(action.microbatch)
        self.actions.append(action)


def run_message_driven(kind, d, m, n, stage, rng, prefetched=False):
    """The stage's whole program run slice by slice as the trainer's steps run it."""
    schedule = build_schedule(kind, d, m, n)
    program = schedule.actions(stage)
    fake = FakeStage(stage, rng, prefetched)
    executor = MessageDrivenExecutor(fake)
    invariants = StageInvariants(schedule, stage)
    bounds = [0, *sorted(stop_points(program, m)), len(program)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        before = len(fake.actions)
        executor.run(program, start, end, invariants)
        assert sorted(map(str, fake.actions[before:])) == sorted(map(str, program[start:end]))  # exactly the slice
    return schedule, program, fake.actions, executor


SHAPES = [(kind, d, m) for kind in ("pipe_flush", "pipe_2bw", "pipe_gpipe") for d in (2, 3, 4) for m in (2, 3, 4, 6)
          if kind != "pipe_2bw" or m >= d]


@pytest.mark.parametrize(("kind", "d", "m"), SHAPES)
def test_adversarial_arrivals_only_ever_give_orders_the_validator_accepts(kind, d, m):
    reordered = 0
    for stage in range(d):
        for seed in range(8):
            schedule, program, actions, executor = run_message_driven(kind, d, m, 3, stage, random.Random(seed))
            replay = StageInvariants(schedule, stage)  # an independent replay of what ran
            for action in actions:
                replay.record(action)
            replay.finish()
            for op in COMPUTE:  # each kind in micro-batch order: gradients sum in the same order every run
                assert [a.microbatch for a in actions if a.op is op] == list(range(3 * m))
            reordered += executor.out_of_order
    if d > 2 or kind == "pipe_gpipe":
        assert reordered > 0, "no arrival order ever changed the interleaving"


@pytest.mark.parametrize(("kind", "d", "m"), SHAPES)
def test_with_every_message_there_it_follows_1f1b(kind, d, m):
    """1F1B kinds follow their program. A GPipe stage that holds 1F1B's stash runs a backward
    whose gradient is here before the next forward (`executor.preferred`, AxoNN's order): with
    every gradient back in time, its stash never grows past 1F1B's and its order is 1F1B's."""
    for stage in range(d):
        _, program, actions, executor = run_message_driven(kind, d, m, 3, stage, random.Random(0), prefetched=True)
        if kind == "pipe_gpipe":
            program = build_schedule("pipe_flush", d, m, 3).actions(stage)
        assert actions == program
        assert (executor.out_of_order == 0) == (kind != "pipe_gpipe" or min(d - stage, m) == m)


def test_a_two_stage_1f1b_pipeline_has_no_freedom_to_reorder():
    """Stage 0's forwards never wait and the stash bound holds it to the program; the last stage
    can only alternate. What message-driven execution can gain starts at three stages."""
    for stage in (0, 1):
        for seed in range(20):
            *_, executor = run_message_driven("pipe_flush", 2, 4, 2, stage, random.Random(seed))
            assert executor.out_of_order == 0


# ------------------------------------------------------------------ the watcher


class RecordedWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self, timeout):
        self.log.append(("done", self.name, threading.current_thread().name))
        return True


def test_the_watcher_starts_handed_over_transfers_on_its_thread_in_channel_order():
    """The message-driven mailbox hands gloo receives over unstarted: the channel's thread posts
    each after the one before it completed, so the posting order the peer's sends match holds."""
    watcher, log = Watcher(timedelta(seconds=5), poll=False), []

    def start(name):
        log.append(("start", name, threading.current_thread().name))
        return RecordedWork(log, name)

    try:
        for k in range(3):
            watcher.watch("recv", k, start=lambda k=k: start(k))
        for k in range(3):
            watcher.wait_any([k])
    finally:
        watcher.close()
    assert [(what, name) for what, name, _ in log] == [(w, k) for k in range(3) for w in ("start", "done")]
    assert {thread for *_, thread in log} == {"relaytrain-watch-recv"}


def test_a_transfer_that_fails_to_start_is_raised_to_the_waiting_stage():
    watcher = Watcher(timedelta(seconds=5), poll=False)

    def refused():
        raise RuntimeError("connection reset by peer")

    try:
        watcher.watch("recv", "act 0", start=refused)
        with pytest.raises(RuntimeError, match="connection reset by peer"):
            watcher.wait_any(["act 0"])
    finally:
        watcher.close()


# ------------------------------------------------------------------ the injected delay


def test_the_stage_jitter_is_parsed_strictly_and_draws_nothing_from_torch(monkeypatch):
    monkeypatch.setenv("RELAYTRAIN_STAGE_JITTER", "stage=1,max=0.3,seed=4")
    jitter = StageJitter.from_environment()
    assert (jitter.stage, jitter.max_fraction, jitter.seed) == (1, 0.3, 4)
    state = torch.get_rng_state()
    with jitter.around("forward", 7, torch.device("cpu")):
        sum(range(10000))
    assert torch.equal(torch.get_rng_state(), state) and jitter.added_s >= 0
    for bad in ("stage=1", "stage=x,max=0.3", "stage=1,max=0.3,speed=2", "stage=-1,max=0.3", "stage=1,max=20"):
        monkeypatch.setenv("RELAYTRAIN_STAGE_JITTER", bad)
        with pytest.raises(ConfigError, match="RELAYTRAIN_STAGE_JITTER"):
            StageJitter.from_environment()


# ------------------------------------------------------------------ real gloo groups

MESSAGE_DRIVEN = "strategy.execution=message_driven"


def gpt2_equals_the_plain_loop(tmp_path, monkeypatch, jitter: str, *overrides: str):
    """Train a message-driven GPT-2 pipeline with `jitter` injected; check it against the plain
    loop; return its results and weights."""
    monkeypatch.setenv("RELAYTRAIN_STAGE_JITTER", jitter)
    cfg = pipeline_cfg("gpt2", MESSAGE_DRIVEN, "strategy.microbatch_size=2", "optim=adamw", "optim.lr=1e-3", *overrides)
    results, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    return results, ours


@pytest.mark.slow  # about 10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_flush_message_driven_on_three_stages_equals_the_plain_loop(tmp_path, monkeypatch):
    results, ours = gpt2_equals_the_plain_loop(tmp_path, monkeypatch, "stage=0,max=2.0,seed=1", "strategy=pipe_flush",
                                               "strategy.stages=3", "strategy.num_microbatches=6")
    assert torch.equal(ours.transformer.wte.weight, ours.lm_head.weight)
    report = results["strategy_report"]
    assert report["execution"] == "message_driven"
    assert all(st["units"] == 2 * 6 * STEPS for st in report["per_stage"])
    assert report["per_stage"][0]["injected_delay"]["added_s"] > 0
    assert "injected delay (benchmarking aid)" in report["summary"]


@pytest.mark.slow  # over 7 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_gpipe_message_driven_with_a_slow_first_stage_equals_the_plain_loop(tmp_path, monkeypatch):
    """The last stage runs backwards while stage 0's late activations are on their way."""
    results, _ = gpt2_equals_the_plain_loop(tmp_path, monkeypatch, "stage=0,max=1.0,seed=3", "strategy=pipe_gpipe",
                                            "strategy.stages=2", "strategy.num_microbatches=4")
    last = results["strategy_report"]["per_stage"][-1]
    assert last["out_of_order"] > 0, "the last stage never left GPipe's order: nothing was tested"


@pytest.mark.slow  # over 7 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_2bw_message_driven_equals_the_delayed_gradient_rule(tmp_path):
    cfg = pipeline_cfg("bert", "model.num_layers=3", "strategy=pipe_2bw", MESSAGE_DRIVEN, "strategy.stages=3",
                       "strategy.microbatch_size=2", "strategy.num_microbatches=3", "optim=adamw", "optim.lr=1e-3")
    _, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, trained_by_delayed_gradients(cfg))


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_different_stage_delays_give_the_same_weights_bit_for_bit(tmp_path, monkeypatch):
    """The interleaving reacts to timing; the sums do not: each stage's backwards, and its
    forwards, run in micro-batch order whatever arrives first."""
    cfg = pipeline_cfg("bert", "model.num_layers=4", "model.dropout=0.1", "strategy=pipe_2bw", MESSAGE_DRIVEN,
                       "strategy.stages=4", "strategy.microbatch_size=2", "strategy.num_microbatches=4",
                       "optim=adamw", "optim.lr=1e-3")
    runs = []
    for name, jitter in (("slow-first", "stage=0,max=3.0,seed=1"), ("slow-third", "stage=2,max=3.0,seed=2")):
        monkeypatch.setenv("RELAYTRAIN_STAGE_JITTER", jitter)
        runs.append(trained_by_pipeline(cfg, tmp_path / name))
    (first, a), (second, b) = runs
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert first["loss"] == second["loss"]
    reordered = [st["out_of_order"] for r in (first, second) for st in r["strategy_report"]["per_stage"]]
    assert sum(reordered) > 0, "the delays never changed an interleaving: nothing was tested"
