"""The rollout stage: a minibatch of prompts in, the rows an online objective trains on out.

Each time a rollout batch is due (every `num_iterations` steps) the stage takes the loader's
prompts for it, samples `num_generations` completions of each from the policy as it is now
(`sampling.sample`, keyed: the same completions whichever strategy holds the weights), scores
them with the rewards (`rewards.Rewards`), takes each completion's advantage over its group, and
lays each completion out as a row: the prompt, then the completion up to and including its end
token, labelled on the completion. A micro-batch of rows holds its prompts' whole groups, in
TRL's order (a prompt's G completions together). With `num_iterations` > 1 the rows also carry
the sampling policy's token log-probs (`old_logps`), and with `beta` > 0 the reference's
(`ref_token_logps`), both from a forward of that model over the rows, as TRL computes them
(`scoring`: a relayed model's micro-batches together, each block streamed once).

What was sampled goes to `rollouts.jsonl` in the run directory (one record a completion) and
the rewards' figures to the step's metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from relaytrain.models.layered import Draw, MicroBatch, eval_mode
from relaytrain.rollout import sampling, scoring
from relaytrain.rollout.reward_model import RewardModel
from relaytrain.rollout.rewards import Rewards, advantages, figures
from relaytrain.schema.row import IGNORE_INDEX

ROLLOUTS_FILE = "rollouts.jsonl"
EVALUATION_BATCHES = 1 << 40  # an evaluation after step s samples as batch 2**40 + s: apart from every training batch


@dataclass
class Completion:
    """One sampled completion and where it came from."""

    record: int  # its prompt's record number (`TokenDataset.records`)
    prompt_ids: list[int]
    ids: list[int]  # the completion's tokens, up to and including the end token
    truncated: bool  # no end token within max_completion_length


@dataclass
class RolloutBatch:
    """One rollout batch: the rows of every micro-batch (no draw key: each step puts its own)
    and, on the reporter, the step's figures."""

    batch: int
    rows: list[MicroBatch]
    figures: dict[str, float]


