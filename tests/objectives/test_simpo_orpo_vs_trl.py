"""`objective=simpo` equals TRL's CPOTrainer with loss_type=simpo and `objective=orpo` its
ORPOTrainer: the same checkpoint, pairs in file order and optimizer give the same loss and every
figure TRL logs each step and the same trained weights, under each strategy; the pairs are
tokenized as those trainers tokenize them, token for token; bad keys are one line each.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from relaytrain.data import build_datasets
from relaytrain.models.pretrained import resolve
from relaytrain.objectives import objective
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder, tiny_moe
from tests.data.test_preference_data import LONG, assistant, user
from tests.objectives.trl_runs import (
    OPTIMIZERS,
    assert_equal_to_trl,
    strategy_matrix,
    trl_cpo,
    trl_orpo,
    write_pairs,
)

MICROBATCH, ACCUMULATE, STEPS, SEQ = 2, 2, 3, 40
LR = {"sgd": 0.5, "adamw": 1e-2}
SIMPO = {"beta": 2.0, "gamma": 0.8, "label_smoothing": 0.1, "cpo_alpha": 0.5}  # none at TRL's default


def pairs(count: int = MICROBATCH * ACCUMULATE * STEPS) -> list[dict]:
    """Preference pairs of uneven lengths (padding and truncation both happen), some prompts
    ending mid-word (their last token merges with the completion's)."""
    out = []
    for i in range(count):
        question = f"What is {i} plus {i}?" + " Think." * (i % 3) + (" The ans" if i % 2 else "")
        out.append({"prompt": question, "chosen": f" It is {2 * i}." + " Sure." * (i % 2),
                    "rejected": f" Maybe {i + 1}, or {i}" + " hmm" * (i % 4)})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_free")
    return {"llama": tiny_decoder(root / "llama", layers=2), "qwen3_moe": tiny_moe(root / "qwen3_moe", layers=2)}


def trl_run(name: str, checkpoint, records, out, optim: str, microbatch: int, accumulate: int, **more):
    common = dict(microbatch=microbatch, accumulate=accumulate, steps=STEPS, lr=LR[optim], optim=optim, max_length=SEQ,
                  **more)
    if name == "simpo":
        keys = {"loss_type": "simpo", "beta": SIMPO["beta"], "simpo_gamma": SIMPO["gamma"],
                "label_smoothing": SIMPO["label_smoothing"], "cpo_alpha": SIMPO["cpo_alpha"]}
        return trl_cpo(checkpoint, records, out, **common, **keys)
    return trl_orpo(checkpoint, records, out, **common, beta=0.3)


def relaytrain_run(name: str, checkpoint, data, run_dir, optim: str, *overrides: str) -> dict:
    keys = [f"objective.{k}={v}" for k, v in SIMPO.items()] if name == "simpo" else ["objective.beta=0.3"]
    cfg = compose_config([
        f"model.pretrained={checkpoint}", "data=preference", f"data.path={data}", f"data.seq_len={SEQ}",
        "data.shuffle=false", "data.cache=false", f"objective={name}", *keys, f"strategy.microbatch_size={MICROBATCH}",
        f"strategy.num_microbatches={ACCUMULATE}", f"train.steps={STEPS}", "train.untimed_steps=0",
        "train.save_model=true", f"optim.lr={LR[optim]}", "optim.weight_decay=0.0", *OPTIMIZERS[optim][1],
        *overrides])
    return run(resolve(cfg, ()), run_dir, quiet=True)


# Two replicas of one pair each, two micro-batches: TRL's four micro-batches of one pair (the NLL
# term and the mean logits are means over a micro-batch, as TRL's accumulation takes them).
FSDP = ["strategy=fsdp", "strategy.replicas=2", "strategy.microbatch_size=1"]
CASES = [  # (objective, strategy overrides, optimizer, model): each under every strategy, on both models
    *strategy_matrix(FSDP, "simpo", name="simpo"),
    *strategy_matrix(FSDP, "orpo", name="orpo", default=False),
]


@pytest.mark.parametrize(("name", "strategy", "optim", "model"), CASES)
def test_equals_trl(checkpoints, tmp_path, name, strategy, optim, model):
    records = pairs()
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    replicas = 2 if "strategy.replicas=2" in strategy else 1
    reference = trl_run(name, checkpoints[model], records, tmp_path / "trl", optim, MICROBATCH // replicas,
                        ACCUMULATE * replicas)
    results = relaytrain_run(name, checkpoints[model], data, tmp_path / "run", optim, *strategy)
    assert all(set(logged) == set(objective(name).figures) for logged in reference.figures)  # every one TRL logs
    assert_equal_to_trl(results, reference, tmp_path / "run", objective(name).figures)


@pytest.mark.slow
def test_simpo_as_published_without_the_nll_term_equals_trls(checkpoints, tmp_path):
    """cpo_alpha=0 (SimPO as published): TRL computes no NLL term and logs nll_loss 0."""
    records = pairs()
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    reference = trl_cpo(checkpoints["llama"], records, tmp_path / "trl", microbatch=MICROBATCH, accumulate=ACCUMULATE,
                        steps=STEPS, lr=LR["sgd"], optim="sgd", max_length=SEQ, loss_type="simpo", cpo_alpha=0.0)
    results = relaytrain_run("simpo", checkpoints["llama"], data, tmp_path / "run", "sgd", "objective.cpo_alpha=0",
                             "objective.beta=0.1", "objective.gamma=0.5", "objective.label_smoothing=0")
    assert results["loss_terms"]["nll_loss"] == [0.0] * STEPS
    assert_equal_to_trl(results, reference, tmp_path / "run", objective("simpo").figures)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_held_out_loss_and_accuracy_equal_trls_evaluation_a_pair_a_batch(checkpoints, tmp_path, name):
    """The held-out loss is each pair's loss with its own NLL term (TRL's, evaluating one pair a
    batch), its mean over the pairs; the accuracy TRL's eval_rewards/accuracies."""
    records, held_out = pairs(), pairs(5)[::-1]
    data, evaluated = write_pairs(tmp_path / "pairs.jsonl", records), write_pairs(tmp_path / "held.jsonl", held_out)
    reference = trl_run(name, checkpoints["llama"], records, tmp_path / "trl", "adamw", MICROBATCH, ACCUMULATE,
                        held_out=held_out)
    results = relaytrain_run(name, checkpoints["llama"], data, tmp_path / "run", "adamw", f"data.eval_path={evaluated}")
    final = results["eval"][-1]
    assert final["items"] == 5
    assert final["loss"] == pytest.approx(reference.evaluation["eval_loss"], abs=2e-5)
    assert final["accuracy"] == pytest.approx(reference.evaluation["eval_rewards/accuracies"], abs=1e-6)


# --------------------------------------------------------------------------- tokenization


FORMS = {
    # A prompt ending mid-word (its last token merges), a completion ending with eos already, one
    # cut at SEQ, one whose prompt fills it (dropped here; TRL keeps it with an empty completion).
    "text": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "What is the capi", "chosen": "tal of France? Paris.", "rejected": "tal? Rome<|im_end|>"},
        {"prompt": "Hello", "chosen": " there, " + LONG, "rejected": " you."},
        {"prompt": LONG, "chosen": " Yes.", "rejected": " No."},
    ],
    "text_implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Two plus two is four.", "rejected": "Two plus two is five."},
    ],
    "conversations": [
        {"prompt": [user("What is the capital of France?")], "chosen": [assistant("Paris.")],
         "rejected": [assistant("Rome.")]},
        {"prompt": [user("Hello"), assistant("Hi."), user("2+2?")], "chosen": [assistant("Four.")],
         "rejected": [assistant(LONG)]},
        # A prompt ending with the assistant's turn, which the completions continue.
        {"prompt": [user("Name a colour."), assistant("Bl")], "chosen": [assistant("ue.")],
         "rejected": [assistant("ack.")]},
    ],
    "conversations_implicit": [
        {"chosen": [user("What is 2+2?"), assistant("It is 4.")], "rejected": [user("What is 2+2?"), assistant("5")]},
    ],
}
TOKENIZED_SEQ = 32


