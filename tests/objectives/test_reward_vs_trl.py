"""`objective=reward` equals TRL's RewardTrainer: the same sequence-classification checkpoint,
pairs in file order and optimizer give the same loss and figures each step, the same trained
weights (the score head's included) and the same held-out loss and accuracy, under each strategy.
A reward model saved by the run is a directory transformers loads and scores with as relaytrain did.

TRL tokenizes a pair as DPOTrainer does for the rows relaytrain trains on (the prompt and each
reply whole, eos after a text reply), but drops a pair longer than its max_length where
data=preference cuts it to data.seq_len: the pairs here fit, so both train on every one whole.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import tiny_decoder, tiny_moe
from tests.objectives.trl_runs import OPTIMIZERS, TRAINER_LOGS, TrlRun, once, strategy_matrix, write_pairs

MICROBATCH, ACCUMULATE, STEPS, SEQ, HELD_OUT = 2, 2, 3, 48, 4
LR = {"sgd": 0.02, "adamw": 2e-3}
FIGURES = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def pairs(count: int = MICROBATCH * ACCUMULATE * STEPS, start: int = 0) -> list[dict]:
    """Preference pairs of uneven lengths (the chosen and rejected rows pad differently), each
    within SEQ tokens."""
    out = []
    for i in range(start, start + count):
        out.append({"prompt": f"What is {i} plus {i}?" + " Think." * (i % 3),
                    "chosen": f" It is {2 * i}." + " Sure." * (i % 2),
                    "rejected": f" Maybe {i + 1}" + " hmm" * (i % 4)})
    return out


def reward_checkpoint(directory: Path, causal: Path) -> Path:
    """`causal`'s body with a one-score head, drawn far from zero so that the first steps move
    every weight, saved as a sequence-classification checkpoint with its tokenizer."""
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=1, dtype=torch.float32)
    torch.nn.init.normal_(model.score.weight, std=0.2)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(causal).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    llama, moe = tiny_decoder(root / "llama", layers=2), tiny_moe(root / "qwen3_moe", layers=2)
    return {"llama": reward_checkpoint(root / "llama_rm", llama), "qwen3_moe": reward_checkpoint(root / "moe_rm", moe),
            "causal_llama": llama}


@once
def trl_reward(checkpoint: Path, records: list[dict], held_out: list[dict], out: Path, *, optim: str,
               **reward) -> TrlRun:
    """TRL's RewardTrainer on `records` (prompt/chosen/rejected), STEPS optimizer steps of MICROBATCH
    pairs times ACCUMULATE, then evaluated on `held_out` in one batch; `reward`: RewardConfig's own
    keys (center_rewards_coefficient). The evaluation's figures come back as the last entry of
    `figures`, under TRL's eval_ names."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, dtype=torch.float32)
    arguments = RewardConfig(
        output_dir=str(out), per_device_train_batch_size=MICROBATCH, gradient_accumulation_steps=ACCUMULATE,
        per_device_eval_batch_size=len(held_out), max_steps=STEPS, learning_rate=LR[optim],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        bf16=False, report_to=[], save_strategy="no", seed=0, max_length=SEQ, train_sampling_strategy="sequential",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False,
        **OPTIMIZERS[optim][0], **reward)
    trainer = RewardTrainer(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                            processing_class=AutoTokenizer.from_pretrained(checkpoint))
    assert len(trainer.train_dataset) == len(records)  # TRL dropped no pair as too long
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    evaluated = trainer.evaluate(Dataset.from_list(held_out))
    return TrlRun(losses=[entry["loss"] for entry in logged],
                  figures=[{k: v for k, v in entry.items() if k not in TRAINER_LOGS} for entry in logged] + [evaluated],
                  weights={name: t.detach().clone() for name, t in trainer.model.state_dict().items()})


def reward_config(checkpoint: Path, data: Path, *overrides: str):
    """The config of an objective=reward run of `checkpoint` on the pairs at `data`."""
    return compose_config([f"model.pretrained={checkpoint}", "data=preference", f"data.path={data}",
                           f"data.seq_len={SEQ}", "objective=reward", *overrides])


