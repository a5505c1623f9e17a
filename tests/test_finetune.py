"""Fine-tuning the checkpoint you have, and evaluating on held-out data, under every strategy.

Checkpoints are made here with `save_pretrained` of tiny Hugging Face models, as a user's
would be. The reference for training is a plain PyTorch loop started from the same
checkpoint; the reference for evaluation is plain transformers on the run's saved model.
"""

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)

from relaytrain.commands.cli import main
from relaytrain.data import build_datasets
from relaytrain.models import build_model
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.conftest import train_plain_loop

STEPS = 3
BERT = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A user's checkpoints: BERT classification with 3 labels, BERT MLM, GPT-2 LM (tied head)."""
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(1)
    BertForSequenceClassification(BertConfig(**BERT, num_labels=3)).save_pretrained(root / "bert_cls3")
    BertForMaskedLM(BertConfig(**BERT)).save_pretrained(root / "bert_mlm")
    gpt2 = GPT2Config(vocab_size=300, n_embd=48, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=299, eos_token_id=299)
    GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    (root / "empty").mkdir()
    return root


def finetune_cfg(checkpoint, *overrides, explicit=()):
    """The config `relaytrain train model.pretrained=DIR ...` runs with (the default model group)."""
    cfg = compose_config([f"model.pretrained={checkpoint}", "data.seq_len=16", "data.num_samples=128",
                          "strategy.microbatch_size=2", "strategy.num_microbatches=2", f"train.steps={STEPS}",
                          "train.untimed_steps=1", "train.save_model=true", "optim.lr=1e-3", *overrides])
    return resolve(cfg, explicit)


def assert_same_weights(run_dir, reference, atol=2e-5):
    cfg = compose_config([f"model.pretrained={run_dir / 'model'}"])
    ours = build_model(resolve(cfg).model).hf_model
    for (name, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------ the checkpoint decides


def test_the_checkpoint_decides_family_task_sizes_and_labels(checkpoints):
    cls3 = finetune_cfg(checkpoints / "bert_cls3").model
    assert (str(cls3.family), str(cls3.task), cls3.num_labels, cls3.num_layers, cls3.hidden_size,
            cls3.vocab_size, cls3.max_seq_len) == ("bert", "classification", 3, 3, 48, 300, 64)
    gpt2 = finetune_cfg(checkpoints / "gpt2").model  # the default group is bert_tiny
    assert (str(gpt2.family), str(gpt2.task), gpt2.num_layers) == ("gpt2", "causal_lm", 3)
    mlm = finetune_cfg(checkpoints / "bert_mlm").model
    assert str(mlm.task) == "masked_lm" and mlm.name == "bert_mlm"


@pytest.mark.parametrize("strategy", ["baseline", "l2l", "pipe_flush"])
def test_a_three_label_checkpoint_fine_tunes_to_the_plain_loops_weights(checkpoints, tmp_path, strategy):
    cfg = finetune_cfg(checkpoints / "bert_cls3", f"strategy={strategy}")
    results = run(cfg, tmp_path)
    assert results["model"]["pretrained"] == str(checkpoints / "bert_cls3")
    assert_same_weights(tmp_path, train_plain_loop(cfg, STEPS).hf_model)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").config.num_labels == 3


@pytest.mark.parametrize("strategy", ["l2l_stash_cpu", "pipe_flush"])
def test_a_gpt2_checkpoint_alone_trains_as_a_causal_lm(checkpoints, tmp_path, strategy):
    cfg = finetune_cfg(checkpoints / "gpt2", f"strategy={strategy}")
    results = run(cfg, tmp_path)
    assert results["model"]["task"] == "causal_lm"
    reference = train_plain_loop(cfg, STEPS).hf_model
    assert_same_weights(tmp_path, reference)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "model").lm_head.weight,
                       AutoModelForCausalLM.from_pretrained(tmp_path / "model").transformer.wte.weight)


