"""`objective=dpo` equals TRL's DPOTrainer: the same checkpoint, pairs in file order and optimizer
give the same loss and figures each step and the same trained weights, under each strategy.

TRL runs with its reference computed live (a second model, or the adapter switched off);
relaytrain computes the reference's log-probs once before training (`run/reference.py`) and
holds no second model: equal values all the same.
"""

from __future__ import annotations

import json

import pytest

from relaytrain.models.pretrained import resolve
from relaytrain.objectives.preference import FIGURES
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import tiny_decoder, tiny_moe
from tests.conformance.references import peft_adapter
from tests.objectives.trl_runs import OPTIMIZERS, strategy_matrix, trl_dpo, write_pairs
from tests.objectives.trl_runs import assert_equal_to_trl as equal_to_trl

MICROBATCH, ACCUMULATE, STEPS, SEQ = 2, 2, 3, 40
LR = {"sgd": 0.5, "adamw": 1e-2}


def pairs(count: int = MICROBATCH * ACCUMULATE * STEPS) -> list[dict]:
    """Preference pairs of uneven lengths (padding and truncation both happen)."""
    out = []
    for i in range(count):
        question = f"What is {i} plus {i}?" + " Think." * (i % 3)
        out.append({"prompt": question, "chosen": f" It is {2 * i}." + " Sure." * (i % 2),
                    "rejected": f" Maybe {i + 1}, or {i}" + " hmm" * (i % 4)})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    return {"llama": tiny_decoder(root / "llama", layers=2), "qwen3_moe": tiny_moe(root / "qwen3_moe", layers=2),
            "root": root}


def relaytrain_dpo(checkpoint, data, run_dir, cache, optim: str, *overrides: str) -> dict:
    cfg = compose_config([
        f"model.pretrained={checkpoint}", "data=preference", f"data.path={data}", f"data.seq_len={SEQ}",
        "data.shuffle=false", f"data.cache_dir={cache}", "objective=dpo", f"strategy.microbatch_size={MICROBATCH}",
        f"strategy.num_microbatches={ACCUMULATE}", f"train.steps={STEPS}", "train.untimed_steps=0",
        "train.save_model=true", f"optim.lr={LR[optim]}", "optim.weight_decay=0.0", *OPTIMIZERS[optim][1],
        *overrides])
    return run(resolve(cfg, ()), run_dir, quiet=True)


def assert_equal_to_trl(results: dict, reference, run_dir) -> None:
    """The loss, DPO's figures (TRL's names) each step and the trained weights: `trl_runs`' check."""
    equal_to_trl(results, reference, run_dir, FIGURES)


# Two replicas of one micro-batch each: TRL's two accumulated micro-batches (a mixture's balancing
# term is one micro-batch's, so each replica's holds what TRL's does).
FSDP = ["strategy=fsdp", "strategy.replicas=2", "strategy.num_microbatches=1"]
CASES = [  # (loss type, strategy overrides, optimizer, model): sigmoid and ipo under every strategy, on both models
    *strategy_matrix(FSDP, "sigmoid", name="sigmoid"),
    *strategy_matrix(FSDP, "ipo", name="ipo", default=False),
    pytest.param("hinge", ["strategy=baseline"], "adamw", "qwen3_moe", id="hinge-baseline-moe", marks=pytest.mark.slow),
    pytest.param("robust", ["strategy=l2l"], "sgd", "qwen3_moe", id="robust-l2l-moe", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("loss_type", "strategy", "optim", "model"), CASES)
def test_dpo_equals_trl(checkpoints, tmp_path, loss_type, strategy, optim, model):
    records = pairs()
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    smoothing = 0.1 if loss_type == "robust" else 0.0
    reference = trl_dpo(checkpoints[model], records, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR[optim], optim=optim, max_length=SEQ, loss_type=loss_type,
                        label_smoothing=smoothing, beta=0.2)
    results = relaytrain_dpo(checkpoints[model], data, tmp_path / "run", tmp_path / "cache", optim, *strategy,
                             f"objective.loss_type={loss_type}", f"objective.label_smoothing={smoothing}",
                             "objective.beta=0.2")
    assert_equal_to_trl(results, reference, tmp_path / "run")


@pytest.mark.slow  # over 8 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_rpo_alpha_adds_trls_nll_term(checkpoints, tmp_path):
    records = pairs()
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    reference = trl_dpo(checkpoints["llama"], records, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR["sgd"], optim="sgd", max_length=SEQ, loss_type=["sigmoid", "sft"],
                        loss_weights=[1.0, 0.5])
    results = relaytrain_dpo(checkpoints["llama"], data, tmp_path / "run", tmp_path / "cache", "sgd",
                             "objective.rpo_alpha=0.5")
    assert_equal_to_trl(results, reference, tmp_path / "run")


@pytest.mark.slow
def test_lora_dpo_equals_trl_with_peft(checkpoints, tmp_path):
    """A continued peft adapter (both matrices non-zero, so the base and the adapted model differ):
    TRL's reference is the adapter as it started (its "ref" copy), and so is relaytrain's."""
    adapter = peft_adapter(checkpoints["llama"], tmp_path / "adapter")
    records = pairs()
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    reference = trl_dpo(checkpoints["llama"], records, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR["adamw"], optim="adamw", max_length=SEQ, adapter=adapter)
    results = relaytrain_dpo(checkpoints["llama"], data, tmp_path / "run", tmp_path / "cache", "adamw", "strategy=l2l",
                             "adapter=lora", f"adapter.pretrained={adapter}", "adapter.merge_on_save=true")
    assert_equal_to_trl(results, reference, tmp_path / "run")


def test_a_second_start_reuses_the_reference_cache(checkpoints, tmp_path, capfd):
    data = write_pairs(tmp_path / "pairs.jsonl", pairs())
    first = relaytrain_dpo(checkpoints["llama"], data, tmp_path / "one", tmp_path / "cache", "sgd")
    assert "reference log-probs: computed" in capfd.readouterr().out
    second = relaytrain_dpo(checkpoints["llama"], data, tmp_path / "two", tmp_path / "cache", "sgd")
    assert "reference log-probs: reused" in capfd.readouterr().out
    assert first["loss"] == second["loss"]
    metrics = (tmp_path / "two" / "metrics.csv").read_text().splitlines()
    assert "rewards/margins" in metrics[0].split(",") and len(metrics) == STEPS + 1
    assert json.loads((tmp_path / "two" / "results.json").read_text())["loss_terms"]["rewards/accuracies"]


@pytest.mark.parametrize(("overrides", "says"), [
    (["objective.loss_type=exo_pair"], "one of TRL's DPO losses that relaytrain does not offer"),
    (["objective.loss_type=sigmod"], "is not a DPO loss"),
    (["objective.label_smoothing=0.1"], "set objective.loss_type=robust"),
    (["objective.beta=0"], "must be positive"),
    (["strategy.sequence_parallel=2"], "compares whole ones"),
    (["data=jsonl"], "data=jsonl gives single rows: use data=preference"),
])
def test_bad_dpo_settings_are_one_line_each(checkpoints, tmp_path, overrides, says):
    from relaytrain.run.compose import validate
    from relaytrain.utils.errors import ConfigError

    data = write_pairs(tmp_path / "pairs.jsonl", pairs(4))
    cfg = compose_config([f"model.pretrained={checkpoints['llama']}", "data=preference", f"data.path={data}",
                          f"data.seq_len={SEQ}", "objective=dpo", *overrides])
    with pytest.raises(ConfigError, match=says) as refused:
        validate(resolve(cfg, ()))
    assert "\n" not in str(refused.value)
