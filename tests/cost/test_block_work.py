"""One count of a block's and the head's work (`cost.work`): the spec-sheet profile times it,
the pipelines' balanced layout cuts by it (`formulas.part_costs`) and a run's model FLOP/s
divides by it (`cost.work.model_flops_per_token`). They agree with each other and with a hand
count for each kind of head: BERT's MLM head has a transform layer (h x h) before the
vocabulary projection, GPT-2's and the decoders' LM heads have none, and a classification head
is a pooler (h x h) and a classifier (h x labels) on one position a sample."""

from __future__ import annotations

import pytest

from relaytrain.cost.formulas import BYTE_FLOPS, ModelFacts, logits_bytes, part_costs
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.cost.work import block_forward_flops, block_shape, model_flops_per_token, model_work
from relaytrain.run.compose import compose_config
from tests.conftest import TINY_BERT, TINY_GPT2, TINY_LLAMA

H, V, S, LABELS = 32, 300, 16, 4  # the tiny models' hidden size, vocabulary, sequence, classes
CONFIGS = {
    # head forward FLOPs per sample, by hand
    "bert_mlm": ([*TINY_BERT, "model.task=masked_lm"], 2 * S * (H * H + H * V)),  # transform, then the (tied) decoder
    "gpt2_lm": (TINY_GPT2, 2 * S * H * V),  # the (tied) LM head alone
    "llama_lm": (TINY_LLAMA, 2 * S * H * V),  # the untied LM head alone
    "bert_classification": ([*TINY_BERT, "model.task=classification", f"model.num_labels={LABELS}"],
                            2 * (H * H + H * LABELS)),  # pooler and classifier on the first token
}
EXACT = {**load_spec("v100_16gb"), "peak_tflops": {"fp32": 1.0}, "compute_efficiency": {"fp32": 1.0},
         "tokens_half_efficiency": 0, "kernel_overhead_s_per_block": 0.0}  # time x 1e12 = FLOPs


@pytest.mark.parametrize("name", CONFIGS)
def test_the_profile_the_layout_and_the_model_flops_count_one_work(name):
    overrides, head_by_hand = CONFIGS[name]
    cfg = compose_config(overrides)
    m, s, b = cfg.model, cfg.data.seq_len, 2
    work = model_work(m, s)
    assert s == S and work.head == head_by_hand
    assert work.block == s * block_forward_flops(block_shape(m), s)

    # the spec-sheet profile: forward seconds x the FLOP rate are the work
    timings = from_spec(EXACT, cfg, [b]).timings[0]
    assert timings.block[b].forward_s * 1e12 == pytest.approx(b * work.block)
    assert timings.head[b].forward_s * 1e12 == pytest.approx(b * work.head)

    # the layout's part costs: forward and backward (3x), and an LM head's logits traffic
    facts = ModelFacts.of(cfg)
    assert facts.work == work
    costs = part_costs(facts, b)
    assert costs.block == 3 * b * work.block
    assert costs.head == 3 * b * work.head + BYTE_FLOPS * logits_bytes(b, facts.logits_per_sample)

    # a run's model FLOPs per token: every block and the head, forward and backward
    assert model_flops_per_token(m, s) * s == pytest.approx(3 * (m.num_layers * work.block + work.head))


def test_only_bert_s_language_model_head_has_a_transform():
    bert, gpt2, llama = (model_work(compose_config(o).model, S).head
                         for o in ([*TINY_BERT, "model.task=masked_lm"], TINY_GPT2, TINY_LLAMA))
    assert bert - gpt2 == 2 * S * H * H and gpt2 == llama
