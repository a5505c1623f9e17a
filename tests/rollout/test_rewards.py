"""The reward functions of objective=grpo against TRL 1.16's GRPOTrainer semantics: how a function is
loaded and called, how scores are weighted and summed, the advantages, the logged figures, the
built-ins, and every way a function or a config can be wrong, each as one line.

The expected advantages are TRL's formula (GRPOTrainer._generate_and_score_completions,
"sum_then_normalize") written out here over TRL's own `nanstd`. That helper is read from the
installed trl/trainer/utils.py rather than imported: importing trl takes ~10 s (transformers, peft,
bitsandbytes), the function itself needs only torch.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from relaytrain.rollout import rewards as R
from relaytrain.rollout.rewards import RewardFailed, Rewards, advantages, figures
from relaytrain.utils.errors import ConfigError

HERE = "tests.rollout.test_rewards"


def _trl_nanstd():
    """TRL's own `nanstd`, compiled from its installed source."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed (the dev extra has it)")
    source = (Path(spec.origin).parent / "trainer" / "utils.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "nanstd")
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], type_ignores=[]), "trl/trainer/utils.py", "exec"), namespace)
    return namespace["nanstd"]


def trl_advantages(rewards: torch.Tensor, group: int, scale: str):
    """GRPOTrainer's "sum_then_normalize" lines, over TRL's nanstd."""
    nanstd = _trl_nanstd()
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


# --- a user's reward functions, loaded by import path as a config would name them ------------------

CALLS: list[dict] = []