def test_pipe_2bw_from_a_checkpoint_follows_the_delayed_rule(checkpoints, tmp_path):
    from tests.strategies.pipeline.test_runtime import trained_by_delayed_gradients

    cfg = finetune_cfg(checkpoints / "gpt2", "strategy=pipe_2bw", "strategy.num_microbatches=2",
                       "train.steps=4")
    run(cfg, tmp_path)
    assert_same_weights(tmp_path, trained_by_delayed_gradients(cfg))


def test_an_mlm_checkpoint_gets_a_new_classification_head_with_a_notice(checkpoints, tmp_path, capsys):
    cfg = finetune_cfg(checkpoints / "bert_mlm", "model.task=classification", "model.num_labels=4",
                       "strategy=l2l", explicit=["model.task=classification", "model.num_labels=4"])
    assert (str(cfg.model.task), cfg.model.num_labels) == ("classification", 4)
    run(cfg, tmp_path)
    notice = [line for line in capsys.readouterr().out.splitlines() if "freshly initialised" in line]
    assert len(notice) == 1 and "a new classification head with 4 labels" in notice[0]
    assert "classifier.weight" in notice[0]
    assert_same_weights(tmp_path, train_plain_loop(cfg, STEPS).hf_model)


def test_more_labels_than_the_checkpoint_replaces_its_head(checkpoints, tmp_path, capsys):
    assert main(["train", f"model.pretrained={checkpoints / 'bert_cls3'}", "model.num_labels=5", "train.steps=2",
                 "train.untimed_steps=0", "data.seq_len=16", "data.num_samples=64", "train.save_model=true",
                 f"hydra.run.dir={tmp_path}"]) == 0
    assert "freshly initialised: classifier.bias, classifier.weight" in capsys.readouterr().out
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").config.num_labels == 5


