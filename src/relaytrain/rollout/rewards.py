"""The reward functions of `objective=grpo`: loading them, calling them, and turning their scores
into advantages and the logged figures, with the semantics of TRL's GRPOTrainer (trl 1.16).

`objective.rewards` lists the functions: `package.module:function` (a user's, imported here and in
every worker) or the short name of a built-in (`BUILTINS`). What they share with TRL:

- a function is called once per batch as `fn(prompts=, completions=, completion_ids=, **columns)`,
  `columns` being the records' other columns, one value per completion, and returns one value per
  completion; `None` means "not mine to score" and becomes NaN;
- the scores are weighted (`objective.reward_weights`, default 1.0 each) and summed ignoring NaN;
  a completion every function declined is unscorable: its reward stays NaN, it is left out of its
  group's baseline, and its advantage is 0 ("sum_then_normalize");
- an advantage is the reward less its group's mean, divided by the group's (or the batch's) unbiased
  standard deviation + 1e-4, or not divided (`scale`: group, batch, none);
- the logged names: `rewards/<name>/mean|std`, `reward`, `reward_std`, `frac_reward_zero_std`, where
  `<name>` is the function's `__name__`.

Where relaytrain differs, it says more: a function that fails stops the run with one line naming the
function and the record it failed on (`RewardFailed`), where TRL raises the function's own traceback.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import numbers
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from relaytrain.rollout import reward_model
from relaytrain.utils.errors import ConfigError, first_line

SCALES = ("group", "batch", "none")
EPS = 1e-4  # TRL's: keeps a group whose rewards are all equal at advantage 0 rather than 0/0
DEFAULT_FORMAT = r"(?s)<think>.*?</think>\s*<answer>.*?</answer>"
RL_EXTRA = "pip install 'relaytrain[rl]'"


# A ConfigError, not a RuntimeError: the fault is in the user's own function or data and the fix is
# theirs, so it is reported like every other fixable mistake (one line on stderr, exit 2, no
# traceback), as TrainingDiverged is; the trainer stops with the last checkpoint intact.
class RewardFailed(ConfigError):
    """A reward function raised, or returned something other than one number (or None) per completion."""


# ---------------------------------------------------------------------------------------------------
# The built-ins: plain functions with TRL's signature, so a user can read one and write their own.


def completion_text(completion) -> str:
    """The text of a completion: a string, or a conversation (a list of messages, the answer being
    the last assistant message's content, which may itself be a list of text parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, Sequence) and completion and all(isinstance(m, dict) for m in completion):
        answers = [m for m in completion if m.get("role", "assistant") == "assistant"] or list(completion)
        content = answers[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, Sequence):  # multimodal: [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if content is None:
            return ""
    raise TypeError(f"a completion is a string or a list of messages, not {type(completion).__name__}")


def _column(kwargs: dict, names: tuple[str, ...], function: str) -> list:
    """The first of `names` the records have: a built-in reads its reference from a column, and a
    dataset without one is a mistake in the config, not in one record."""
    for name in names:
        if name in kwargs:
            return kwargs[name]
    needed = " or ".join(repr(name) for name in names)
    raise ConfigError(f"the prompts' records have no {needed} column, which {function} reads; add it to the "
                      f"data, or drop {function} from objective.rewards")


def _reference(value) -> str | None:
    """A record's reference answer as text, or None when it has none (an empty one counts as none:
    every text contains the empty string, so it would reward anything)."""
    text = "" if value is None else str(value).strip()
    return text or None


def exact_answer(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 when the completion's text, stripped, is the record's `answer`; None without one."""
    answers = _column(kwargs, ("answer",), "exact_answer")
    rewards: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        gold = _reference(answer)
        rewards.append(None if gold is None else float(completion_text(completion).strip() == gold))
    return rewards


def contains_answer(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 when the record's `answer`, stripped, occurs in the completion's text; None without one."""
    answers = _column(kwargs, ("answer",), "contains_answer")
    rewards: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        gold = _reference(answer)
        rewards.append(None if gold is None else float(gold in completion_text(completion)))
    return rewards


def format_regex(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion's whole text matches the record's `format_pattern` (or, without that
    column or with an empty value, `DEFAULT_FORMAT`: reasoning in <think>, then an <answer>)."""
    patterns = kwargs.get("format_pattern") or [None] * len(completions)
    return [float(re.fullmatch(pattern or DEFAULT_FORMAT, completion_text(completion)) is not None)
            for completion, pattern in zip(completions, patterns, strict=True)]


def math_answer(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer (a \\boxed{} one first, in LaTeX) equal to
    the record's `solution` (or `answer`); None when that reference does not parse, as TRL's
    `accuracy_reward` does."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    golds = _column(kwargs, ("solution", "answer"), "math_answer")
    # math-verify times out with signal.alarm, which only the main thread may set (TRL's reasoning)
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    # the completion must give its answer in well-formed LaTeX, a \boxed{} one tried first
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                        boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards: list[float | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        gold_parsed = parse(str(gold), parsing_timeout=parse_timeout) if _reference(gold) else []
        if not gold_parsed:
            rewards.append(None)
            continue
        answer = parse(completion_text(completion), extraction_config=extraction, extraction_mode="first_match",
                       parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold_parsed, answer, timeout_seconds=verify_timeout)))
    return rewards


BUILTINS: dict[str, Callable] = {fn.__name__: fn for fn in (exact_answer, contains_answer, format_regex, math_answer)}
# what a built-in needs installed beyond relaytrain's own requirements: checked when the run loads
# it, so a missing library is one line before training starts rather than a failure at the first rollout
_NEEDS = {"math_answer": ("math_verify", "latex2sympy2_extended")}


# ---------------------------------------------------------------------------------------------------
# Loading and calling.


def display_name(fn: Callable) -> str:
    """The name TRL logs a function under: its `__name__` (a partial's function's), or its class's
    name for a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _origin(fn: Callable) -> str:
    """`module:name`, what an error calls a function by (a user may have two named alike)."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    module = getattr(inner, "__module__", None) or type(inner).__module__
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"{module}:{name}"


def _load_one(path: str, models: bool = True) -> Callable:
    spec = str(path).strip()
    if spec.startswith(reward_model.PREFIX):  # a trained reward model: model:DIR
        directory = spec[len(reward_model.PREFIX):]
        return reward_model.RewardModel(directory) if models else reward_model.checked(directory)
    if ":" not in spec:
        if spec in BUILTINS:
            missing = [m for m in _NEEDS.get(spec, ()) if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(f"objective.rewards: {spec} needs {', '.join(missing)}, which is not installed; "
                                  f"{RL_EXTRA}")
            return BUILTINS[spec]
        hint = difflib.get_close_matches(spec, BUILTINS, n=1)
        fix = f"did you mean {hint[0]}? " if hint else ""
        raise ConfigError(f"objective.rewards: {spec!r} is not a built-in reward ({', '.join(BUILTINS)}); {fix}"
                          f"(or give a function of your own as package.module:function)")
    module, _, attribute = spec.partition(":")
    try:
        fn = _import_module(module)
        for part in attribute.split("."):  # a function in a class or namespace: module:Holder.fn
            fn = getattr(fn, part)
    except (ImportError, AttributeError, ValueError) as err:  # ValueError: an empty module name
        raise ConfigError(f"objective.rewards: cannot import {spec} ({first_line(err)}); give "
                          f"package.module:function, importable here and in every worker") from err
    if not callable(fn):
        raise ConfigError(f"objective.rewards: {spec} is not a function (it is a {type(fn).__name__} object); give "
                          f"package.module:function, a function taking (prompts, completions, **kwargs)")
    return fn


def _import_module(module: str):
    """`module`, as Python finds it, else from the working directory: where a user runs
    `relaytrain train ... objective.rewards=[my_rewards:score]` beside their my_rewards.py (the
    console script's own directory, not the working one, heads Python's path)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        if here in sys.path or not (err.name or "").split(".")[0] == module.split(".")[0]:
            raise
        sys.path.append(here)
        return importlib.import_module(module)


def _as_list(value) -> list:
    """A config value as a list: Hydra hands a list as a ListConfig, and a single name as a string."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, numbers.Number)):
        return [value]
    return list(value)


@dataclass(frozen=True, eq=False)  # eq=False: a tensor field has no truth value to compare by
class Rewards:
    """The run's reward functions, their logged names and their weights."""

    functions: tuple[Callable, ...]
    names: tuple[str, ...]  # TRL's: each function's __name__, the <name> of rewards/<name>/mean
    origins: tuple[str, ...]  # module:name, what an error calls each function
    weights: torch.Tensor  # float32 [functions]

    @classmethod
    def load(cls, paths: list[str], weights: list[float] | None = None, models: bool = True) -> Rewards:
        """The functions `objective.rewards` names, weighted by `objective.reward_weights` (all 1.0
        when unset); a mistake in either is one ConfigError line naming the key and the fix.
        `models`: load the reward models it names (False: a config check, which only finds them)."""
        paths = _as_list(paths)
        if not paths:
            raise ConfigError(f"objective.rewards=[] names no reward function; give one or more, built-in "
                              f"({', '.join(BUILTINS)}) or package.module:function, e.g. "
                              f"objective.rewards=[exact_answer]")
        functions = tuple(_load_one(path, models) for path in paths)
        names = tuple(display_name(fn) for fn in functions)
        given = _as_list(weights)
        if weights is None:
            given = [1.0] * len(functions)
        shown = "[" + ",".join(str(w) for w in given) + "]"
        if len(given) != len(functions):
            raise ConfigError(f"objective.reward_weights={shown} gives {len(given)} weights for {len(functions)} "
                              f"reward functions ({', '.join(names)}); give one weight per function in "
                              f"objective.rewards' order, or leave it unset for 1.0 each")
        try:
            values = [float(w) for w in given]
        except (TypeError, ValueError) as err:
            raise ConfigError(f"objective.reward_weights={shown}: {first_line(err)}; give numbers, one per "
                              f"reward function") from err
        return cls(functions, names, tuple(_origin(fn) for fn in functions),
                   torch.tensor(values, dtype=torch.float32))

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              where: list[str]) -> torch.Tensor:
        """Every function's scores, float32 [completions, functions], NaN where one returned None.
        `columns`: the records' other columns, one value per completion; `where`: each completion's
        record as an error names it ("data.path line 12")."""
        n = len(completions)
        lengths = dict(prompts=len(prompts), completion_ids=len(completion_ids), where=len(where),
                       **{f"columns[{key!r}]": len(values) for key, values in columns.items()})
        wrong = {key: length for key, length in lengths.items() if length != n}
        if wrong:  # the caller's mistake, not the user's: every list is one entry per completion
            raise ValueError(f"{n} completions but {wrong}")
        scores = torch.empty(n, len(self.functions), dtype=torch.float32)
        for j, fn in enumerate(self.functions):
            scores[:, j] = self._call(j, fn, prompts, completions, completion_ids, columns, where)
        return scores

    def _call(self, j: int, fn: Callable, prompts, completions, completion_ids, columns, where) -> torch.Tensor:
        name = f"reward {self.origins[j]}"
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except ConfigError as err:  # a missing column, a bad setting: about the whole batch, no one record
            raise RewardFailed(f"{name}: {first_line(err)}") from err
        except Exception as err:
            failed, culprit = self._pin(fn, prompts, completions, completion_ids, columns, where)
            err = culprit or err
            place = f" on {failed}" if failed else ""
            raise RewardFailed(f"{name} raised{place}: {type(err).__name__}: {first_line(err)}; fix the "
                               f"function, or have it return None for a completion it cannot score") from err
        try:
            if isinstance(values, (str, bytes, dict)):  # iterable, but not one value per completion
                raise TypeError
            values = list(values)
        except TypeError:
            raise RewardFailed(f"{name} returned a {type(values).__name__}, not a list of one value per "
                               f"completion ({len(completions)} here)") from None
        if len(values) != len(completions):
            raise RewardFailed(f"{name} returned {len(values)} values for {len(completions)} completions; "
                               f"return exactly one per completion (None for one it does not score)")
        out = []
        for i, value in enumerate(values):
            number = _number(value)
            if number is None:
                raise RewardFailed(f"{name} returned {_shown(value)} (a {type(value).__name__}) on {where[i]}; "
                                   f"return a number, or None for a completion it does not score")
            out.append(number)
        return torch.tensor(out, dtype=torch.float32)

    @staticmethod
    def _pin(fn, prompts, completions, completion_ids, columns, where) -> tuple[str | None, Exception | None]:
        """After a batched call raised: the first record whose completion alone makes `fn` raise, and
        that error, or (None, None) when each alone passes (the fault is in the batch as a whole).
        One call per completion is slow, but it only runs on the way to stopping the run."""
        for i in range(len(completions)):
            try:
                fn(prompts=[prompts[i]], completions=[completions[i]], completion_ids=[completion_ids[i]],
                   **{key: [values[i]] for key, values in columns.items()})
            except Exception as err:
                return where[i], err
        return None, None

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """Each completion's reward [n]: the weighted scores summed ignoring NaN, and NaN where every
        function declined (TRL's "unscorable": left out of the baseline, advantage 0)."""
        weighted = scores * self.weights.to(scores.device).unsqueeze(0)
        rewards = weighted.nansum(dim=1)
        rewards[torch.isnan(scores).all(dim=1)] = torch.nan
        return rewards


def _number(value) -> float | None:
    """A returned value as a float (None -> NaN), or None when it is not a number: a bool counts
    (math-verify's verdicts are), a string does not, whatever it spells."""
    if value is None:
        return float("nan")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):  # int, float, bool, numpy's scalars
        return float(value)
    return None


def _shown(value) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------------
# Advantages and figures.


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaN, unbiased (n - 1), NaN with fewer than two values: TRL's
    `nanstd`, which the group advantages and the logged stds use."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True).to(variance.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def advantages(rewards: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage [n] from the rewards of `total` [n], groups of `group` consecutive
    completions of one prompt: the reward less its group's mean (NaN ignored), divided by the std + 1e-4
    of its group (`scale=group`) or of the whole batch (`batch`), or not divided (`none`); NaN -> 0.
    Also whether each completion's std is zero (a group that teaches nothing), for
    `frac_reward_zero_std`; with `none` that std is the group's."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {', '.join(SCALES)}")
    if group < 1 or rewards.numel() % group:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group}")
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group, and none, whose std is only logged
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    result = rewards - mean
    if scale != "none":
        result = result / (std + EPS)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    # an unscorable completion (NaN reward), or one alone in its group, carries no signal: advantage 0
    return torch.nan_to_num(result, nan=0.0), std_is_zero


def figures(names: Sequence[str], scores: torch.Tensor, rewards: torch.Tensor,
            std_is_zero: torch.Tensor) -> dict[str, float]:
    """TRL's logged figures of one batch: each function's mean and std over the completions it
    scored, the reward's mean and std over the scorable ones, the fraction with a zero std."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        column = scores[:, i].float()
        out[f"rewards/{name}/mean"] = torch.nanmean(column).item()
        out[f"rewards/{name}/std"] = nanstd(column).item()
    # keywords, not quoted keys: a bare "reward" would read as the objective of that name to
    # tests/test_architecture.py, which keeps objectives' names inside objectives/
    out.update(reward=torch.nanmean(rewards.float()).item(), reward_std=nanstd(rewards.float()).item(),
               frac_reward_zero_std=std_is_zero.float().mean().item())
    return out