def trl_rows(checkpoint, records: list[dict], tmp_path) -> list[tuple[list[int], list[int]]]:
    """Each record's chosen and rejected rows as TRL's CPOTrainer tokenizes them: (ids, labels)."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    arguments = CPOConfig(output_dir=str(tmp_path), max_length=TOKENIZED_SEQ, report_to=[], use_cpu=True, bf16=False)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    trainer = CPOTrainer(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                         processing_class=AutoTokenizer.from_pretrained(checkpoint))
    return [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for row in trainer.train_dataset
            for side in ("chosen", "rejected")]


def load_pairs(checkpoint, data, name: str, *overrides: str):
    cfg = compose_config([f"model.pretrained={checkpoint}", "data=preference", f"data.path={data}",
                          f"data.seq_len={TOKENIZED_SEQ}", f"objective={name}", *overrides])
    return build_datasets(resolve(cfg, ()), objective=objective(name))[0]


@pytest.mark.parametrize("form", list(FORMS))
def test_rows_are_trls_cpo_rows_token_for_token(checkpoints, tmp_path, form):
    records = FORMS[form]
    data = write_pairs(tmp_path / "pairs.jsonl", records)
    ours = load_pairs(checkpoints["llama"], data, "orpo", "data.cache=false")
    theirs = [(ids, labels) for ids, labels in trl_rows(checkpoints["llama"], records, tmp_path / "trl")
              if -100 in labels and len(ids) > labels.count(-100)]  # the pair whose prompt fills the row: dropped here
    assert ours.input_ids.shape[0] == len(theirs) and ours.rows_per_item == 2
    for row, (ids, labels) in enumerate(theirs):
        length = len(ids)
        assert ours.input_ids[row, :length].tolist() == ids
        assert ours.labels[row, :length].tolist() == labels
        assert ours.attention_mask[row].tolist() == [1] * length + [0] * (TOKENIZED_SEQ - length)
        assert (ours.labels[row, length:] == -100).all()
    if form == "text":
        assert {k: ours.facts[k] for k in ("records", "dropped", "truncated")} == {"records": 3, "dropped": 1,
                                                                                    "truncated": 1}


def test_dpos_and_cpos_rows_of_one_file_are_cached_apart(checkpoints, tmp_path):
    """TRL's CPO puts the tokenizer's bos before each row, its DPO does not (this tokenizer adds none)."""
    data = write_pairs(tmp_path / "pairs.jsonl", FORMS["text"])
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    dpo, simpo = (load_pairs(checkpoints["llama"], data, name, cache) for name in ("dpo", "simpo"))
    assert (dpo.facts["cache"], simpo.facts["cache"]) == ("miss", "miss")
    bos = AutoTokenizer.from_pretrained(checkpoints["llama"]).bos_token_id
    assert (simpo.input_ids[:, 0] == bos).all() and not (dpo.input_ids[:, 0] == bos).any()
    assert load_pairs(checkpoints["llama"], data, "simpo", cache).facts["cache"] == "hit"


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("name", "overrides", "says"), [
    ("simpo", ["objective.loss_type=hinge"], "TRL's CPO loss_type=simpo only"),
    ("simpo", ["objective.beta=0"], "must be positive"),
    ("simpo", ["objective.label_smoothing=0.5"], r"must be in \[0, 0.5\)"),
    ("simpo", ["objective.cpo_alpha=-1"], "must be at least 0"),
    ("simpo", ["objective.ref_model=/some/checkpoint"], "it reads no reference"),
    ("orpo", ["objective.rpo_alpha=0.5"], "DPO's; its NLL term is built in"),
    ("orpo", ["objective.label_smoothing=0.1"], "TRL's ORPO has none"),
    ("orpo", ["strategy.sequence_parallel=2"], "compares whole ones"),
])
def test_bad_settings_are_one_line_each(checkpoints, tmp_path, name, overrides, says):
    data = write_pairs(tmp_path / "pairs.jsonl", pairs(4))
    cfg = compose_config([f"model.pretrained={checkpoints['llama']}", "data=preference", f"data.path={data}",
                          f"data.seq_len={SEQ}", f"objective={name}", *overrides])
    with pytest.raises(ConfigError, match=says) as refused:
        validate(resolve(cfg, ()))
    assert "\n" not in str(refused.value)


def test_a_record_with_tools_is_refused_in_one_line(checkpoints, tmp_path):
    """TRL's CPO/ORPO render conversations without the record's tools: refused, not dropped unsaid."""
    record = {**FORMS["conversations"][0], "tools": [{"name": "weather"}]}
    data = write_pairs(tmp_path / "pairs.jsonl", [record])
    with pytest.raises(ConfigError, match="render conversations without them") as refused:
        load_pairs(checkpoints["llama"], data, "simpo", "data.cache=false")
    assert "\n" not in str(refused.value)