@pytest.mark.parametrize(("override", "message"), [
    ("model.num_layers=7", "model.num_layers=7 contradicts model.pretrained="),
    ("model.hidden_size=64", "whose hidden_size is 48; drop it"),
])
def test_a_contradicting_key_is_refused_with_one_line(checkpoints, override, message, capsys):
    assert main(["train", f"model.pretrained={checkpoints / 'bert_cls3'}", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_directory_without_a_config_is_refused_with_one_line(checkpoints, capsys):
    assert main(["train", f"model.pretrained={checkpoints / 'empty'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no config.json" in err[0]


# ------------------------------------------------------------------------ evaluation


def plain_transformers_eval(model_dir, cfg, task):
    """Mean loss over every held-out item and accuracy, by plain transformers on the saved model."""
    _, held_out = build_datasets(cfg)
    auto = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).eval()
    loss_sum, items, correct = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(held_out), 5):  # another batching than the run's: sums do not care
            mb = held_out.take(torch.arange(start, min(start + 5, len(held_out))))
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=mb.labels)
            if task == "classification":
                count = mb.labels.numel()
                correct += int((out.logits.argmax(-1) == mb.labels).sum())
            else:
                count = int((mb.labels[:, 1:] != -100).sum())
            loss_sum += float(out.loss) * count
            items += count
    return loss_sum / items, correct / items, items


@pytest.mark.parametrize(("family", "strategy"), [("bert", "l2l"), ("bert", "pipe_flush"), ("gpt2", "baseline"),
                                                  ("gpt2", "pipe_2bw")])
def test_evaluation_equals_plain_transformers_on_the_saved_model(checkpoints, tmp_path, family, strategy):
    checkpoint = checkpoints / ("bert_cls3" if family == "bert" else "gpt2")
    # 128 samples, 10 % held out = 13: not a multiple of the 2 x 2 rows an evaluation batch holds.
    cfg = finetune_cfg(checkpoint, f"strategy={strategy}", "data.eval_fraction=0.1", "eval.every=2",
                       "model.dropout=0.1")
    results = run(cfg, tmp_path)
    assert [e["step"] for e in results["eval"]] == [2, 3]  # every 2 steps, and after the last
    last = results["eval"][-1]
    loss, accuracy, items = plain_transformers_eval(tmp_path / "model", cfg, str(cfg.model.task))
    assert last["items"] == items
    assert last["loss"] == pytest.approx(loss, rel=1e-5)
    if family == "bert":
        assert last["accuracy"] == accuracy and items == 13
    else:
        assert last["perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)


def test_eval_max_batches_limits_the_held_out_items(checkpoints, tmp_path):
    cfg = finetune_cfg(checkpoints / "bert_cls3", "data.eval_fraction=0.25", "eval.max_batches=3",
                       "train.save_model=false")
    assert run(cfg, tmp_path)["eval"][-1]["items"] == 3 * 2


def test_keep_best_keeps_the_best_evaluated_checkpoint_beside_the_latest(tmp_path):
    from relaytrain.records import checkpoint

    assert main(["train", "+exp=tiny_baseline", "train.steps=8", "data.eval_fraction=0.1", "eval.every=2",
                 "train.checkpoint_every=2", "train.keep_checkpoints=1", "train.keep_best=loss",
                 f"hydra.run.dir={tmp_path}"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    best = min(results["eval"], key=lambda e: e["loss"])["step"]
    kept = [int(p.name[5:]) for p in checkpoint.list_checkpoints(checkpoint.checkpoint_dir(tmp_path))]
    assert kept == sorted({best, 8})
    assert checkpoint.best_step(checkpoint.checkpoint_dir(tmp_path)) == best


# ------------------------------------------------------------------------ bad input


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.every=5"], "eval.every=5 needs held-out data: set data.eval_fraction"),
    (["data.eval_fraction=1.5"], "data.eval_fraction=1.5 must be in [0, 1)"),
    (["data.eval_split=validation"], "data.eval_split names a split of a hub dataset"),
    (["data.eval_path=/no/such.jsonl"], "data.eval_path is a jsonl file for data=chat or jsonl"),
    (["data.eval_fraction=0.1", "train.keep_best=perplexity", "train.checkpoint_every=2"],
     "train.keep_best=perplexity is not a metric of model.task=classification"),
    (["train.keep_best=loss"], "train.keep_best=loss keeps the best evaluated checkpoint: it needs held-out data"),
])
def test_bad_evaluation_settings_are_refused_with_one_line(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_bad_eval_file_is_refused_naming_the_line(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"sample {i}", "label": i % 2} for i in range(64)])
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"text": "fine", "label": 0}\n{"text": "broken", "label": 7}\n')
    base = ["train", "data=jsonl", f"data.path={train}", "data.seq_len=16", "train.steps=1", "train.untimed_steps=0",
            f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as stop:
        main([*base, f"data.eval_path={bad}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad} line 2: label 7 is outside [0, 2)" in err[0]

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit):
        main([*base, f"data.eval_path={empty}"])
    assert f"data.eval_path={empty} holds no samples" in capsys.readouterr().err


def test_held_out_jsonl_samples_are_encoded_with_the_training_tokenizer(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "good fine great" if i % 2 else "bad awful poor",
                                                    "label": i % 2} for i in range(64)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"text": "great good", "label": 1}, {"text": "awful", "label": 0},
                                                 {"text": "unseenword", "label": 0}])
    cfg = compose_config(["data=jsonl", f"data.path={train}", f"data.eval_path={held}", "data.seq_len=8"])
    train_set, eval_set = build_datasets(cfg, str(tmp_path / "run"))
    assert len(train_set) == 64 and len(eval_set) == 3
    vocab = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert int(eval_set.input_ids[0, 1]) == vocab["great"]  # [CLS] great good [SEP]
    assert "unseenword" not in vocab  # trained on the training text only


def test_results_and_table_name_the_starting_checkpoint(checkpoints, tmp_path):
    cfg = finetune_cfg(checkpoints / "bert_cls3", "train.save_model=false")
    results = run(cfg, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert results["model"]["pretrained"] == on_disk["model"]["pretrained"] == str(checkpoints / "bert_cls3")
