"""optim.master_dtype=bf16: the eager param server keeps its masters in bf16, makes each update
in fp32 and rounds it back stochastically, the draws keyed by (train.seed, parameter, update).

The rounding is torchao's rule on relaytrain's own keyed draws; a run equals a plain Hugging
Face loop that rounds the same way after torch's AdamW, resumes exactly, holds 2 bytes a master
on the host (and no second copy under cmp_bf16), and is refused in one line where it is not built.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.models import build_model
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.step.lowbit import state_words
from relaytrain.step.rounding import CHUNK, ROUNDING_VS_FP32_ADAMW, draws, round_to_bf16, rounding_key
from relaytrain.strategies import build_strategy
from relaytrain.strategies.l2l_cost import eps_state_bytes, wire_bytes
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder
from tests.conformance.references import (
    assert_resumes_exactly,
    assert_within_a_rounding,
    exempt_from_decay,
    hf_saved,
    minibatches,
    reference_loop,
    update_delay,
)
from tests.conftest import needs_extra, with_marks

STEPS = 3
SEED = 5
RUN_KEYS = ["data.seq_len=16", "data.num_samples=64", "optim.lr=0.01", "optim.weight_decay=0.1", "optim.eps=1e-4",
            "optim.warmup_steps=1", "optim.schedule=linear", f"train.steps={STEPS}", "train.untimed_steps=0",
            f"train.seed={SEED}", "strategy.num_microbatches=2", "strategy.microbatch_size=2",
            "train.save_model=true", "model.dropout=0.0", "optim.master_dtype=bf16",
            "optim.host_loops=false"]  # the rounding in torch's kernels: the C++ loop's build is the slow step's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("bf16") / "llama", layers=2)


def bf16_cfg(checkpoint: Path, *overrides: str):
    return resolve(compose_config([f"model.pretrained={checkpoint}", *RUN_KEYS, *overrides]), ())


# ------------------------------------------------------------------ the rounding


def test_an_update_rounds_away_from_zero_with_the_probability_of_the_dropped_fraction():
    """Between two neighbouring bf16 values, a quarter of the way up: about a quarter of the
    elements round up, whatever the sign; the draws are fixed by the key, so the count is too."""
    below = torch.tensor(1.0 + 2 ** -7)  # a bf16 value; the next one up is 2**-7 further
    for sign in (1.0, -1.0):
        x = torch.full((1 << 16,), sign * (float(below) + 2 ** -9))
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        round_to_bf16(x, out, rounding_key(0, "w", 0))
        up = (out.float().abs() > float(below)).float().mean()
        assert set(out.float().abs().unique().tolist()) == {float(below), float(below) + 2 ** -7}
        assert abs(float(up) - 0.25) < 4 * (0.25 * 0.75 / x.numel()) ** 0.5


def test_a_value_bf16_holds_is_kept_and_every_draw_is_16_bits():
    x = torch.randn(3 * CHUNK + 5).bfloat16().float()  # more than a chunk, and a ragged end
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    round_to_bf16(x, out, rounding_key(1, "w", 3))
    assert torch.equal(out.float(), x)
    d = draws(rounding_key(1, "w", 3), 1 << 16)
    assert int(d.min()) >= 0 and int(d.max()) < 1 << 16 and d.unique().numel() > 0.6 * d.numel()


def test_the_draws_are_the_hash_of_unsigned_32_bit_arithmetic():
    """torch's int32 multiply wraps modulo 2**32: the draws equal the hash computed on Python's
    integers, so they are the same on every device and torch build."""
    key, start, n = rounding_key(7, "block.weight", 2), 5 * CHUNK - 3, 6

    def lowbias32(i: int) -> int:
        m = (1 << 32) - 1
        h = (i * 0x9E3779B1 + key) & m
        h = ((h ^ (h >> 16)) * 0x7FEB352D) & m
        h = ((h ^ (h >> 15)) * 0x846CA68B) & m
        return (h ^ (h >> 16)) & 0xFFFF

    assert draws(key, n, start).tolist() == [lowbias32(i) for i in range(start, start + n)]


def test_each_parameter_and_update_draws_its_own():
    keys = {rounding_key(0, name, update) for name in ("a", "b") for update in range(3)}
    keys.add(rounding_key(1, "a", 0))
    assert len(keys) == 7


@with_marks(needs_extra("torchao", "lowbit"))
def test_the_rule_is_torchaos_stochastic_rounding_on_the_same_draws(monkeypatch):
    from torchao.optim import quant_utils

    x = torch.randn(10_000) * 3
    key = rounding_key(0, "w", 0)
    monkeypatch.setattr(quant_utils.torch, "randint", lambda *args, **kwargs: draws(key, x.numel()))
    theirs = quant_utils._fp32_to_bf16_sr(x)
    ours = torch.empty(x.shape, dtype=torch.bfloat16)
    round_to_bf16(x, ours, key)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


# ------------------------------------------------------------------ runs


class RoundedAdamW(torch.optim.AdamW):
    """A plain loop's bf16 masters: torch's AdamW in fp32, each weight rounded back as the run does."""

    def __init__(self, model: torch.nn.Module, o, seed: int):
        self.names = {p: n for n, p in model.named_parameters()}
        groups = [{"params": [p for p, n in self.names.items() if not exempt_from_decay(n)]},
                  {"params": [p for p, n in self.names.items() if exempt_from_decay(n)], "weight_decay": 0.0}]
        super().__init__(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.seed, self.updates = seed, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for p, name in self.names.items():
            rounded = torch.empty(p.shape, dtype=torch.bfloat16)
            round_to_bf16(p.detach(), rounded, rounding_key(self.seed, name, self.updates))
            p.copy_(rounded)
        self.updates += 1


def plain_loop(checkpoint: Path, cfg) -> torch.nn.Module:
    """The run's training as a plain loop: the checkpoint's weights rounded to bf16 (as the run
    keeps its masters), fp32 compute, torch's AdamW, the run's rounding (2BW: its delayed rule)."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.bfloat16())
    reference_loop(reference, RoundedAdamW(reference, cfg.optim, SEED), cfg, delay=update_delay(cfg))
    return reference


