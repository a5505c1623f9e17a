"""The host AdamW's two kernels (`optim.host_kernel`): DeepSpeed's cpu_adam op steps to torch's
fused AdamW's numbers up to fp32 rounding, keeps torch's state format (a checkpoint resumes
under either), and a missing or failing op falls back to torch's with one line, once."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from relaytrain.records.optimizer_state import load_optimizer_state, optimizer_state
from relaytrain.step import optim
from relaytrain.step.flat import flatten
from relaytrain.step.optim import AdamWConfig, DeepSpeedAdamW, FlatAdamW, build_optimizer
from tests.strategies.test_l2l import assert_same_weights, l2l_cfg, train

NAMES = ["w", "b", "table"]


_LOADED: dict = {}  # this process's one real attempt to load the op, kept for every test that needs it


@pytest.fixture
def deepspeed_op(monkeypatch):
    """DeepSpeed's cpu_adam op, or the test is skipped with the reason."""
    if not _LOADED:
        monkeypatch.setattr(optim, "_DEEPSPEED", {})
        optim._loaded_cpu_adam("auto")  # loads it, quietly where DeepSpeed is absent, timing nothing
        _LOADED.update(optim._DEEPSPEED)
    monkeypatch.setattr(optim, "_DEEPSPEED", dict(_LOADED))
    if "op" not in _LOADED:
        failure = _LOADED.get("failure")
        pytest.skip(f"DeepSpeed's cpu_adam op is not available here ({type(failure).__name__}: {failure}); "
                    f"pip install relaytrain[fast]")


@pytest.fixture
def fresh_loader(monkeypatch):
    """A process that has not tried to load the op yet (the attempt is cached per process)."""
    monkeypatch.setattr(optim, "_DEEPSPEED", {})


def cfg(kernel: str, **overrides):
    return OmegaConf.merge(OmegaConf.structured(AdamWConfig(lr=1e-2, weight_decay=0.1, host_kernel=kernel)), overrides)


def flat_params(seed=0) -> list[nn.Parameter]:
    """A decayed matrix, an undecayed bias and a table, in one flat buffer as the EPS keeps them."""
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(48, 24)), nn.Parameter(torch.randn(24)), nn.Parameter(torch.randn(40, 24))]
    flatten(params)
    return params


def step(optimizer, params, steps: range) -> None:
    for k in steps:
        g = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.update()
        optimizer.drop_grads()


