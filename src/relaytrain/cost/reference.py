"""What a preference objective's reference pass costs (`run.reference`), in closed form.

An objective that compares the policy with a reference (`Objective.needs_reference`: DPO) reads
each row's reference log-prob, computed once before training: one forward-only pass over every
training and held-out row, in the launcher before any worker starts, whatever the strategy. The
model is built once on the host as built (fp32 where nothing keeps it compact, a 4-bit base as
stored; with LoRA the same model, the new adapter at zero: still one pass, no second model), and
streamed through the device a part at a time: a group of strategy.microbatch_size x
strategy.num_microbatches items waits on the device as hidden states while each part visits it
(to the device and back), computing one micro-batch at a time. So the pass costs:

- time: each group, every part's forward on each of its micro-batches, and every part's copy to
  the device and back (nothing hides them: the pass moves a part, then computes); per item, to
  be multiplied by the items of the data, which the planner does not read;
- device memory: the largest part as built, the group's hidden states (fp32: the weights' dtype
  as built) and one micro-batch's working set, a block's forward (its output and the MLP's
  intermediates) or the head's logits with their fp32 copy and its log-softmax, whichever is larger;
- host memory: the model as built, at its peak while built (`ModelFacts.build_peak_bytes`),
  freed before training: the run's host peak is the larger of the pass's and training's.

Every figure is a prediction; the shared formulas are `cost.formulas`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relaytrain.cost.formulas import FP32, ModelFacts
from relaytrain.cost.links import upload_s
from relaytrain.cost.profile import Profile

PARTS = ("embed", "block", "head")


@dataclass(frozen=True)
class ReferenceCost:
    """The reference pass of a run: its seconds a training item (a pair), its device and host
    peaks in bytes, and how many items it holds on the device at once (a group)."""

    seconds_per_item: float
    device_bytes: int
    host_bytes: int
    group: int

    def seconds(self, items: int) -> float:
        """The pass over `items` items (the training and held-out pairs), in whole groups."""
        return -(-items // self.group) * self.group * self.seconds_per_item

    def to_json(self) -> dict:
        return asdict(self)


def reference_cost(facts: ModelFacts, profile: Profile, microbatch: int, group: int, threads: int = 0
                   ) -> ReferenceCost:
    """The pass for micro-batches of `microbatch` items in groups of `group` (strategy.microbatch_size,
    and it times strategy.num_microbatches), on `profile`'s machine with one process of
    `threads` threads (train.threads)."""
    t = profile.for_workers(1, threads)
    forward = {part: facts.part_times(t, part, microbatch).forward_s for part in PARTS}
    compute = group / microbatch * (forward["embed"] + facts.num_layers * forward["block"] + forward["head"])
    moves = 2 * facts.whole(lambda part: upload_s(facts.built_part_bytes(part), profile))  # there and back
    device = max(facts.built_part_bytes(part) for part in range(3)) + hidden_bytes(facts, group) + max(
        block_forward_bytes(facts, microbatch), head_forward_bytes(facts, microbatch))
    return ReferenceCost((compute + moves) / group, int(device), facts.build_peak_bytes(compact_base=False), group)


def hidden_bytes(facts: ModelFacts, items: int) -> int:
    """The hidden states of `items` items between two parts, fp32 as the model is built."""
    return facts.rows(items) * facts.seq_len * facts.hidden * FP32


def block_forward_bytes(facts: ModelFacts, items: int) -> int:
    """What a block's forward without gradients holds at once for `items` items beside its input:
    its output (fp32) and the MLP's intermediates (gated: gate, up and their product; plain: the
    projection and its activation) at the activations' bytes."""
    s = facts.shape
    intermediates = (3 if s.gated_mlp else 2) * s.intermediate * facts.activation_bytes
    return facts.rows(items) * facts.seq_len * (facts.hidden * FP32 + intermediates)


def head_forward_bytes(facts: ModelFacts, items: int) -> int:
    """The head's logits for `items` items as the activations' dtype makes them, their fp32 copy
    where that is another dtype (fp32 logits are their own), and its log-softmax, which each
    row's log-prob is gathered from (`objectives.preference.row_logps`)."""
    logits = facts.rows(items) * facts.logits_per_sample
    copy = FP32 if facts.activation_bytes != FP32 else 0
    return logits * (facts.activation_bytes + copy + FP32)