def relaytrain_reward(checkpoint, data, held_out, run_dir, cache, optim: str, *overrides: str) -> dict:
    cfg = reward_config(
        checkpoint, data, f"data.eval_path={held_out}", "data.shuffle=false", f"data.cache_dir={cache}",
        f"strategy.microbatch_size={MICROBATCH}", f"strategy.num_microbatches={ACCUMULATE}", f"train.steps={STEPS}",
        "train.untimed_steps=0", "train.save_model=true", f"optim.lr={LR[optim]}", "optim.weight_decay=0.0",
        *OPTIMIZERS[optim][1], *overrides)
    return run(resolve(cfg, ()), run_dir, quiet=True)


def assert_equal_to_trl(results: dict, reference: TrlRun, run_dir: Path, figures=FIGURES, atol: float = 2e-5) -> None:
    assert results["data"]["truncated"] == 0 and results["data"]["dropped"] == 0
    assert results["loss"] == pytest.approx(reference.losses, abs=atol)
    for step, logged in enumerate(reference.figures[:-1]):
        for name in figures:
            ours = results["loss_terms"][name][step]
            assert math.isclose(ours, logged[name], abs_tol=1e-4, rel_tol=1e-5), (step, name, ours, logged[name])
    evaluated, trl_evaluated = results["eval"][-1], reference.figures[-1]
    assert evaluated["items"] == HELD_OUT
    assert evaluated["loss"] == pytest.approx(trl_evaluated["eval_loss"], abs=atol)
    assert evaluated["accuracy"] == pytest.approx(trl_evaluated["eval_accuracy"], abs=1e-9)
    trained = AutoModelForSequenceClassification.from_pretrained(run_dir / "model", dtype=torch.float32).state_dict()
    assert set(trained) == set(reference.weights)
    for name, tensor in reference.weights.items():
        torch.testing.assert_close(trained[name], tensor, atol=atol, rtol=1e-4, msg=name)


EXTREMES = ("min_reward", "max_reward")  # per micro-batch: TRL's only where one process holds each
# Two replicas of one pair each: TRL's micro-batch of two pairs.
FSDP = ["strategy=fsdp", "strategy.replicas=2", "strategy.microbatch_size=1"]
CASES = [  # (center_rewards_coefficient, strategy overrides, optimizer, model): every strategy, both models
    *strategy_matrix(FSDP, None),
    *strategy_matrix(FSDP, 0.01, name="centred", default=False),
]


@pytest.mark.parametrize(("center", "strategy", "optim", "model"), CASES)
def test_reward_equals_trl(checkpoints, tmp_path, center, strategy, optim, model):
    records, held_out = pairs(), pairs(HELD_OUT, start=100)
    data, eval_data = write_pairs(tmp_path / "pairs.jsonl", records), write_pairs(tmp_path / "held.jsonl", held_out)
    reference = trl_reward(checkpoints[model], records, held_out, tmp_path / "trl", optim=optim,
                           center_rewards_coefficient=center)
    results = relaytrain_reward(checkpoints[model], data, eval_data, tmp_path / "run", tmp_path / "cache", optim,
                                *strategy, f"objective.center_rewards_coefficient={'null' if center is None else center}")
    split = any(o.startswith("strategy.replicas=") for o in strategy)
    assert_equal_to_trl(results, reference, tmp_path / "run",
                        figures=[f for f in FIGURES if not (split and f in EXTREMES)])


