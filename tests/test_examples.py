"""The files in examples/ as the README's commands use them: each one, on a user's own checkpoint
(`model.pretrained=DIR` with the README's keys and nothing else but a short run), fills at least
one minibatch of its strategy's default shape and trains. A README command that stops at
"fewer than one minibatch" on the project's own example is a broken first step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaytrain.commands.cli import main
from tests.checkpoints import tiny_decoder

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The README's commands on the example files, as given there (its DIR is the checkpoint below).
COMMANDS = {
    "chat": ["data=chat", f"data.path={EXAMPLES / 'chat.jsonl'}", "strategy=l2l"],
    "dpo": ["objective=dpo", "data=preference", f"data.path={EXAMPLES / 'preference.jsonl'}", "adapter=lora",
            "strategy=l2l"],
    "kto": ["objective=kto", "data=preference", f"data.path={EXAMPLES / 'preference.jsonl'}", "strategy=l2l"],
    "reward": ["objective=reward", "data=preference", f"data.path={EXAMPLES / 'preference.jsonl'}"],
    "grpo": ["objective=grpo", "data=prompts", f"data.path={EXAMPLES / 'prompts.jsonl'}",
             "objective.rewards=[examples.rewards:correct,examples.rewards:brief]", "objective.num_generations=8",
             "objective.max_completion_length=8", "adapter=lora", "strategy=l2l"],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_decoder(tmp_path_factory.mktemp("examples") / "llama", layers=2)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_example_fills_a_minibatch_of_its_readme_command(checkpoint, tmp_path, monkeypatch, command):
    monkeypatch.syspath_prepend(str(EXAMPLES.parent))  # the rewards are imported as examples.rewards
    run_dir = tmp_path / command
    assert main(["train", f"model.pretrained={checkpoint}", *COMMANDS[command], "data.seq_len=64",
                 "train.steps=1", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}"]) == 0
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 1