@pytest.mark.parametrize("keys", [
    pytest.param(["strategy=l2l"], id="l2l"),
    pytest.param(["strategy=l2l_stash_cpu"], id="l2l_stash_cpu"),
    # each part rounded on its owner, the masters sent to the other replica in bf16
    pytest.param(["strategy=l2l", "strategy.replicas=2", "strategy.microbatch_size=1"], id="l2l-replicas-sharded",
                 marks=pytest.mark.slow),
    # each stage's masters in its own eager param server, uploaded into its device buffers
    pytest.param(["strategy=pipe_flush", "strategy.offload=host"], id="pipe_flush-offload"),
    pytest.param(["strategy=pipe_2bw", "strategy.offload=host"], id="pipe_2bw-offload", marks=pytest.mark.slow),
])
def test_a_run_equals_a_plain_loop_that_rounds_alike(checkpoint, tmp_path, keys):
    strategy = " ".join(keys)
    cfg = bf16_cfg(checkpoint, *keys)
    results = run(cfg, tmp_path / "run", quiet=True)
    if "strategy=l2l" in keys:
        assert results["strategy_report"]["summary"]["EPS updates"] == "eager; bf16 masters, rounded stochastically"
    saved = hf_saved(tmp_path / "run")
    assert all(torch.equal(p, p.bfloat16().float()) for p in saved.parameters())  # bf16 values, saved
    assert_within_a_rounding(saved, plain_loop(checkpoint, cfg), f"{strategy} master_dtype=bf16")


def test_the_updates_are_stochastic_not_nearest(checkpoint, tmp_path):
    """Rounding each update to nearest ends elsewhere: the keyed draws are what the run applied."""
    cfg = bf16_cfg(checkpoint, "strategy=l2l")
    run(cfg, tmp_path / "run", quiet=True)
    nearest = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.AdamW(nearest.parameters(), lr=cfg.optim.lr, eps=cfg.optim.eps)
    reference_loop(nearest, optimizer, cfg)
    saved = dict(hf_saved(tmp_path / "run").named_parameters())
    assert any(not torch.equal(p.bfloat16().float(), saved[n]) for n, p in nearest.named_parameters())


@pytest.mark.parametrize("keys", [["strategy=l2l", "precision=cmp_bf16"],
                                  pytest.param(["strategy=pipe_flush", "strategy.offload=host"], marks=pytest.mark.slow)],
                         ids=["l2l", "pipe_flush-offload"])