def test_margin_and_centring_equal_trls_compute_loss(checkpoints, tmp_path):
    """TRL's `margin` column and `center_rewards_coefficient` on one batch: TRL's RewardTrainer's
    own `compute_loss` against relaytrain's loss (a pair's rows side by side, its margin a row
    field), the figures it records, and the score head's gradient."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from relaytrain.models import MicroBatch, build_model
    from relaytrain.objectives import objective

    records = [{**pair, "margin": 0.5 * i - 1.0} for i, pair in enumerate(pairs(4))]
    hf_model = AutoModelForSequenceClassification.from_pretrained(checkpoints["llama"], dtype=torch.float32).train()
    arguments = RewardConfig(output_dir=str(tmp_path / "trl"), center_rewards_coefficient=0.05, max_length=SEQ,
                             bf16=False, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = RewardTrainer(model=hf_model, args=arguments, train_dataset=Dataset.from_list(records),
                            processing_class=AutoTokenizer.from_pretrained(checkpoints["llama"]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trl_loss = trainer.compute_loss(trainer.model, dict(batch))
    trl_loss.backward()

    cfg = resolve(compose_config([f"model.pretrained={checkpoints['llama']}", "objective=reward"]), ())
    reward = objective("reward").configured({"center_rewards_coefficient": 0.05})
    model = build_model(cfg.model, quiet=True, objective=reward)
    count = len(records)
    interleaved = torch.stack([batch["input_ids"][:count], batch["input_ids"][count:]], 1).flatten(0, 1)
    mask = torch.stack([batch["attention_mask"][:count], batch["attention_mask"][count:]], 1).flatten(0, 1)
    mb = MicroBatch(input_ids=interleaved, labels=torch.where(mask.bool(), interleaved, -100), attention_mask=mask,
                    margin=batch["margin"].repeat_interleave(2))
    loss = model(mb)
    loss.backward()

    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), abs=1e-6)
    figures = {name: total / items for name, (total, items) in model.loss_term_sums().items()}
    for name in FIGURES:
        assert figures[name] == pytest.approx(trainer._metrics["train"][name][0], abs=1e-6), name
    torch.testing.assert_close(model.head.score.weight.grad, hf_model.score.weight.grad, atol=1e-6, rtol=1e-5)


def relaytrain_scores(model, mb) -> torch.Tensor:
    """The layered model's score of each row, through the parts every strategy runs."""
    hidden = model.embed_input(mb.input_ids)
    ctx = model.context(mb, hidden)
    for block in model.blocks:
        hidden = block(hidden, ctx)
    return model.head(model.head_input(hidden, mb)).squeeze(-1)


