"""The embedded synthetic data and the micro-batch loader."""

import pytest
import torch

from relaytrain.data import build_dataset, build_loader
from relaytrain.utils.errors import ConfigError
from tests.conftest import tiny_cfg


def test_synthetic_data_is_deterministic_for_a_seed():
    a, b = build_dataset(tiny_cfg("bert")), build_dataset(tiny_cfg("bert"))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    other = build_dataset(tiny_cfg("bert", "data.seed=7"))
    assert not torch.equal(a.input_ids, other.input_ids)


def test_synthetic_tokens_fit_the_vocabulary_and_tasks_have_their_labels():
    for family, task, label_shape in [("bert", "classification", (256,)), ("bert", "masked_lm", (256, 16)),
                                      ("gpt2", "causal_lm", (256, 16))]:
        d = build_dataset(tiny_cfg(family, f"model.task={task}"))
        assert int(d.input_ids.max()) < 300 and int(d.input_ids.min()) >= 0
        assert tuple(d.labels.shape) == label_shape
    mlm = build_dataset(tiny_cfg("bert", "model.task=masked_lm"))
    assert ((mlm.labels != -100).sum(dim=1) >= 1).all()  # every sample predicts something


def test_loader_serves_minibatches_of_microbatches_and_reshuffles_each_epoch():
    cfg = tiny_cfg("bert", "strategy.microbatch_size=8", "strategy.num_microbatches=4")
    loader = build_loader(cfg, build_dataset(cfg))
    first = loader.minibatch(0)
    assert len(first) == 4 and all(mb.input_ids.shape == (8, 16) for mb in first)
    epoch = loader.minibatches_per_epoch
    assert epoch == 256 // 32
    seen = torch.cat([mb.input_ids for p in range(epoch) for mb in loader.minibatch(p)])
    assert seen.shape[0] == 256 and torch.unique(seen, dim=0).shape[0] == torch.unique(
        build_dataset(cfg).input_ids, dim=0).shape[0]
    assert not torch.equal(loader.minibatch(0)[0].input_ids, loader.minibatch(epoch)[0].input_ids)
    assert torch.equal(loader.minibatch(3)[1].input_ids, build_loader(cfg, build_dataset(cfg)).minibatch(3)[1].input_ids)



def test_a_dataset_smaller_than_a_minibatch_names_the_keys_whose_product_it_is():
    cfg = tiny_cfg("bert", "strategy.microbatch_size=64", "strategy.num_microbatches=4")
    dataset = build_dataset(cfg)  # 256 samples
    with pytest.raises(ConfigError, match=r"^the dataset has 256 samples, fewer than one minibatch \(strategy\."
                       r"microbatch_size × strategy\.num_microbatches × strategy\.replicas = 512\)"):
        build_loader(cfg, dataset, replicas=2)
    with pytest.raises(ConfigError, match=r"\(strategy\.microbatch_size × strategy\.num_microbatches = 512\);"):
        build_loader(tiny_cfg("bert", "strategy.microbatch_size=128", "strategy.num_microbatches=4"), dataset)
