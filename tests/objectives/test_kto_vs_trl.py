"""`objective=kto` equals TRL's KTOTrainer: the same checkpoint, unpaired examples in file order and
optimizer give the same loss and figures each step and the same trained weights, under each
strategy.

TRL computes the reference live (a second model) and each micro-batch's KL estimate from a second
forward of the mismatched sequences; relaytrain computes the reference's log-probs once before
training and carries each example's KL row beside it in the micro-batch: equal values all the same.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.models.pretrained import resolve
from relaytrain.objectives.kto import FIGURES
from relaytrain.records.runlog import read_metrics
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder, tiny_moe
from tests.objectives.trl_runs import OPTIMIZERS, strategy_matrix, trl_kto, write_pairs

MICROBATCH, ACCUMULATE, STEPS, SEQ = 2, 2, 3, 40
LR = {"sgd": 0.5, "adamw": 1e-2}


def examples(count: int = MICROBATCH * ACCUMULATE * STEPS) -> list[dict]:
    """Unpaired examples of uneven lengths (padding and truncation both happen), two desirable in
    three: some micro-batches hold both kinds, one only desirable ones (no rewards/rejected there)."""
    out = []
    for i in range(count):
        question = f"What is {i} plus {i}?" + " Think." * (i % 3)
        answer = f" It is {2 * i}." + " Sure." * (i % 2) if i % 3 != 1 else f" Maybe {i + 1}, or {i}" + " hmm" * (i % 4)
        out.append({"prompt": question, "completion": answer, "label": i % 3 != 1})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    return {"llama": tiny_decoder(root / "llama", layers=2), "qwen3_moe": tiny_moe(root / "qwen3_moe", layers=2)}


@pytest.fixture
def checkpoint(checkpoints):
    return checkpoints["llama"]


def kto_config(checkpoint, data, *overrides: str):
    """objective=kto on `data` (micro-batches of MICROBATCH examples, in file order as its config has them)."""
    return resolve(compose_config([f"model.pretrained={checkpoint}", "data=preference", f"data.path={data}",
                                   f"data.seq_len={SEQ}", "objective=kto", f"strategy.microbatch_size={MICROBATCH}",
                                   *overrides]), ())


def relaytrain_kto(checkpoint, data, run_dir, cache, optim: str, *overrides: str) -> dict:
    cfg = kto_config(checkpoint, data, f"data.cache_dir={cache}", f"strategy.num_microbatches={ACCUMULATE}",
                     f"train.steps={STEPS}", "train.untimed_steps=0", "train.save_model=true", f"optim.lr={LR[optim]}",
                     "optim.weight_decay=0.0", *OPTIMIZERS[optim][1], *overrides)
    return run(cfg, run_dir, quiet=True)


def assert_equal_to_trl(results: dict, reference, run_dir, atol: float = 2e-5) -> None:
    """The loss, every figure of every step (metrics.csv's row; absent where TRL's is: a step without
    an undesirable example has no rewards/rejected) and the trained weights."""
    assert results["loss"] == pytest.approx(reference.losses, abs=atol)
    rows = read_metrics(run_dir)
    assert len(rows) == len(reference.figures) == STEPS
    for step, (row, figures) in enumerate(zip(rows, reference.figures, strict=True)):
        for name in FIGURES:
            ours, theirs = row[name], figures.get(name)
            assert (ours is None) == (theirs is None), (step, name, ours, theirs)
            assert ours is None or math.isclose(ours, theirs, abs_tol=1e-4, rel_tol=1e-5), (step, name, ours, theirs)
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    for name, tensor in reference.weights.items():
        torch.testing.assert_close(trained[name], tensor, atol=atol, rtol=1e-4, msg=name)


# Two replicas of one micro-batch each: TRL's two accumulated micro-batches, each its own KL estimate.
FSDP = ["strategy=fsdp", "strategy.replicas=2", "strategy.num_microbatches=1"]
CASES = [  # (KTO keys, strategy overrides, optimizer, model): every strategy on both models, then weighted
    *strategy_matrix(FSDP, {}),
    pytest.param({"desirable_weight": 1.33, "undesirable_weight": 0.7, "beta": 0.2}, ["strategy=l2l"], "adamw", "llama",
                 id="weighted-l2l-llama-adamw", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("keys", "strategy", "optim", "model"), CASES)
def test_kto_equals_trl(checkpoints, tmp_path, keys, strategy, optim, model):
    """On a mixture too: the router's balancing term counts the examples' tokens, not the KL rows'
    (TRL runs those apart, without gradient)."""
    records = examples()
    data = write_pairs(tmp_path / "examples.jsonl", records)
    reference = trl_kto(checkpoints[model], records, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR[optim], optim=optim, max_length=SEQ, **keys)
    results = relaytrain_kto(checkpoints[model], data, tmp_path / "run", tmp_path / "cache", optim, *strategy,
                             *(f"objective.{key}={value}" for key, value in keys.items()))
    assert_equal_to_trl(results, reference, tmp_path / "run")


@pytest.mark.slow
def test_pairs_train_kto_as_trl_unpairs_them(checkpoint, tmp_path):
    """A file of pairs: TRL's KTOTrainer unpairs them (every chosen completion, then every rejected
    one), and so does data=preference for objective=kto."""
    pairs = [{"prompt": f"Name {i}:", "chosen": f" number {i}." + " Yes." * (i % 2), "rejected": f" not {i + 3}"}
             for i in range(MICROBATCH * ACCUMULATE * STEPS // 2)]
    data = write_pairs(tmp_path / "pairs.jsonl", pairs)
    reference = trl_kto(checkpoint, pairs, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR["sgd"], optim="sgd", max_length=SEQ)
    results = relaytrain_kto(checkpoint, data, tmp_path / "run", tmp_path / "cache", "sgd")
    assert_equal_to_trl(results, reference, tmp_path / "run")


REFUSED = {  # an override, and what its one line says
    "objective.loss_type=apo_zero_unpaired": "one of TRL's that relaytrain does not offer",
    "objective.loss_type=sigmoid": "is not a KTO loss",
    "objective.beta=0": "must be positive",
    "objective.undesirable_weight=-1": "objective.undesirable_weight=-1.0 must be at least 0",
    "data.shuffle=true": "set data.shuffle=false",
    "strategy.microbatch_size=1": "needs at least 2",
    "data.eval_fraction=0.25": "give them as data.eval_path",
    "strategy.sequence_parallel=2": "compares whole ones",
}


@pytest.mark.parametrize(("override", "says"), REFUSED.items())
def test_bad_kto_settings_are_one_line_each(checkpoint, tmp_path, override, says):
    with pytest.raises(ConfigError, match=says) as refused:
        validate(kto_config(checkpoint, write_pairs(tmp_path / "examples.jsonl", examples(4)), override))
    assert "\n" not in str(refused.value)


def test_held_out_examples_count_their_loss_and_which_side_of_the_kl_estimate_they_lie():
    """Evaluation sums the training loss over real examples (a filling item counts nowhere) and
    counts an example right where its log-ratio is on its label's side of the KL estimate."""
    from relaytrain.models.layered import MicroBatch
    from relaytrain.objectives.kto import KTO, Examples

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 6, 11, generator=generator)
    labels = torch.randint(0, 11, (8, 6), generator=generator)
    labels[:, :2] = -100  # the prompts
    labels[6:] = -100  # the last item fills the micro-batch up: no example
    mb = MicroBatch(input_ids=torch.zeros(8, 6, dtype=torch.long), labels=labels, attention_mask=None,
                    ref_logps=torch.randn(8, generator=generator) - 20, desirable=torch.tensor([1, 1, 0, 0, 1, 1, 0, 0]))
    kto = KTO(beta=0.3, desirable_weight=1.5, undesirable_weight=0.5)
    e = Examples.of(logits, mb)
    ratio, kl = e.logps - e.ref, e.kl()
    assert int(e.real.sum()) == 3 and kl == ((e.kl_logps - e.kl_ref)[:3].mean()).clamp(min=0)
    expected = (1.5 * (1 - torch.sigmoid(0.3 * (ratio[[0, 2]] - kl))).sum()
                + 0.5 * (1 - torch.sigmoid(0.3 * (kl - ratio[1]))))
    right = int(ratio[0] > kl) + int(ratio[1] < kl) + int(ratio[2] > kl)
    loss, items, correct = kto.eval_stats(logits, mb).sums[:3].tolist()
    assert loss == pytest.approx(float(expected), rel=1e-6) == pytest.approx(float(kto.loss(logits, mb).total))
    assert (items, correct) == (3, right)
