"""Evaluation sums and metrics: exact whatever the split, the GLUE tasks' own metrics."""

import math

import pytest
import torch

from relaytrain.objectives import objective
from relaytrain.step.evaluation import EvalStats, f1_positive, matthews_correlation, metric_names


def test_sums_over_any_split_equal_the_whole():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(10, 3, generator=g), torch.randint(0, 3, (10,), generator=g)
    targets[4] = -100  # a padding row counts nowhere
    whole = EvalStats.of(logits, targets, num_labels=3)
    parts = EvalStats.of(logits[:3], targets[:3], 3) + EvalStats.of(logits[3:], targets[3:], 3)
    torch.testing.assert_close(whole.sums, parts.sums)
    figures = whole.metrics(objective("classification"))
    valid = targets != -100
    assert figures["items"] == 9
    assert figures["accuracy"] == int((logits.argmax(-1) == targets)[valid].sum()) / 9
    expected = torch.nn.functional.cross_entropy(logits[valid], targets[valid]).item()
    assert figures["loss"] == pytest.approx(expected, rel=1e-6)


def test_language_models_report_perplexity_over_predicted_tokens():
    logits, targets = torch.zeros(2, 4, 8), torch.tensor([[1, 2, -100, 3], [4, -100, -100, 5]])
    figures = EvalStats.of(logits, targets).metrics(objective("causal_lm"))
    assert figures["items"] == 5 and figures["loss"] == pytest.approx(math.log(8))
    assert figures["perplexity"] == pytest.approx(8.0)
    assert "accuracy" in EvalStats.of(logits, targets).metrics(objective("masked_lm"))


def test_matthews_correlation_and_f1_by_hand():
    # truth x prediction: TN=5, FP=1, FN=2, TP=4
    confusion = torch.tensor([[5.0, 1.0], [2.0, 4.0]])
    mcc = (4 * 5 - 1 * 2) / math.sqrt((4 + 1) * (4 + 2) * (5 + 1) * (5 + 2))
    assert matthews_correlation(confusion) == pytest.approx(mcc)
    assert f1_positive(confusion) == pytest.approx(2 * 4 / (2 * 4 + 1 + 2))
    assert matthews_correlation(torch.tensor([[3.0, 0.0], [2.0, 0.0]])) == 0.0  # a constant prediction
    perfect = torch.diag(torch.tensor([2.0, 3.0, 4.0]))
    assert matthews_correlation(perfect) == pytest.approx(1.0)


def test_glue_tasks_add_their_own_metric():
    logits, targets = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0]]), torch.tensor([0, 1, 0])
    stats = EvalStats.of(logits, targets, num_labels=2)
    assert "matthews_correlation" in stats.metrics(objective("classification"), "cola")
    assert stats.metrics(objective("classification"), "mrpc")["f1"] == pytest.approx(2 / 3)
    assert metric_names(objective("classification"), "cola") == ["loss", "accuracy", "matthews_correlation"]
    assert metric_names(objective("causal_lm")) == ["loss", "perplexity"]
