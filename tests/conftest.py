"""Shared test helpers: configs composed exactly as the CLI composes them, and tiny models."""

from __future__ import annotations

import atexit
import contextlib
import copy
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from relaytrain.data import build_dataset, build_loader
from relaytrain.data import cache as _cache
from relaytrain.models import build_model
from relaytrain.run.compose import compose_config
from relaytrain.step.optim import build_optimizer, lr_at, set_lr
from relaytrain.strategies.base import minibatch_divisor, replica_rows

# The tokenize cache of every run the tests start (and of the processes those start, and of
# pytest-xdist's workers, which inherit this process's environment) in a scratch folder of this
# session, not the user's ~/.cache/relaytrain/data; removed by the process that made it.
if not os.environ.get(_cache.ENV_DIR):
    os.environ[_cache.ENV_DIR] = tempfile.mkdtemp(prefix="relaytrain-test-data-cache-")
    atexit.register(shutil.rmtree, os.environ[_cache.ENV_DIR], True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _threads_per_test_worker() -> int:
    """The cores shared out among pytest-xdist's workers. Each worker (and every process it
    starts, through OMP_NUM_THREADS, which torch and world.threads_per_process follow) computes on its share: two
    workers of two threads each on two cores make every OpenMP region wait for a descheduled
    thread, and a step of a tiny model then takes 30 times as long."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


THREADS = _threads_per_test_worker()
os.environ["OMP_NUM_THREADS"] = str(THREADS)

TINY_BERT = [
    "model=bert_tiny", "model.num_layers=3", "model.hidden_size=32", "model.num_heads=4",
    "model.intermediate_size=64", "model.vocab_size=300", "model.dropout=0.0", "data.seq_len=16",
    "data.num_samples=256",
]
TINY_GPT2 = [
    "model=gpt2_tiny", "model.num_layers=3", "model.hidden_size=32", "model.num_heads=4",
    "model.intermediate_size=64", "model.vocab_size=300", "model.dropout=0.0", "data.seq_len=16",
    "data.num_samples=256",
]

# A Llama-layout decoder as small as the others: grouped-query attention (2 key/value heads for
# 4 query heads), gated MLP, rotary positions, untied head.
TINY_LLAMA = [
    "model=llama_tiny", "model.num_layers=3", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=64", "model.vocab_size=300", "model.max_seq_len=64", "data.seq_len=16",
    "data.num_samples=256",
]


TINY = {"bert": TINY_BERT, "gpt2": TINY_GPT2, "llama": TINY_LLAMA}


def needs_extra(module: str, extra: str) -> list:
    """The marks of a test that needs an optional extra's `module`: skipped where the extra is not
    installed, as in the default suite's environment, and marked `extras`, which the slow step
    (the one that installs the extras) runs with its slow tests: `make test-slow`. As a module's
    `pytestmark`, or each mark applied in turn (`with_marks`)."""
    missing = importlib.util.find_spec(module) is None
    return [pytest.mark.extras, pytest.mark.skipif(missing, reason=f"{module} is the {extra} extra: make test-slow "
                                                                   f"installs it and runs this")]


def with_marks(marks: list):
    """`marks` as one decorator."""
    def marked(test):
        for mark in marks:
            test = mark(test)
        return test
    return marked


def tiny_cfg(family: str = "bert", *overrides: str):
    """A tiny model of `family` (bert, gpt2 or llama), three steps; an unknown family fails loudly
    rather than quietly building another."""
    if family not in TINY:
        raise ValueError(f"tiny_cfg knows {', '.join(TINY)}, not {family!r}")
    return compose_config([*TINY[family], "train.steps=3", "train.untimed_steps=1", *overrides])


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(THREADS)
    yield


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until a running training process has written `path` (e.g. a checkpoint)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def train_plain_loop(cfg, steps: int, delay: int = 0, replicas: int = 1, device: str = "cpu", prepare=None,
                     autocast: torch.dtype | None = None):
    """The reference the strategies must equal: the whole layered model under autograd, each
    micro-batch's loss over the minibatch's items, one optimizer, the configured LR schedule
    and clipping. Returns the trained layered model.

    `replicas`: each micro-batch's rows are taken as that many replicas take them (their own
    dropout masks, `replica_rows`), one after another in this one process: with dropout on,
    the exact reference for a strategy with as many replicas.

    `delay=1` is PipeDream-2BW's rule instead: W(b+1) = W(b) - lr * grad f_b(W(max(b-1, 0))),
    each minibatch's gradients taken at the weights one update older.

    `device`: where the loop runs. Dropout masks are drawn by that device's generator (CUDA's
    Philox, the CPU's mt19937): a run on a GPU with dropout equals the loop on a GPU.

    `prepare`: called on the built model before training (a reference's own module swap);
    `autocast`: each micro-batch's forward under torch.autocast in that dtype."""
    model = build_model(cfg.model, seed=cfg.train.seed).to(device)
    if prepare is not None:
        prepare(model)
    computing = (lambda: torch.autocast(device_type=torch.device(device).type, dtype=autocast)) if autocast else (
        contextlib.nullcontext)
    stale = copy.deepcopy(model) if delay else model  # holds the version the gradients are taken at
    versions = [copy.deepcopy(model.state_dict())] * delay  # W(b - delay) .. W(b - 1); W(0) at first
    optimizer = build_optimizer(model.named_parameters(), cfg.optim)
    loader = build_loader(cfg, build_dataset(cfg))
    for step in range(steps):
        minibatch = [mb.to(device) for mb in next(loader)]
        if delay:
            stale.load_state_dict(versions.pop(0))
            versions.append(copy.deepcopy(model.state_dict()))
        divisor = minibatch_divisor(stale, minibatch, replicas)
        for replica in range(replicas):
            for mb in replica_rows(minibatch, replica, replicas):
                with computing():
                    loss = stale(mb, divisor)
                loss.backward()
        if delay:
            for p, q in zip(model.parameters(), stale.parameters(), strict=True):
                p.grad, q.grad = q.grad, None
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        set_lr(optimizer, lr_at(step, cfg.optim, steps))
        optimizer.step()
        optimizer.zero_grad()
    return model
