"""Reward functions for `objective=grpo`, as a user writes them: TRL's signature, so the same file
serves TRL's GRPOTrainer. Each gets the prompts, the completions (a string each, or for chat
prompts a list holding the assistant's turn), the completions' token ids, and every other column
of the prompts' records by name (here `answer`); it returns one float per completion, or None
where it has nothing to say.

    relaytrain train ... objective=grpo objective.rewards=[examples.rewards:correct,examples.rewards:brief]
"""

import re


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs):
    """1 when the first number in the reply is the record's answer, else 0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        number = re.search(r"-?\d+", _text(completion))
        rewards.append(1.0 if number and number.group() == expected else 0.0)
    return rewards


def brief(prompts, completions, completion_ids, **kwargs):
    """A small bonus for short replies: 0.2 at no tokens, falling to 0 at 20."""
    return [0.2 * max(0.0, 1 - len(ids) / 20) for ids in completion_ids]