class RolloutStage:
    """Makes the rows of each rollout batch (see the module's docstring), the same on every process."""

    def __init__(self, objective, records: list[dict], tokenizer, seq_len: int, seed: int,
                 run_dir: Path | None, precision=None, progress: Callable[[str], None] | None = None):
        self.objective = objective
        self.progress = progress  # where a long rollout batch is, for a user watching (`Strategy.progress`)
        self.records = records
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed  # train.seed: what sampling's keys and the rows' dropout keys (the loader's) start from
        self.precision = precision
        # Whether sampling keeps the KV cache on the host (a relay of a policy whose cache does not fit beside it).
        self.cache_on_host = False
        # Whether every prompt of a rollout batch decodes together (a relay: each token streams the
        # model through the device once for all of them), not a micro-batch's at a time.
        self.decode_whole_batch = False
        self.rewards = Rewards.load(list(objective.rewards), None if objective.reward_weights is None
                                    else list(objective.reward_weights))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.end_ids: set[int] = set()
        self.file = None if run_dir is None else Path(run_dir) / ROLLOUTS_FILE
        self.current: RolloutBatch | None = None

    def set_end_ids(self, generation_eos, vocab_size: int) -> None:
        """The tokens that end a completion: the model's generation config's (an end-of-turn
        token), and the tokenizer's eos, as TRL's GRPOTrainer; those the vocabulary has."""
        from relaytrain.data.chat import end_of_turn_id

        given = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        ids = [self.tokenizer.eos_token_id, end_of_turn_id(self.tokenizer), *given]
        self.end_ids = {i for i in ids if i is not None and 0 <= i < vocab_size}

    # -- one step's rows ------------------------------------------------------------------------
    def batch_of(self, step: int) -> int:
        return step // self.objective.num_iterations

    def due(self, step: int) -> bool:
        """Whether `step` needs a rollout batch not made yet."""
        return self.current is None or self.current.batch != self.batch_of(step)

    def rows_for(self, step: int) -> list[MicroBatch]:
        """The current rollout batch's rows keyed for `step` (dropout's draws are the step's)."""
        return [dataclasses.replace(mb, draw=Draw(self.seed, step, k)) for k, mb in enumerate(self.current.rows)]

    def make(self, step: int, prompts: list[MicroBatch], policy: nn.Module, reference: nn.Module | None,
             reporter: bool) -> RolloutBatch:
        """Sample, score and lay out the rollout batch of `step` from `prompts` (the loader's
        minibatch for it), with `policy` (a Hugging Face causal LM holding the current weights)
        and, for the KL term, `reference`."""
        batch = self.batch_of(step)
        self._place_reward_models(policy)
        completions = self._sample(batch, prompts, policy)
        texts, scores, total = self._score(completions, self.records)
        advantage, zero_std = advantages(total, self.objective.num_generations, self.objective.scale_rewards)
        rows = self._rows(completions, advantage, len(prompts))
        if self.objective.num_iterations > 1:
            rows = _given(rows, "old_logps", self._token_logps(policy, rows))
        if self.objective.beta != 0:
            rows = _given(rows, "ref_token_logps", self._token_logps(reference, rows))
        shown_figures = {}
        if reporter:
            shown_figures = {**figures(self.rewards.names, scores, total, zero_std), **_length_figures(completions)}
            self._write(step, completions, texts, scores, total, advantage)
        self.current = RolloutBatch(batch, rows, shown_figures)
        return self.current

    def evaluate(self, step: int, prompts: list[MicroBatch], policy: nn.Module, records: list[dict]) -> dict[str, float]:
        """Held-out prompts' figures after `step` steps: each prompt's G completions sampled from
        the policy (keyed apart from every training batch), scored, and TRL's reward and length
        figures over them; `items`: the prompts. `records`: the held-out set's."""
        self._place_reward_models(policy)
        real = [mb.rows(mb.record >= 0) for mb in prompts]  # not the rows that only fill a micro-batch up
        completions = self._sample(EVALUATION_BATCHES + step, [mb for mb in real if mb.num_samples], policy)
        _, scores, total = self._score(completions, records)
        _, zero_std = advantages(total, self.objective.num_generations, self.objective.scale_rewards)
        return {**figures(self.rewards.names, scores, total, zero_std), **_length_figures(completions),
                "items": sum(mb.num_samples for mb in real)}

    def _place_reward_models(self, policy: nn.Module) -> None:
        """Reward models score where the policy samples (its device)."""
        device = next(policy.parameters()).device
        for fn in self.rewards.functions:
            if isinstance(fn, RewardModel):
                fn.to(device)

    def _score(self, completions: list[Completion], records: list[dict]
               ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """The completions' texts as decoded, each reward's scores [completions, rewards] and
        their weighted sum [completions], TRL's way (the records' other columns passed on)."""
        texts = self.tokenizer.batch_decode([c.ids for c in completions], skip_special_tokens=True)
        held = [records[c.record] for c in completions]
        shown = [_completion(r["prompt"], text) for r, text in zip(held, texts, strict=True)]
        scores = self.rewards.score(
            prompts=[r["prompt"] for r in held], completions=shown, completion_ids=[c.ids for c in completions],
            columns=_columns(held), where=[str(r.get("where", f"record {c.record}")) for r, c in
                                           zip(held, completions, strict=True)])
        return texts, scores, self.rewards.total(scores)

    def make_unsampled(self, step: int, prompts: list[MicroBatch]) -> RolloutBatch:
        """A dry run's rollout batch: every completion as long as it may be (its tokens the pad
        id, counted by the loss), so the rows have the shapes and work of the longest batch."""
        o = self.objective
        completions = [Completion(int(r), row[mask.bool()].tolist(), [self.pad_id] * o.max_completion_length, True)
                       for mb in prompts for row, mask, r in zip(mb.input_ids, mb.attention_mask, mb.record, strict=True)
                       for _ in range(o.num_generations)]
        rows = self._rows(completions, torch.zeros(len(completions)), len(prompts), counted=True)
        zeros = {"old_logps": o.num_iterations > 1, "ref_token_logps": o.beta != 0}
        rows = [dataclasses.replace(mb, **{k: torch.zeros(mb.labels.shape) for k, on in zeros.items() if on})
                for mb in rows]
        self.current = RolloutBatch(self.batch_of(step), rows, {})
        return self.current

    def _sample(self, batch: int, prompts: list[MicroBatch], policy: nn.Module) -> list[Completion]:
        """Every prompt's G completions, prompt by prompt: a micro-batch's prompts decoded together,
        or the whole batch's where `decode_whole_batch` (a relay streams the model once a token)."""
        o = self.objective
        how = sampling.Sampling(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
        device = next(policy.parameters()).device
        groups = [prompts] if self.decode_whole_batch else [[mb] for mb in prompts]
        out, number = [], 0
        with eval_mode(policy):
            for i, group in enumerate(groups):
                told = self._telling(f"sampling micro-batch {i + 1}/{len(groups)}" if len(groups) > 1
                                     else "sampling the rollout batch")
                ids = [row[mask.bool()].tolist() for mb in group
                       for row, mask in zip(mb.input_ids, mb.attention_mask, strict=True)]
                which = [number + i for i in range(len(ids))]
                number += len(ids)
                repeated = [p for p in ids for _ in range(o.num_generations)]
                keys = [sampling.sample_key(self.seed, batch, j, k) for j in which for k in range(o.num_generations)]
                drawn = sampling.sample(policy, repeated, keys, how, o.max_completion_length, self.end_ids,
                                        self.pad_id, device, self._autocast(device), told, self.cache_on_host)
                records = [int(r) for mb in group for r in mb.record for _ in range(o.num_generations)]
                out += [Completion(r, p, c, truncated=not (c and c[-1] in self.end_ids))
                        for r, p, c in zip(records, repeated, drawn, strict=True)]
        return out

    def _telling(self, what: str) -> Callable[[int], None] | None:
        """`on_token` for `sampling.sample`: the progress line's text every 16 tokens."""
        if self.progress is None:
            return None
        length = self.objective.max_completion_length
        return lambda t: self.progress(f"{what}, token {t}/{length}") if t % 16 == 0 else None

    def _rows(self, completions: list[Completion], advantage: torch.Tensor, microbatches: int,
              counted: bool = False) -> list[MicroBatch]:
        """The rows, right-padded to data.seq_len, cut into the minibatch's micro-batches
        (`counted`: every completion labelled, truncated or not)."""
        n = len(completions)
        ids = torch.full((n, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((n, self.seq_len), dtype=torch.long)
        for row, c in enumerate(completions):
            p, k = len(c.prompt_ids), len(c.ids)
            ids[row, :p + k] = torch.tensor(c.prompt_ids + c.ids, dtype=torch.long)
            mask[row, :p] = 1
            if counted or not (c.truncated and self.objective.mask_truncated_completions):  # TRL masks a cut one from attention too
                mask[row, p:p + k] = 1
                labels[row, p:p + k] = torch.tensor(c.ids, dtype=torch.long)
        record = torch.tensor([c.record for c in completions], dtype=torch.long)
        per = n // microbatches
        return [MicroBatch(input_ids=ids[s], labels=labels[s], attention_mask=mask[s], record=record[s],
                           advantage=advantage[s].float().clone())
                for s in (slice(i * per, (i + 1) * per) for i in range(microbatches))]

    def _token_logps(self, model: nn.Module, rows: list[MicroBatch]) -> list[torch.Tensor]:
        """Each micro-batch's labelled tokens' log-probs under `model` at the sampling temperature
        (`scoring.token_logps`: a relayed model's micro-batches scored together)."""
        device = next(model.parameters()).device
        return scoring.token_logps(model, rows, self.objective.temperature, self._autocast(device))

    def _autocast(self, device: torch.device):
        if self.precision is None or self.precision.half is None:
            return None
        return torch.autocast(device_type=device.type, dtype=self.precision.half)

    def figure_names(self) -> list[str]:
        """The names of the figures `make` reports, in order (metrics.csv's columns)."""
        rewards = [f"rewards/{name}/{what}" for name in self.rewards.names for what in ("mean", "std")]
        return [*rewards, *figures_of_total(), *LENGTH_FIGURES]

    # -- what users read ------------------------------------------------------------------------
    def _write(self, step: int, completions: list[Completion], texts: list[str], scores: torch.Tensor,
               total: torch.Tensor, advantage: torch.Tensor) -> None:
        if self.file is None:
            return
        names = self.rewards.names
        with open(self.file, "a", encoding="utf-8") as f:
            for i, (c, text) in enumerate(zip(completions, texts, strict=True)):
                values = {name: _plain(scores[i, j]) for j, name in enumerate(names)}
                line = dict(step=step + 1, prompt=self.records[c.record]["prompt"], completion=text,
                            prompt_ids=c.prompt_ids, completion_ids=c.ids, rewards=values, reward=_plain(total[i]),
                            advantage=float(advantage[i]), truncated=c.truncated)  # keywords: TRL's names as words
                f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def forget_after(self, step: int) -> None:
        """A resumed run continues from `step`: the records of later steps (written before the
        interruption) are dropped, so the file holds each step's completions once."""
        if self.file is None or not self.file.is_file():
            return
        kept = [line for line in self.file.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.file.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _given(rows: list[MicroBatch], field: str, values: list[torch.Tensor]) -> list[MicroBatch]:
    """Each micro-batch with its value of `field`."""
    return [dataclasses.replace(mb, **{field: v}) for mb, v in zip(rows, values, strict=True)]


def _completion(prompt, text: str):
    """A completion as TRL hands it to the rewards: text, or for a conversation the assistant's turn."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def _columns(records: list[dict]) -> dict[str, list]:
    """The records' other columns, one value per completion (TRL's reward kwargs)."""
    names = [k for k in records[0] if k not in ("prompt", "where", "completion", "completion_ids")]
    return {k: [r.get(k) for r in records] for k in names}


def _plain(value: torch.Tensor) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


LENGTH_FIGURES = ("completions/mean_length", "completions/min_length", "completions/max_length",
                  "completions/clipped_ratio")


def figures_of_total() -> list[str]:
    """The names of the summed reward's figures (TRL's), as `rewards.figures` makes them."""
    return [k for k in figures((), torch.zeros(2, 0), torch.zeros(2), torch.zeros(2, dtype=torch.bool))]


def _length_figures(completions: list[Completion]) -> dict[str, float]:
    """TRL's completion-length figures."""
    lengths = torch.tensor([len(c.ids) for c in completions], dtype=torch.float32)
    truncated = torch.tensor([c.truncated for c in completions], dtype=torch.float32)
    values = (lengths.mean(), lengths.min(), lengths.max(), truncated.mean())
    return {name: float(v) for name, v in zip(LENGTH_FIGURES, values, strict=True)}
