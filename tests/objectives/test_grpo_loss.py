"""`objective=grpo`'s loss equals TRL's GRPOTrainer's (`_compute_loss`) on the same completions:
its value and every gradient, for each loss type, with and without the KL term, on the policy's
own log-probs (one update a rollout batch) and on an older policy's (num_iterations > 1),
accumulated over micro-batches as relaytrain's strategies divide them (`LossTerms.over`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.objectives import objective
from relaytrain.objectives.base import Divisor
from relaytrain.rollout.sampling import Sampling, sample, sample_key
from tests.checkpoints import chat_tokenizer, tiny_decoder
from tests.objectives.grpo_reference import trl_inputs, trl_scoring, trl_token_logps, trl_trainer

G, PROMPTS_PER_MICROBATCH, MICROBATCHES, LENGTH, SEQ = 3, 2, 2, 6, 24
ENDS = set(range(40))  # the test's end tokens: about half the completions end within LENGTH, the rest are cut


def grpo(**settings):
    base = {"num_generations": G, "max_completion_length": LENGTH, "temperature": 0.9, "top_p": 1.0, "top_k": 0,
            "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "num_iterations": 1, "loss_type": "dapo",
            "scale_rewards": "group", "mask_truncated_completions": False, "rewards": ["exact_answer"],
            "reward_weights": None, "rollout_engine": "builtin"}
    return objective("grpo").configured({**base, **settings})


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A tiny Llama, its tokenizer, and a minibatch of completions sampled from it (some cut at LENGTH)."""
    root = tmp_path_factory.mktemp("grpo_loss")
    model = AutoModelForCausalLM.from_pretrained(tiny_decoder(root / "llama", layers=2))
    tok = chat_tokenizer()
    texts = ["What is two plus two?", "Hello there", "The quick brown fox", "How can I help you today?"]
    prompts = [tok(t)["input_ids"] for t in texts]
    repeated = [p for p in prompts for _ in range(G)]
    keys = [sample_key(0, 0, j, g) for j in range(len(prompts)) for g in range(G)]
    completions = sample(model.eval(), repeated, keys, Sampling(temperature=0.9), LENGTH, ENDS,
                         tok.pad_token_id, torch.device("cpu"))
    advantages = torch.randn(len(completions), generator=torch.Generator().manual_seed(1))
    return model, tok, repeated, completions, advantages, root


def rows_of(tok, prompts, completions, advantages, masked):
    """relaytrain's rows of these completions: the prompt, then the completion, right-padded."""
    n = len(prompts)
    ids = torch.full((n, SEQ), tok.pad_token_id)
    labels = torch.full((n, SEQ), -100)
    mask = torch.zeros((n, SEQ), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, :len(p)] = 1
        if not masked[i]:
            mask[i, len(p):len(p) + len(c)] = 1
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    from relaytrain.models.layered import MicroBatch
    return MicroBatch(input_ids=ids, labels=labels, attention_mask=mask, record=torch.arange(n),
                      advantage=advantages.float())


def at_positions(values: torch.Tensor, prompts, completions) -> torch.Tensor:
    """TRL's per-completion-token values [rows, completion width] at relaytrain's row positions [rows, SEQ]."""
    out = torch.zeros((len(prompts), SEQ))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out[i, len(p):len(p) + len(c)] = values[i, :len(c)]
    return out


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# Each loss type on the policy's own log-probs, and with the KL term against an older policy; two
# cases in the default suite (a TRL trainer each), the rest in the slow step.
DEFAULT_CASES = {("dapo", False), ("grpo", True)}
CASES = [pytest.param(loss_type, beta, older, id=f"{'kl-and-old-policy' if older else 'own-logps'}-{loss_type}",
                      marks=() if (loss_type, older) in DEFAULT_CASES else pytest.mark.slow)
         for beta, older in ((0.0, False), (0.04, True)) for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo")]


@pytest.mark.parametrize("loss_type, beta, older", CASES)
def test_the_loss_and_its_gradients_equal_trls(setting, loss_type, beta, older):
    model, tok, prompts, completions, advantages, root = setting
    masked = [c[-1] not in ENDS for c in completions]
    assert 0 < sum(masked) < len(masked)
    masked = [m and loss_type == "dapo" for m in masked]  # mask_truncated_completions on one loss type
    chosen = grpo(loss_type=loss_type, beta=beta, mask_truncated_completions=loss_type == "dapo")
    rows_per_mb = PROMPTS_PER_MICROBATCH * G
    trainer = trl_trainer(model, tok, root / f"trl-{loss_type}-{beta}", microbatch_rows=rows_per_mb,
                          accumulate=MICROBATCHES, generations=G, completion_length=LENGTH, loss_type=loss_type,
                          beta=beta, epsilon=0.2, temperature=0.9, mask_truncated_completions=loss_type == "dapo")
    # An older policy (num_iterations > 1) and a reference: the same model with its weights moved a little.
    other = AutoModelForCausalLM.from_pretrained(root / "llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trl_scoring(trainer, other.eval())
    slices = [slice(k * rows_per_mb, (k + 1) * rows_per_mb) for k in range(MICROBATCHES)]
    tokens = sum(len(c) for c, m in zip(completions, masked, strict=True) if not m)

    model.train()
    model.zero_grad()
    trl_loss = 0.0
    trl_batches = []
    for s in slices:
        inputs = trl_inputs(trainer, prompts[s], completions[s], advantages[s], tokens, masked[s],
                            old=(lambda i: trl_token_logps(trainer, other, i)) if older else None,
                            ref=(lambda i: trl_token_logps(trainer, other, i)) if beta else None)
        trl_batches.append(inputs)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        trl_loss += float(loss.detach())
    theirs = gradients(model)

    model.zero_grad()
    mbs = [rows_of(tok, prompts[s], completions[s], advantages[s], masked[s]) for s in slices]
    for mb, inputs, s in zip(mbs, trl_batches, slices, strict=True):
        if older:
            mb.old_logps = at_positions(inputs["old_per_token_logps"], prompts[s], completions[s])
        if beta:
            mb.ref_token_logps = at_positions(inputs["ref_per_token_logps"], prompts[s], completions[s])
    divisor = Divisor(items=sum(chosen.items(mb) for mb in mbs), microbatches=len(mbs))
    ours = 0.0
    for mb in mbs:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        loss = chosen.loss(logits, mb).over(divisor)
        loss.backward()
        ours += float(loss.detach())
    mine = gradients(model)

    assert ours == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("settings, says", [
    ({"loss_type": "sapo"}, "objective.loss_type=sapo is one of TRL's GRPO losses"),
    ({"loss_type": "sigmoid"}, "objective.loss_type=sigmoid is not a GRPO loss"),
    ({"num_generations": 1}, "objective.num_generations=1"),
    ({"temperature": 0.0}, "objective.temperature=0.0 must be positive"),
    ({"top_p": 0.0}, "objective.top_p=0.0"),
    ({"scale_rewards": "sometimes"}, "objective.scale_rewards=sometimes"),
    ({"rewards": []}, "objective=grpo needs rewards"),
    ({"rollout_engine": "sglang"}, "objective.rollout_engine=sglang"),
])
def test_bad_settings_are_one_line_each(settings, says):
    from relaytrain.utils.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        grpo(**settings)
    assert says in str(err.value) and "\n" not in str(err.value)