def assert_close_to_fp32(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for name, x, y in zip(NAMES, a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # the op: CI's slow step installs the `fast` extra (make test-slow)
def test_deepspeed_kernel_steps_as_torch_fused_adamw(deepspeed_op):
    ours, theirs = flat_params(), flat_params()
    ds = build_optimizer(zip(NAMES, ours, strict=True), cfg("deepspeed"), flat=True)
    fused = build_optimizer(zip(NAMES, theirs, strict=True), cfg("torch"), flat=True)
    assert (type(ds), ds.kernel, type(fused), fused.kernel) == (
        DeepSpeedAdamW, "deepspeed cpu_adam", FlatAdamW, "torch fused")
    step(ds, ours, range(5))
    step(fused, theirs, range(5))
    assert_close_to_fp32(ours, theirs)
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close_to_fp32([ds.state[p][key] for p in ours], [fused.state[p][key] for p in theirs])
    for p, q in zip(ours, theirs, strict=True):  # torch's own format: a float32 step tensor
        assert ds.state[p]["step"].dtype == fused.state[q]["step"].dtype and float(ds.state[p]["step"]) == 5.0


@pytest.mark.slow  # the op: CI's slow step installs the `fast` extra (make test-slow)
@pytest.mark.parametrize("first,then", [("deepspeed", "torch"), ("torch", "deepspeed")])
def test_a_checkpoint_of_one_kernel_resumes_under_the_other(deepspeed_op, first, then):
    resumed, reference = flat_params(), flat_params()
    before = build_optimizer(zip(NAMES, resumed, strict=True), cfg(first), flat=True)
    step(before, resumed, range(2))
    names = dict(zip(map(id, resumed), NAMES, strict=True))
    saved = optimizer_state([before], lambda p: names[id(p)])
    after = build_optimizer(zip(NAMES, resumed, strict=True), cfg(then), flat=True)
    load_optimizer_state([after], lambda p: names[id(p)], saved)
    for name, p in zip(NAMES, resumed, strict=True):  # loaded exactly, in the buffers of the other kernel
        for key, value in saved[name].items():
            assert torch.equal(after.state[p][key], value), (name, key)
    step(after, resumed, range(2, 4))
    whole = build_optimizer(zip(NAMES, reference, strict=True), cfg(then), flat=True)
    step(whole, reference, range(4))
    assert_close_to_fp32(resumed, reference)


@pytest.mark.slow  # the op: CI's slow step installs the `fast` extra (make test-slow)
def test_l2l_ends_at_the_same_weights_under_either_kernel(deepspeed_op):
    """GPT-2 ties its embedding and head: the early table update steps a one-off optimizer of
    the part's own kind, so the held rows run the same kernel as the rest."""
    runs = {}
    for kernel in ("torch", "deepspeed"):
        model, _, report = train(l2l_cfg("gpt2", "l2l", "optim.weight_decay=0.1", f"optim.host_kernel={kernel}"))
        runs[kernel] = (model, report["eps"]["host_kernel"])
    assert runs["torch"][1] == "torch fused" and runs["deepspeed"][1] == "deepspeed cpu_adam"
    assert_same_weights(runs["torch"][0], runs["deepspeed"][0], rtol=1e-5, atol=1e-6)


def test_a_failing_op_falls_back_to_torch_saying_so_once(fresh_loader, monkeypatch, capsys):
    def broken():
        raise RuntimeError("Unable to JIT load the cpu_adam op due to ninja not being installed.\nmore")

    monkeypatch.setattr(optim, "_load_cpu_adam", broken)
    optimizers = [build_optimizer(zip(NAMES, flat_params(), strict=True), cfg(kernel), flat=True)
                  for kernel in ("deepspeed", "auto", "deepspeed")]
    assert [o.kernel for o in optimizers] == ["torch fused"] * 3
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["relaytrain: optim.host_kernel=deepspeed: DeepSpeed's cpu_adam op is unavailable (RuntimeError: "
                     "Unable to JIT load the cpu_adam op due to ninja not being installed.); the host optimizer runs "
                     "torch's AdamW (pip install relaytrain[fast] installs DeepSpeed)"]


@pytest.mark.parametrize("kernel,said", [("auto", False), ("deepspeed", True)])
def test_deepspeed_not_installed_is_said_only_when_asked_for(fresh_loader, monkeypatch, capsys, kernel, said):
    def absent():
        raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")

    monkeypatch.setattr(optim, "_load_cpu_adam", absent)
    optimizer = build_optimizer(zip(NAMES, flat_params(), strict=True), cfg(kernel), flat=True)
    assert type(optimizer) is FlatAdamW
    assert bool(capsys.readouterr().err) == said


def test_torch_kernel_dry_runs_and_device_optimizers_never_load_the_op(fresh_loader, monkeypatch):
    def unexpected():
        raise AssertionError("the op was loaded")

    monkeypatch.setattr(optim, "_load_cpu_adam", unexpected)
    assert type(build_optimizer(zip(NAMES, flat_params(), strict=True), cfg("torch"), flat=True)) is FlatAdamW
    meta = [nn.Parameter(torch.empty(4, 4, device="meta"))]
    assert type(build_optimizer([("w", meta[0])], cfg("deepspeed"), flat=True)) is FlatAdamW
    assert type(build_optimizer(zip(NAMES, flat_params(), strict=True), cfg("deepspeed"))) is torch.optim.AdamW


@pytest.mark.slow  # the op: CI's slow step installs the `fast` extra (make test-slow)
def test_a_group_the_op_cannot_step_in_place_takes_torchs_update(deepspeed_op):
    """The op writes raw fp32 memory: a non-contiguous parameter would be stepped in a copy."""
    base = torch.randn(24, 48)
    ours, theirs = nn.Parameter(base.clone().t()), nn.Parameter(base.clone().t())
    assert not ours.is_contiguous()
    ds = DeepSpeedAdamW([{"params": [ours], "weight_decay": 0.1}], lr=1e-2, fused=True)
    fused = FlatAdamW([{"params": [theirs], "weight_decay": 0.1}], lr=1e-2, fused=True)
    step(ds, [ours], range(3))
    step(fused, [theirs], range(3))
    assert torch.equal(ours, theirs) and not torch.equal(ours, base.t())


@pytest.mark.slow  # the op: CI's slow step installs the `fast` extra (make test-slow)
@pytest.mark.parametrize("faster", ["deepspeed", "torch"])
def test_auto_takes_the_kernel_that_stepped_faster_here_and_says_so_once(deepspeed_op, monkeypatch, capsys, faster):
    """`optim.host_kernel=auto` times both kernels once a process (the timing is replaced here: a
    test's outcome must not hang on the machine's speed) and takes the faster."""
    seconds = {"deepspeed": 0.002, "torch": 0.003} if faster == "deepspeed" else {"deepspeed": 0.004, "torch": 0.003}
    monkeypatch.setattr(optim, "kernel_step_seconds", lambda: dict(seconds))
    kinds = [type(build_optimizer(zip(NAMES, flat_params(), strict=True), cfg("auto"), flat=True)) for _ in range(2)]
    assert kinds == [DeepSpeedAdamW if faster == "deepspeed" else FlatAdamW] * 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"the host optimizer runs {'DeepSpeed' if faster == 'deepspeed' else 'torch'}'s")
