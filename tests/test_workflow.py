"""The README's walk-through, as a user runs it: pretrain a small BERT with masked LM on a text
file, fine-tune it for classification from the first run's model/ under l2l, evaluate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def relaytrain(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "CI": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_pretrain_then_fine_tune_then_evaluate_well_above_chance(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_example_text.py"), "data"], cwd=tmp_path, check=True)
    relaytrain("train", "model.task=masked_lm", "data=jsonl", "data.path=data/corpus.jsonl", "data.seq_len=32",
               "model.vocab_size=512", "train.steps=100", "train.save_model=true", "hydra.run.dir=runs/pretrain",
               cwd=tmp_path)
    out = relaytrain("train", "strategy=l2l", "model.pretrained=runs/pretrain/model", "model.task=classification",
                     "data=jsonl", "data.path=data/train.jsonl", "data.eval_path=data/dev.jsonl", "data.seq_len=32",
                     "eval.every=25", "train.steps=100", "train.save_model=true", "hydra.run.dir=runs/finetune",
                     cwd=tmp_path)
    assert "freshly initialised: bert.pooler.dense.bias, bert.pooler.dense.weight, classifier.bias" in out
    results = json.loads((tmp_path / "runs" / "finetune" / "results.json").read_text())
    assert results["model"]["pretrained"] == "runs/pretrain/model"
    assert [e["step"] for e in results["eval"]] == [25, 50, 75, 100]
    assert results["eval"][-1]["items"] == 201
    assert results["eval"][-1]["accuracy"] > 0.9  # chance is 0.5
