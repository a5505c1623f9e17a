"""The built-in rollout engine (`rollout.sampling`): its KV-cache decode is Hugging Face's, and
its draws are keyed, so a completion does not depend on what it is decoded beside."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.rollout.sampling import Sampling, sample, sample_key
from tests.checkpoints import chat_tokenizer, tiny_decoder

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_prompts(tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(tiny_decoder(tmp_path_factory.mktemp("sampling") / "llama",
                                                              layers=2)).eval()
    tok = chat_tokenizer()
    prompts = [tok(t)["input_ids"] for t in ("What is two plus", "The quick brown fox jumps over", "hi")]
    return model, tok, prompts


def test_greedy_decoding_of_a_left_padded_batch_is_generates(model_and_prompts):
    """top_k=1 draws the likeliest token: the decode (positions, mask, cache) equals
    `model.generate(do_sample=False)` prompt by prompt, though decoded as one padded batch."""
    model, tok, prompts = model_and_prompts
    ours = sample(model, prompts, [1, 2, 3], Sampling(top_k=1), 10, set(), tok.pad_token_id, CPU)
    for prompt, completion in zip(prompts, ours, strict=True):
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        assert completion == theirs


def test_a_completion_is_the_same_whatever_it_is_decoded_beside(model_and_prompts):
    model, tok, prompts = model_and_prompts
    repeated = [p for p in prompts for _ in range(2)]
    keys = [sample_key(7, 3, j, g) for j in range(len(prompts)) for g in range(2)]
    told = []
    together = sample(model, repeated, keys, Sampling(temperature=0.9, top_p=0.95), 12, {tok.eos_token_id},
                      tok.pad_token_id, CPU, on_token=told.append)
    alone = [sample(model, [p], [k], Sampling(temperature=0.9, top_p=0.95), 12, {tok.eos_token_id},
                    tok.pad_token_id, CPU)[0] for p, k in zip(repeated, keys, strict=True)]
    assert together == alone
    assert len({tuple(c) for c in together}) == len(together)  # each generation its own draws
    assert told == list(range(1, len(told) + 1)) and told[-1] == max(len(c) for c in together)


def test_nucleus_and_top_k_keep_the_likeliest_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    kept = Sampling(top_k=2).probabilities(logits)[0] > 0
    assert kept.tolist() == [True, True, False, False]
    probs = Sampling(top_p=0.7).probabilities(logits)[0]  # 0.71 for the first alone: it is kept, the rest cut
    assert (probs > 0).tolist() == [True, False, False, False]
    assert Sampling(top_p=0.75).probabilities(logits)[0][1] > 0  # the first covers 0.71 < 0.75: the second joins
