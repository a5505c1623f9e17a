"""The default suite's slice of the conformance matrix is a pairwise cover of it, the same every run."""

from tests.conformance.cells import (
    ADAPTERS,
    FAMILIES,
    FEATURES,
    STRATEGIES,
    Cell,
    every_cell,
    pairs_of,
    pairwise_cover,
)


def test_every_pair_a_valid_cell_has_is_in_a_default_cell():
    cover = pairwise_cover()
    assert set(cover) <= set(every_cell()) and len(set(cover)) == len(cover)
    assert set().union(*map(pairs_of, every_cell())) == set().union(*map(pairs_of, cover))


def test_the_cover_is_deterministic_and_smaller_than_the_product():
    assert pairwise_cover() == pairwise_cover()
    assert len(pairwise_cover()) < len(every_cell()) / 2


def test_every_strategy_trains_every_family_and_every_feature_in_the_default_suite():
    cover = pairwise_cover()
    assert {(c.strategy, c.family) for c in cover} == {(s, f) for s in STRATEGIES for f in FAMILIES}
    assert {c.feature for c in cover} == set(FEATURES) and {c.adapter for c in cover} == set(ADAPTERS)


def test_a_cell_the_matrix_cannot_train_is_left_out():
    assert not Cell("fsdp", "llama", "offload").valid()  # fsdp's host offload needs a CUDA device
    assert not Cell("baseline", "bert", "plain", "lora").valid()  # peft's adapters are for the decoders
    assert not Cell("l2l", "gpt2", "dropout", "lora").valid()  # peft's loop draws its own masks
    assert Cell("pipe_2bw", "gpt2", "offload", "lora").valid()
