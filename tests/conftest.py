"""Shared test helpers: configs composed exactly as the CLI composes them, and tiny models."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from relaytrain.config import compose_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

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


def tiny_cfg(family: str = "bert", *overrides: str):
    base = TINY_BERT if family == "bert" else TINY_GPT2
    return compose_config([*base, "train.steps=3", "train.warmup_steps=1", *overrides])


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until a running training process has written `path` (e.g. a checkpoint)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)
