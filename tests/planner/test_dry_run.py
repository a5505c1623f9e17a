"""Device memory without a device: `train.device=meta` runs the real strategy code on PyTorch's
meta device and accounts every device tensor; the figures are checked against hand counts
here and against the CUDA allocator where a GPU exists (`make test-gpu`)."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.data import build_dataset, build_loader
from relaytrain.dryrun.memory import DeviceMemory
from relaytrain.models import build_model
from relaytrain.placement.world import LocalGroup
from relaytrain.planner.dryrun import simulate
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import build_strategy, choices, strategy_class
from relaytrain.utils.errors import ConfigError

TINY = ["+exp=tiny_baseline", "model.dropout=0.0"]
STRATEGIES = choices()  # every strategy= option, from the registry


def saved_activation_bytes(cfg) -> int:
    """What autograd keeps for the backward of one micro-batch, counted on a real CPU forward
    (every saved tensor's storage once, the parameters left out): the hand count."""
    model = build_model(cfg.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    minibatch = next(iter(build_loader(cfg, build_dataset(cfg))))
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(minibatch[0])
    return sum(kept.values())


@pytest.mark.parametrize("extra", [[], ["model.num_layers=6", "strategy.microbatch_size=8"]])
def test_the_baseline_simulation_equals_a_hand_count(extra):
    """Weights, gradients and AdamW's two moments exactly; the activations at the peak are what
    autograd keeps for one micro-batch, plus the backward's temporaries (short sequences: a few
    tenths more)."""
    cfg = compose_config([*TINY, *extra])
    weights = sum(p.numel() for p in build_model(cfg.model).parameters()) * 4
    (process,) = simulate(cfg).per_process
    kinds = process.by_kind
    assert kinds["weights"] == weights and kinds["gradients"] == weights  # exact: fp32, every parameter
    assert kinds["optimizer state"] == 2 * weights
    kept = saved_activation_bytes(cfg)
    assert kept <= kinds["activations and temporaries"] <= 1.3 * kept
    assert 4 * weights + kept <= process.peak_bytes <= 1.1 * (4 * weights + kept)


def test_the_dry_run_makes_the_allocations_of_a_real_run():
    """The baseline's code on the CPU, its tensors tracked the same way, reaches the same peak:
    meta kernels allocate what real kernels allocate (the CPU's fused attention keeps what a
    GPU's does; AdamW's multi-tensor kernel on both: the meta device has no fused one). L2L is
    not comparable so: on the CPU its uploads are aliases of the host tensors, not copies."""
    cfg = compose_config([*TINY, "train.steps=2", "optim.fused=false"])
    simulated = simulate(cfg, steps=2).per_process[0].peak_bytes
    strategy_on_cpu = build_strategy(build_model(cfg.model), cfg)
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    tracker = DeviceMemory(torch.device("cpu"), strategy_on_cpu.memory_holders)
    try:
        with tracker:
            tracker.register(t for held in strategy_on_cpu.memory_holders().values() for t in held)
            for _ in range(2):
                strategy_on_cpu.step(next(loader), 1e-3)
    finally:
        strategy_on_cpu.close()
    assert simulated == pytest.approx(tracker.peak, rel=0.02)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_dry_and_reports_simulated_memory(tmp_path, strategy, capsys):
    # Four blocks: room for every strategy's default stages and chunks.
    assert main(["train", *TINY, "model.num_layers=4", f"strategy={strategy}", "train.device=meta", "train.steps=2",
                 "train.untimed_steps=0", f"hydra.run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "peak device memory (simulated)" in out and "host memory (estimate)" in out
    import json

    results = json.loads((tmp_path / "results.json").read_text())
    device = results["memory"]["device"]
    assert device["simulated"] is True and device["peak_allocated_bytes"] > 0
    assert sum(device["by_kind"].values()) == device["peak_allocated_bytes"]
    assert results["loss"] == [None, None] and results["memory"]["host_peak_rss_bytes"] is None
    if strategy.startswith("pipe"):  # per stage
        assert [p["rank"] for p in results["memory"]["per_process"]] == [0, 1]
        assert all(p["device"]["simulated"] for p in results["memory"]["per_process"])


TINY_GPT2 = ["model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=512", "data.seq_len=32", "data.num_samples=256",
             "model.dropout=0.0"]
# Every kind of process a stand-in runs for: a replica of the baseline, of FSDP, of an L2L whose
# EPS is replicated, and a pipeline stage's replica, on BERT and on GPT-2 (its weights tied).
ALIKE = [
    [*TINY, "model.num_layers=4", "strategy.replicas=4", "strategy.recompute=block"],
    [*TINY_GPT2, "strategy=baseline", "strategy.replicas=2"],
    [*TINY, "model.num_layers=4", "strategy=fsdp", "strategy.replicas=4", "strategy.reshard_after_forward=false"],
    [*TINY_GPT2, "strategy=fsdp", "strategy.offload=host", "strategy.recompute=block"],
    [*TINY, "model.num_layers=4", "strategy=l2l", "strategy.replicas=4", "strategy.eps_state=replicated"],
    [*TINY_GPT2, "strategy=l2l", "strategy.replicas=2", "strategy.eps_state=replicated", "strategy.stash=host",
     "precision=cmp_fp16"],
    [*TINY, "model.num_layers=4", "strategy=pipe_2bw", "strategy.stages=4", "strategy.num_microbatches=4",
     "strategy.replicas=2", "strategy.recompute=stage"],
    [*TINY_GPT2, "strategy=pipe_2bw", "strategy.replicas=2", "strategy.offload=host"],
    [*TINY_GPT2, "strategy=pipe_flush", "strategy.replicas=2", "strategy.execution=message_driven"],
    [*TINY_GPT2, "strategy=pipe_gpipe", "strategy.replicas=2", "strategy.recompute=block"],
    [*TINY_GPT2, "strategy=pipe_interleaved", "strategy.replicas=2"],
]


# A pipeline stage's in the default suite (~4 s on 2 cores); the rest, an L2L replica's among them, in the slow step.
DEFAULT_ALIKE = (7,)
ALIKE_CASES = [pytest.param(o, marks=() if i in DEFAULT_ALIKE else pytest.mark.slow) for i, o in enumerate(ALIKE)]


@pytest.mark.parametrize("overrides", ALIKE_CASES,
                         ids=lambda o: " ".join(x for x in o if x.startswith(("model=", "strategy"))))
def test_a_rank_stood_in_for_has_exactly_the_figures_of_its_own_dry_run(overrides):
    """The planner's dry runs run one process of each set its strategy says are alike
    (`Strategy.dry_run_stand_in`): every rank's figures, kind by kind, are those it has in the
    dry run of every process. (L2L with a sharded EPS has no stand-ins: there each replica's
    figures are its own, and depend on when its EPS worker drops the gradients it sums.)"""
    cfg = compose_config(overrides)
    every = simulate(cfg, alike_once=False).per_process
    once = simulate(cfg).per_process
    assert [(p.rank, p.process, p.peak_bytes, p.by_kind) for p in once] == \
        [(p.rank, p.process, p.peak_bytes, p.by_kind) for p in every]
    assert all(p.stand_in is None for p in every)
    ran = sorted({p.rank if p.stand_in is None else p.stand_in for p in once})
    assert [p.rank for p in once if p.stand_in is None] == ran  # each stand-in stands for itself
    assert any(p.stand_in is not None for p in once)  # the shortcut was taken


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_s_stand_ins_stand_for_themselves(strategy):
    """What `launch` requires of the stand-ins: each stands for itself, the reporter too."""
    cfg = compose_config([*TINY, "model.num_layers=4", f"strategy={strategy}", "strategy.replicas=2"])
    cls = strategy_class(strategy)
    stand_ins = [cls.dry_run_stand_in(cfg, rank) for rank in range(cls.processes(cfg))]
    assert all(stand_ins[s] == s for s in stand_ins)
    assert stand_ins[cls.reporter(cfg)] == cls.reporter(cfg)
    if str(cfg.strategy.name).startswith("l2l"):  # the EPS is sharded unless told otherwise
        assert stand_ins == list(range(cls.processes(cfg)))
    else:
        assert len(set(stand_ins)) == cls.processes(cfg) // 2


def test_the_threads_of_a_dry_run_take_turns():
    """One computes at a time; a thread hands its turn on only while it waits at a barrier."""
    group, lock = LocalGroup(3), threading.Lock()
    running, most, seen = [0], [0], []

    def work(rank: int) -> None:
        with group.turn():
            for step in range(3):
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
                time.sleep(0.01)  # sleeping lets the GIL go: only the turn keeps the others out
                with lock:
                    running[0] -= 1
                seen.append(group.exchange(rank, (rank, step)))

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert sorted(seen) == sorted([[(0, step), (1, step), (2, step)] for step in range(3)] * 3)


@pytest.mark.slow  # over 8 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_l2l_with_the_stash_on_the_host_is_constant_in_depth():
    """The L2L paper's Table 4: device memory does not grow with depth once the stash is on the host."""
    peaks = {}
    for strategy in ("l2l", "l2l_stash_cpu", "baseline"):
        for blocks in (4, 16):
            cfg = compose_config([*TINY, f"strategy={strategy}", f"model.num_layers={blocks}"])
            peaks[strategy, blocks] = simulate(cfg).peak_bytes
    assert peaks["l2l_stash_cpu", 16] == peaks["l2l_stash_cpu", 4]
    assert peaks["l2l", 16] > 1.5 * peaks["l2l", 4]  # the stash on the device grows with depth
    assert peaks["baseline", 16] > 2.5 * peaks["baseline", 4]


@pytest.mark.parametrize("bound", [1, 2])
def test_l2l_holds_at_most_max_resident_blocks_parts_of_weights(bound):
    cfg = compose_config([*TINY, "strategy=l2l", "model.num_layers=6", f"strategy.max_resident_blocks={bound}"])
    model = build_model(cfg.model)
    parts = [model.embed, *model.blocks, model.head]
    sizes = sorted((sum(p.numel() for p in part.parameters()) * 4 for part in parts), reverse=True)
    weights = simulate(cfg).per_process[0].by_kind["weights"]
    assert sizes[bound] < weights <= sum(sizes[:bound]) + 4096  # + the constant buffers (position ids)


def test_l2l_drops_the_last_blocks_outputs_after_the_turnaround():
    """From the head's turn-around on, only the gradients travel down: one hidden state per
    micro-batch, not the last block's outputs and their gradients as well."""
    def activations(u: int) -> int:
        cfg = compose_config([*TINY, "strategy=l2l", "model.num_layers=4", "strategy.microbatch_size=4",
                              f"strategy.num_microbatches={u}", "data.seq_len=64"])
        return simulate(cfg).per_process[0].by_kind["activations and temporaries"]

    hidden_state = 4 * 64 * compose_config(TINY).model.hidden_size * 4  # b x s x h fp32
    assert activations(8) - activations(2) <= 1.1 * 6 * hidden_state


def test_2bw_holds_one_gradient_copy_per_stage():
    """Updates are applied as soon as their sums arrive, so batch b's gradients are gone before
    batch b+1's accumulate: one gradient copy of the stage's weights at the peak, and two
    weight versions. Its stages, threads of this process that take turns, leave no dispatch mode
    behind: torch's process-wide flag of one once stayed set after them, and torch.compile and the
    low-bit optimizers' host loop, later in the same process, believed a dry run was still on."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    cfg = compose_config(["model=gpt2_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
                          "model.intermediate_size=1024", "model.vocab_size=2048", "data.seq_len=16",
                          "strategy=pipe_2bw", "strategy.num_microbatches=4", "strategy.microbatch_size=2", "optim=sgd"])
    for process in simulate(cfg, steps=4).per_process:
        kinds = process.by_kind
        assert kinds["weights"] == 2 * kinds["optimizer state"]  # two versions, SGD momentum: one copy
        assert kinds["gradients"] == pytest.approx(kinds["optimizer state"], rel=0.01)
    assert not is_in_torch_dispatch_mode()


def test_a_dry_run_refuses_what_needs_values(capsys):
    assert main(["train", "train.device=meta", "train.save_model=true", "train.checkpoint_every=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["relaytrain: error: train.device=meta is a dry run (shapes, no values): drop "
                   "train.save_model=true, train.checkpoint_every"]


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_large_model_is_simulated_without_its_memory(tmp_path):
    """BERT-Large with 48 blocks (600 M parameters: 9.6 GB of weights and AdamW state) runs dry
    in seconds on this machine, which could not hold it."""
    cfg = compose_config(["+exp=bert_large_l2l_stash_cpu", "model.num_layers=48", "train.device=meta",
                          "train.steps=1", "train.untimed_steps=0", "strategy.num_microbatches=2"])
    results = run(cfg, tmp_path, quiet=True)
    assert results["model"]["parameters"] > 5e8
    assert results["memory"]["device"]["peak_allocated_bytes"] < 2 * 2**30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["baseline", "l2l", "l2l_stash_cpu"])
def test_the_simulation_agrees_with_the_cuda_allocator_within_10_percent(tmp_path, strategy):
    common = [*TINY, f"strategy={strategy}", "model.num_layers=6", "model.hidden_size=256", "model.num_heads=4",
              "model.intermediate_size=1024", "data.seq_len=128", "strategy.microbatch_size=16", "train.steps=3",
              "train.untimed_steps=1"]
    simulation = simulate(compose_config(common), steps=3)
    # In a process of its own, as a run is: cuBLAS's workspaces of the tests before stay allocated
    # in this one (an H200, 2026-11-29: 64 MiB more than the run's own peak, 145.1 MiB for l2l).
    subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", "train", *common, "train.device=cuda",
                    f"hydra.run.dir={tmp_path}"], check=True, capture_output=True)
    allocated = json.loads((tmp_path / "results.json").read_text())["memory"]["device"]["peak_allocated_bytes"]
    assert simulation.allocator_peak_bytes == pytest.approx(allocated, rel=0.10), simulation.per_process[0].by_kind


def test_a_dry_run_reports_the_host_memory_a_real_run_would_refuse(tmp_path, monkeypatch):
    """A dry run plans for the target machine: this one's free memory does not stop it."""
    import collections

    import relaytrain.run.preflight

    little = collections.namedtuple("Memory", "available")(2**20)  # 1 MiB free: no real run fits
    monkeypatch.setattr(relaytrain.run.preflight.psutil, "virtual_memory", lambda: little)
    cfg = compose_config([*TINY, "train.steps=1", "train.untimed_steps=0"])
    with pytest.raises(ConfigError, match="GiB of host memory"):
        run(cfg, tmp_path / "real", quiet=True)
    dry = compose_config([*TINY, "train.steps=1", "train.untimed_steps=0", "train.device=meta"])
    memory = run(dry, tmp_path / "dry", quiet=True)["memory"]
    assert memory["host_estimate_bytes"] > little.available and memory["host_peak_rss_bytes"] is None
    assert "estimated from the config" in memory["host_note"]