def test_a_run_resumed_from_step_one_draws_what_the_whole_run_drew(checkpoint, tmp_path, keys):
    assert_resumes_exactly(partial(bf16_cfg, checkpoint), keys, tmp_path)


@pytest.mark.slow
def test_relaytrains_host_loop_rounds_to_the_same_bits(checkpoint, tmp_path):
    """optim.host_loops: the C++ loop draws and rounds as torch's kernels do, bit for bit."""
    from relaytrain.step.host_loops import host_loops

    assert host_loops() is not None
    for n in (5, 3 * CHUNK + 7):
        x = torch.randn(n) * 3
        ours, loop = (torch.empty(n, dtype=torch.bfloat16) for _ in range(2))
        round_to_bf16(x, ours, rounding_key(2, "w", 1))
        round_to_bf16(x, loop, rounding_key(2, "w", 1), loops=True)
        assert torch.equal(ours.view(torch.int16), loop.view(torch.int16))
    for loops in ("true", "false"):
        run(bf16_cfg(checkpoint, "strategy=l2l", f"optim.host_loops={loops}"), tmp_path / loops, quiet=True)
    theirs = dict(hf_saved(tmp_path / "false").named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in hf_saved(tmp_path / "true").named_parameters())


def test_the_host_keeps_two_bytes_a_master_and_under_cmp_bf16_no_second_copy(checkpoint):
    """The masters are bf16 and are the wires; the update's fp32 copies are lent for its time only."""
    cfg = bf16_cfg(checkpoint, "strategy=l2l", "precision=cmp_bf16")
    strategy = build_strategy(build_model(cfg.model, seed=cfg.train.seed), cfg)
    try:
        strategy.step(minibatches(cfg)[0], cfg.optim.lr)
        strategy.drain()
        parts = [part for part in strategy.eps.parts if part.owned]
        for part in parts:
            assert part.buffer.dtype == torch.bfloat16
            assert all(p.dtype == torch.bfloat16 for p in part.owned)
            assert all(w.data_ptr() == p.data_ptr() for w, p in zip(part.wires, part.masters, strict=True))
            assert all(s.untyped_storage().nbytes() <= 4 and s.grad is None for s in part.stepped)
    finally:
        strategy.close()


def test_the_planner_counts_two_bytes_a_master_no_copy_that_travels_and_the_rounding():
    """Under cmp_bf16, 8-bit moments and bf16 masters hold under half of fp32's host bytes, and
    the host update is timed with the rounding's measured cost."""
    n = 10**9
    fp32, low = (compose_config(["strategy=l2l", "precision=cmp_bf16", *keys])
                 for keys in ([], ["optim.state_bits=8", "optim.master_dtype=bf16"]))
    host = {name: eps_state_bytes(c, n, workers=1) + wire_bytes(c, n) for name, c in (("fp32", fp32), ("low", low))}
    assert host["fp32"] == 18 * n  # master 4, gradient 4, moments 8, the bf16 copy that travels 2
    assert host["low"] == pytest.approx(n * (2 + 4 + 4 * state_words(8)))  # master 2, gradient 4, moments
    assert host["low"] / host["fp32"] <= 0.5
    spec = load_spec("h200_141gb")
    bf16 = compose_config(["strategy=l2l", "optim.master_dtype=bf16"])
    fp32_s, bf16_s = (from_spec(spec, c, [1]).host_optimizer_s_per_param for c in (fp32, bf16))
    assert bf16_s == pytest.approx(fp32_s * (1 + ROUNDING_VS_FP32_ADAMW[True]))


@pytest.mark.parametrize(("strategy", "says"), [
    ("baseline", "optim.master_dtype=bf16 under strategy=baseline: bf16 masters are the eager param server's"),
    ("fsdp", "optim.master_dtype=bf16 under strategy=fsdp"),
    ("pipe_flush", "optim.master_dtype=bf16 keeps a stage's masters on the host, in its eager param server: add "
                   "strategy.offload=host"),
])
def test_elsewhere_bf16_masters_are_refused_in_one_line(strategy, says):
    with pytest.raises(ConfigError, match=says) as err:
        validate(compose_config(["+exp=tiny_baseline", f"strategy={strategy}", "optim.master_dtype=bf16"]))
    assert "\n" not in str(err.value)
