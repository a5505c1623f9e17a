"""A trained reward model as one of GRPO's rewards: `objective.rewards=[model:DIR]`.

DIR is a sequence classifier with one output, as `objective=reward` saves one (or any
`AutoModelForSequenceClassification` checkpoint of one label, with its tokenizer). It scores each
prompt with its completion as TRL's GRPOTrainer scores with a reward model: a conversation is the
prompt's turns and the completion's assistant turn rendered by the reward model's own chat
template, text is the prompt and the completion joined; the texts are tokenized as they are (no
special tokens added), right-padded, and the score is the head's output, logit 0. It is named in
the figures by its directory's last part, as TRL names a reward model by its checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relaytrain.utils.errors import ConfigError, first_line

PREFIX = "model:"


def checked(directory: str):
    """What a config check takes of `model:DIR` before any work: that DIR is a directory (the
    model loads when the run starts); a stand-in under the name the figures will use."""
    _directory(directory)

    def unloaded(prompts, completions, **kwargs):
        raise RuntimeError("a reward model checked, not loaded")

    unloaded.__name__ = Path(directory).expanduser().resolve().name
    return unloaded


def _directory(directory: str) -> Path:
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"objective.rewards={PREFIX}{directory}: no such directory; give a reward model saved by "
                          f"objective=reward (train.save_model=true) or any one-label sequence classifier")
    return path


class RewardModel:
    """A reward function of TRL's signature that scores with a sequence classifier."""

    def __init__(self, directory: str):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = _directory(directory)
        key = f"objective.rewards={PREFIX}{directory}"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval().requires_grad_(False)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{key}: cannot load a sequence classifier and its tokenizer there "
                              f"({first_line(err)})") from err
        if self.model.config.num_labels != 1:
            raise ConfigError(f"{key} has {self.model.config.num_labels} labels; a reward model scores with one "
                              f"(objective=reward trains one)")
        self.__name__ = path.resolve().name  # TRL's name of a reward model in the figures
        self.__qualname__ = f"{PREFIX}{directory}"

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each prompt with its completion, as the reward model reads it (TRL's way)."""
        if isinstance(prompts[0], list):
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in
                    zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        batch = self.tokenizer(self.texts(prompts, completions), return_tensors="pt", padding=True,
                               padding_side="right", add_special_tokens=False)
        device = next(self.model.parameters()).device
        return self.model(**batch.to(device)).logits[:, 0].float().tolist()

    def to(self, device: torch.device) -> RewardModel:
        self.model.to(device)
        return self
