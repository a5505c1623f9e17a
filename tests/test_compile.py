"""train.compile=true: the block function compiled once and shared by every block
(`relaytrain.models.compile`).

Through the trainer, dropout on, every strategy compiled ends with the weights its eager run
ends with, to 1e-6 at fp32 (inductor fuses, so not bit for bit), and reports its compile time;
the blocks of a model share one graph, compiled once for all of them, and L2L's functional
calls with other weights reuse it; a machine that cannot compile is refused in one line.
Compiling takes seconds on the CPU: baseline, l2l and pipe_flush run by default, the other
strategies are `slow`.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from relaytrain.commands.cli import main
from relaytrain.models import build_model
from relaytrain.models.compile import compile_blocks
from relaytrain.models.layered import Draw, MicroBatch
from relaytrain.run.compose import compose_config
from tests.conftest import TINY_BERT, TINY_LLAMA, tiny_cfg
from tests.test_dropout import max_difference, trained

STEPS = 2
# (strategy, extra overrides): the default slice first, then the `slow` rest.
FAST = []  # ~27 s each on 2 cores: every case runs in the slow step (the default suite stays within 8 minutes)
SLOW = [("l2l", ()), ("baseline", ()), ("pipe_flush", ()), ("baseline", ("strategy.recompute=block",)), ("fsdp", ()), ("l2l_stash_cpu", ()), ("pipe_2bw", ()),
        ("pipe_gpipe", ()), ("pipe_interleaved", ()),
        # with replicas (fsdp's default is two): DDP, and L2L's EPS sharded over two workers
        ("baseline", ("strategy.replicas=2",)), ("l2l", ("strategy.replicas=2",))]
CASES = [pytest.param(name, extra, id="-".join([name, *extra])) for name, extra in FAST] + [
    pytest.param(name, extra, id="-".join([name, *extra]), marks=pytest.mark.slow) for name, extra in SLOW]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test's compiles counted from none, and no graph of another test's model in the way."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_cfg(name: str, *overrides: str):
    """Four blocks of a tiny BERT (hidden and attention dropout), four micro-batches of 2, SGD."""
    return tiny_cfg("bert", f"strategy={name}", "model.dropout=0.1", "model.num_layers=4", f"train.steps={STEPS}",
                    "train.untimed_steps=0", "train.save_model=true", "strategy.microbatch_size=2", "strategy.num_microbatches=4", "strategy.timeout_s=300",
                    "optim=sgd", "optim.lr=0.05", *overrides)


@pytest.mark.parametrize(("name", "extra"), CASES)
def test_compiled_equals_eager_with_dropout_on(name, extra, tmp_path):
    eager_results, eager = trained(compile_cfg(name, *extra), tmp_path / "eager")
    results, compiled = trained(compile_cfg(name, *extra, "train.compile=true"), tmp_path / "compiled")
    assert max_difference(compiled, eager) <= 1e-6
    assert results["loss"] == pytest.approx(eager_results["loss"], abs=1e-6)
    assert "compile" not in eager_results
    report = results["compile"]
    assert report["first_step_s"] > 0 and report["total_s"] >= report["first_step_s"]
    # Graphs depend on what differs (L2L: its no-grad forward and its recompute), never on the block.
    assert 1 <= report["graphs"] <= 2 and report["compiles"] <= 2, report


@pytest.mark.slow  # about 10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_the_blocks_share_one_graph_compiled_once():
    """Three decoder blocks, two micro-batches (other draw keys): one frame compiled, one graph.
    Then blocks called as L2L calls them, `functional_call` with plain tensors as their weights:
    one more graph (Dynamo tells a tensor from a Parameter), made once for every block."""
    cfg = compose_config([*TINY_LLAMA, "model.dropout=0.1"])
    model = build_model(cfg.model)
    stats = compile_blocks(model, True, torch.device("cpu"))
    try:
        ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
        for index in range(2):
            model(MicroBatch(ids, ids, draw=Draw(0, 0, index))).backward()
        assert (stats.compiles, stats.graphs) == (1, 1)
        mb = MicroBatch(ids, ids, draw=Draw(0, 1, 0))
        hidden = model.embed_input(ids, mb.draw).detach()
        ctx = model.context(mb, hidden)
        for block in model.blocks:
            weights = {n: p.detach().clone().requires_grad_(True) for n, p in block.named_parameters()}
            functional_call(block, weights, (hidden, ctx)).sum().backward()
            assert all(w.grad is not None for w in weights.values())
        assert (stats.compiles, stats.graphs) == (2, 2)
        assert stats.seconds > 0
    finally:
        stats.close()


def test_a_machine_that_cannot_compile_is_refused_in_one_line(monkeypatch, capsys):
    from torch._inductor import cpp_builder

    def missing():
        raise RuntimeError("no working C++ compiler found in ('g++',)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    assert main(["train", *TINY_BERT, "train.compile=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: train.compile=true needs a C++ compiler"), err