def length_times_difficulty(prompts, completions, completion_ids, difficulty, **kwargs):
    """Scores by the completion's token count times the record's difficulty; records what it got."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "difficulty": difficulty, **kwargs})
    return [len(ids) * d for ids, d in zip(completion_ids, difficulty, strict=True)]


def only_short(prompts, completions, **kwargs):
    """Declines (None) every completion longer than five characters."""
    return [1.0 if len(c) <= 5 else None for c in completions]


def picky(prompts, completions, **kwargs):
    """Raises (a two-line message) on a completion that says boom."""
    for c in completions:
        if "boom" in c:
            raise ValueError(f"cannot score {c!r}\nsecond line of the message")
    return [0.0] * len(completions)


def batch_only(prompts, completions, **kwargs):
    """Fails only on a batch of more than one: no single record is to blame."""
    if len(completions) > 1:
        raise RuntimeError("batches are not supported")
    return [1.0]


def one_short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def wordy(prompts, completions, **kwargs):
    return [0.5 if i != 2 else "high" for i in range(len(completions))]


NOT_A_FUNCTION = 3


def call(rewards: Rewards, completions, **columns):
    n = len(completions)
    return rewards.score([f"prompt {i}" for i in range(n)], completions, [[7] * (i + 1) for i in range(n)],
                         columns, [f"data.path line {i + 1}" for i in range(n)])


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- loading, calling, weighting ------------------------------------------------------------------------

def test_a_users_function_loads_by_path_and_is_called_with_the_columns():
    CALLS.clear()
    rewards = Rewards.load([f"{HERE}:length_times_difficulty", "exact_answer"], [0.5, 2.0])
    assert rewards.names == ("length_times_difficulty", "exact_answer")
    assert rewards.weights.dtype == torch.float32 and rewards.weights.tolist() == [0.5, 2.0]
    scores = call(rewards, ["4", " 5 ", "6"], difficulty=[1.0, 2.0, 3.0], answer=["4", 5, "7"])
    assert scores.dtype == torch.float32 and scores.shape == (3, 2)
    assert scores.tolist() == [[1.0, 1.0], [4.0, 1.0], [9.0, 0.0]]  # len(ids) * difficulty; stripped equality
    (got,) = CALLS  # one batched call, as TRL makes it, with every column by name
    assert got["prompts"] == ["prompt 0", "prompt 1", "prompt 2"]
    assert got["completion_ids"] == [[7], [7, 7], [7, 7, 7]]
    assert got["difficulty"] == [1.0, 2.0, 3.0] and got["answer"] == ["4", 5, "7"]
    assert rewards.total(scores).tolist() == [2.5, 4.0, 4.5]


def test_default_weights_are_one_and_a_single_name_is_a_list():
    rewards = Rewards.load("exact_answer", None)
    assert rewards.names == ("exact_answer",) and rewards.weights.tolist() == [1.0]


def test_none_is_nan_and_a_row_no_function_scored_is_unscorable():
    rewards = Rewards.load([f"{HERE}:only_short", "exact_answer"], [2.0, 3.0])
    scores = call(rewards, ["4", "a long one", "a long one", "5"], answer=["4", "x", None, None])
    expected = torch.tensor([[1.0, 1.0], [math.nan, 0.0], [math.nan, math.nan], [1.0, math.nan]])
    torch.testing.assert_close(scores, expected, equal_nan=True)
    total = rewards.total(scores)
    # nansum over the functions that scored; NaN (not 0) where none did, so the baseline leaves it out
    torch.testing.assert_close(total, torch.tensor([5.0, 0.0, math.nan, 2.0]), equal_nan=True)


# --- advantages and figures against TRL's numbers -----------------------------------------------------

# two groups of four: a spread one with an unscorable completion, a zero-std one; then a group with a
# single scorable completion (std NaN) and a group with none at all
REWARDS = torch.tensor([1.0, 0.0, math.nan, 3.0, 2.0, 2.0, 2.0, 2.0,
                        0.5, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    got, zero = advantages(REWARDS, 4, scale)
    want, want_zero = trl_advantages(REWARDS, 4, scale)
    torch.testing.assert_close(got, want)
    assert zero.tolist() == want_zero.tolist()
    assert not torch.isnan(got).any()
    assert got[2] == 0 and (got[8:] == 0).all()  # unscorable, alone in its group, or a group of none
    if scale != "batch":
        assert zero[4:8].all() and not zero[:4].any()  # the equal group teaches nothing


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0])
    got, zero = advantages(rewards, 2, "group")
    std = math.sqrt(2.0)  # unbiased: ((1-2)^2 + (3-2)^2) / (2-1)
    torch.testing.assert_close(got, torch.tensor([-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0, 0.0]))
    assert zero.tolist() == [False, False, True, True]
    got, _ = advantages(rewards, 2, "none")
    assert got.tolist() == [-1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        advantages(rewards, 3, "group")
    with pytest.raises(ValueError, match="not one of"):
        advantages(rewards, 2, "global")


def test_figures_are_trls_names_and_values():
    nanstd = _trl_nanstd()
    scores = torch.tensor([[1.0, math.nan], [0.0, 2.0], [math.nan, 4.0], [math.nan, math.nan]])
    rewards = torch.tensor([1.0, 2.0, 4.0, math.nan])
    _, zero = advantages(rewards, 2, "group")
    got = figures(["a", "b"], scores, rewards, zero)
    assert list(got) == ["rewards/a/mean", "rewards/a/std", "rewards/b/mean", "rewards/b/std", "reward",
                         "reward_std", "frac_reward_zero_std"]
    assert got["rewards/a/mean"] == pytest.approx(0.5) and got["rewards/b/mean"] == pytest.approx(3.0)
    assert got["rewards/a/std"] == pytest.approx(nanstd(scores[:, 0]).item())
    assert got["rewards/b/std"] == pytest.approx(math.sqrt(2.0))
    assert got["reward"] == pytest.approx(7 / 3) and got["reward_std"] == pytest.approx(nanstd(rewards).item())
    assert got["frac_reward_zero_std"] == 0.0  # the second group has one value: std NaN, not zero


# --- a function that fails: one line, the function, the record --------------------------------------

def test_a_raise_names_the_function_the_record_and_the_first_line():
    rewards = Rewards.load([f"{HERE}:picky"], None)
    with pytest.raises(RewardFailed) as err:
        call(rewards, ["fine", "fine", "boom", "boom"])
    message = one_line(err)
    assert f"{HERE}:picky" in message and "data.path line 3" in message
    assert "ValueError: cannot score 'boom'" in message and "second line" not in message
    assert isinstance(err.value, ConfigError)  # printed as one line, exit 2


def test_a_raise_no_one_record_causes_names_none():
    rewards = Rewards.load([f"{HERE}:batch_only"], None)
    with pytest.raises(RewardFailed) as err:
        call(rewards, ["a", "b"])
    message = one_line(err)
    assert f"{HERE}:batch_only raised: RuntimeError: batches are not supported" in message
    assert "line" not in message.split(";")[0]


def test_wrong_count_and_non_numbers_are_refused():
    with pytest.raises(RewardFailed) as err:
        call(Rewards.load([f"{HERE}:one_short"], None), ["a", "b", "c"])
    assert f"{HERE}:one_short returned 2 values for 3 completions" in one_line(err)
    with pytest.raises(RewardFailed) as err:
        call(Rewards.load([f"{HERE}:wordy"], None), ["a", "b", "c"])
    message = one_line(err)
    assert f"{HERE}:wordy returned 'high' (a str) on data.path line 3" in message


def test_a_builtin_without_its_column_names_the_column():
    with pytest.raises(RewardFailed) as err:
        call(Rewards.load(["contains_answer"], None), ["a"], question=["q"])
    message = one_line(err)
    assert "relaytrain.rollout.rewards:contains_answer" in message and "'answer' column" in message


# --- a config that is wrong: one line naming the key and the fix -------------------------------------

@pytest.mark.parametrize("paths, weights, says", [
    (["exact_anser"], None, "objective.rewards: 'exact_anser' is not a built-in reward"),
    (["exact_anser"], None, "did you mean exact_answer?"),
    ([f"{HERE}_missing:fn"], None, f"objective.rewards: cannot import {HERE}_missing:fn (No module named"),
    ([f"{HERE}:no_such_fn"], None, f"cannot import {HERE}:no_such_fn"),
    ([f"{HERE}:NOT_A_FUNCTION"], None, f"objective.rewards: {HERE}:NOT_A_FUNCTION is not a function (it is a int object)"),
    ([], None, "objective.rewards=[] names no reward function"),
    (["exact_answer", "format_regex"], [1.0], "objective.reward_weights=[1.0] gives 1 weights for 2 reward"),
    (["exact_answer"], ["heavy"], "objective.reward_weights=[heavy]: could not convert"),
])
def test_config_mistakes_are_one_line(paths, weights, says):
    with pytest.raises(ConfigError) as err:
        Rewards.load(paths, weights)
    assert says in one_line(err)


def test_math_answer_without_math_verify_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # find_spec answers None: not installed
    with pytest.raises(ConfigError) as err:
        Rewards.load(["math_answer"], None)
    assert "math_answer needs math_verify" in one_line(err) and "pip install 'relaytrain[rl]'" in str(err.value)


# --- the built-ins, on strings and on conversations ----------------------------------------------------

def convo(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("wrap", [str, convo], ids=["string", "conversation"])
def test_builtins(wrap):
    texts = [" 42\n", "it is 42.", "41", "anything"]
    answers = ["42", 42, "42", None]
    completions = [wrap(t) for t in texts]
    assert R.exact_answer(None, completions, answer=answers) == [1.0, 0.0, 0.0, None]
    assert R.contains_answer(None, completions, answer=answers) == [1.0, 1.0, 0.0, None]
    formatted = [wrap("<think>a\nb</think>\n<answer>42</answer>"), wrap("<answer>42</answer>"),
                 wrap("<think>x</think><answer>1</answer> trailing")]
    assert R.format_regex(None, formatted) == [1.0, 0.0, 0.0]
    assert R.format_regex(None, formatted, format_pattern=[r"<think>.*", r"<answer>\d+</answer>", None]) == [
        0.0, 1.0, 0.0]  # the pattern is the record's, the default where it gives none


def test_completion_text_takes_the_last_assistant_message():
    assert R.completion_text("plain") == "plain"
    assert R.completion_text([{"role": "tool", "content": "t"}, {"role": "assistant", "content": "a"}]) == "a"
    assert R.completion_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]) == "x"
    with pytest.raises(TypeError):
        R.completion_text(42)


def test_math_answer_on_latex():
    pytest.importorskip("math_verify")
    completions = [r"So the answer is $\boxed{\frac{1}{3}}$.", r"The answer is \boxed{\frac{1}{2}}",
                   r"$\boxed{0.5}$", r"I think \boxed{2x+1}", "no idea", r"\boxed{3}"]
    solutions = [r"$\frac{1}{3}$", r"$\frac{1}{3}$", r"$\frac{1}{2}$", r"$1+2x$", r"$4$", "not math at all ]]"]
    got = R.math_answer(None, [convo(c) for c in completions], solution=solutions)
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0, None]  # an unparseable reference declines (TRL's accuracy_reward)
    rewards = Rewards.load(["math_answer"], None)  # through load and score, reading `answer` without `solution`
    scores = call(rewards, completions[:2], answer=[r"$\frac{1}{3}$", None])
    torch.testing.assert_close(scores, torch.tensor([[1.0], [math.nan]]), equal_nan=True)