def test_a_saved_reward_model_scores_in_transformers_as_in_relaytrain(checkpoints, tmp_path):
    """From a causal LM checkpoint (a new score head), trained and saved: transformers loads a
    one-label sequence classifier with its tokenizer, and scores right-padded rows as relaytrain's
    head does, also where the pad id is the eos (each row then scored at the token before its eos)."""
    from relaytrain.models import MicroBatch, build_model
    from relaytrain.objectives import objective

    data = write_pairs(tmp_path / "pairs.jsonl", pairs(8))
    held = write_pairs(tmp_path / "held.jsonl", pairs(2, start=50))
    relaytrain_reward(checkpoints["causal_llama"], data, held, tmp_path / "run", tmp_path / "cache", "sgd",
                      "train.steps=2")
    saved = tmp_path / "run" / "model"
    hf_model = AutoModelForSequenceClassification.from_pretrained(saved, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(saved)
    assert hf_model.config.num_labels == 1 and hf_model.config.architectures == ["LlamaForSequenceClassification"]

    cfg = resolve(compose_config([f"model.pretrained={saved}", "objective=reward"]), ())
    model = build_model(cfg.model, quiet=True, objective=objective("reward")).eval()
    texts = [p["prompt"] + p["chosen"] + tokenizer.eos_token for p in pairs(4, start=20)]
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        tokenizer.pad_token_id = hf_model.config.pad_token_id = model.hf_config.pad_token_id = pad
        encoded = tokenizer(texts, padding="longest", return_tensors="pt")
        assert not bool(encoded["attention_mask"].all())  # rows of several lengths: padding to skip
        mb = MicroBatch(input_ids=encoded["input_ids"], labels=encoded["input_ids"],
                        attention_mask=encoded["attention_mask"])
        with torch.no_grad():
            theirs = hf_model(**encoded).logits.squeeze(-1)
            ours = relaytrain_scores(model, mb)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_naming_no_pad_id_trains_as_trl_and_saves_its_tokenizers(checkpoints, tmp_path):
    """A checkpoint whose config names no pad id and whose tokenizer has no pad token (Llama 3's
    base): the rows pad with eos, and TRL writes that id into the model's config, so every row is
    scored at the token before its closing eos. relaytrain does the same, and its saved model
    names the id."""
    from transformers import AutoConfig

    base = tmp_path / "no_pad"
    AutoModelForSequenceClassification.from_pretrained(checkpoints["llama"], pad_token_id=None).save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    tokenizer.pad_token = None
    tokenizer.save_pretrained(base)
    assert AutoConfig.from_pretrained(base).pad_token_id is None
    records, held_out = pairs(), pairs(HELD_OUT, start=100)
    data, eval_data = write_pairs(tmp_path / "pairs.jsonl", records), write_pairs(tmp_path / "held.jsonl", held_out)
    reference = trl_reward(base, records, held_out, tmp_path / "trl", optim="sgd", center_rewards_coefficient=None)
    results = relaytrain_reward(base, data, eval_data, tmp_path / "run", tmp_path / "cache", "sgd")
    assert_equal_to_trl(results, reference, tmp_path / "run")
    assert AutoConfig.from_pretrained(tmp_path / "run" / "model").pad_token_id == tokenizer.eos_token_id


@pytest.mark.slow
def test_a_decoder_trains_as_transformers_sequence_classifier(checkpoints, tmp_path):
    """model.task=classification on a decoder: the loss per step and the trained weights of a plain
    loop over transformers' LlamaForSequenceClassification on the same rows (SGD)."""
    import json

    from relaytrain.data import build_dataset

    classifier = tmp_path / "classifier"
    torch.manual_seed(2)
    AutoModelForSequenceClassification.from_pretrained(checkpoints["causal_llama"], num_labels=3).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(checkpoints["causal_llama"]).save_pretrained(classifier)
    records = [{"text": f"Sample {i}: " + "word " * (i % 5), "label": i % 3} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = resolve(compose_config([
        f"model.pretrained={classifier}", "data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", "data.seq_len=16",
        "data.shuffle=false", f"data.cache_dir={tmp_path / 'cache'}", "strategy=baseline", "strategy.microbatch_size=2",
        "strategy.num_microbatches=2", "train.steps=2", "train.untimed_steps=0", "train.save_model=true", "optim=sgd",
        "optim.momentum=0.0", "optim.lr=0.5", "optim.weight_decay=0.0"]), ())
    assert cfg.model.task == "classification" and cfg.model.family == "decoder"
    results = run(cfg, tmp_path / "run", quiet=True)

    rows = build_dataset(cfg)
    reference = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for step in range(2):
        total = 0.0
        for micro in range(2):
            first = (2 * step + micro) * 2
            part = slice(first, first + 2)
            loss = reference(input_ids=rows.input_ids[part], attention_mask=rows.attention_mask[part],
                             labels=rows.labels[part]).loss / 2
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    assert results["loss"] == pytest.approx(losses, abs=1e-5)
    trained = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model").state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def assert_refused(checkpoint: Path, tmp_path: Path, overrides: list[str], says: str) -> None:
    """A reward run of `checkpoint` with `overrides` (typed: they count against the checkpoint's
    config) is refused before anything starts, in one line that says `says`."""
    from relaytrain.run.compose import validate
    from relaytrain.utils.errors import ConfigError

    cfg = reward_config(checkpoint, write_pairs(tmp_path / "pairs.jsonl", pairs(4)), *overrides)
    with pytest.raises(ConfigError, match=says) as refused:
        validate(resolve(cfg, overrides))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("overrides", "says"), [
    (["objective.beta=0.2"], "objective.beta=0.2 is not a key of objective=reward"),
    (["objective.ref_model=/some/dir"], "is not a key of objective=reward"),
    (["objective.center_rewards_coefficient=-1"], "must be at least 0"),
    (["model.num_labels=2"], "trains a head of 1 output"),
    (["strategy.sequence_parallel=2"], "scores each whole one at one of its tokens"),
])
def test_bad_reward_settings_are_one_line_each(checkpoints, tmp_path, overrides, says):
    assert_refused(checkpoints["llama"], tmp_path, overrides, says)


def test_a_decoder_type_without_a_sequence_classifier_is_refused_in_one_line(tmp_path):
    granite = tiny_decoder(tmp_path / "granite", "granite", layers=1)
    assert_refused(granite, tmp_path, [], "a granite model has no SequenceClassification head")
