"""A stage's weight versions and their update: on the device (`WeightVersions`), or with the
fp32 masters and optimizer state in host memory (`offload.HostVersions`, `strategy.offload=host`).

Both keep one buffer (flush, GPipe) or two (2BW) of working weights where the stage computes,
version v in buffer v % 2, and both answer the runtime the same questions: which module
computes version v (`module`), whether it may yet (`await_version`), apply an update
(`apply`), finish every update in flight (`settle`), and the checkpoint state by Hugging
Face name (`state` / `load_state`), so a checkpoint of one placement resumes under the other.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from relaytrain.records.optimizer_state import load_optimizer_state, optimizer_state
from relaytrain.step.optim import build_optimizer, set_lr
from relaytrain.strategies.base import optimizer_tensors
from relaytrain.strategies.pipeline.stage import StageModule


def version_copies(stage: StageModule, versions: int) -> list[StageModule]:
    """`stage` and `versions - 1` copies of it: the buffers of the weight versions. A frozen
    parameter (an adapter's base) never changes, so every copy shares the stage's one tensor:
    2BW keeps two versions of what trains only."""
    frozen = {id(p): p for p in stage.parameters() if not p.requires_grad}
    return [stage] + [copy.deepcopy(stage, dict(frozen)) for _ in range(versions - 1)]


class VersionBuffers:
    """The working weights: `buffers[v % len(buffers)]` computes version v. The parameters that
    train are listed in one order everywhere (`names`: untied first, tied last, as GradReduction
    sums them); the frozen ones (`frozen`, an adapter's base) are one copy all versions share."""

    def __init__(self, buffers: list[StageModule], hf_names_of: StageModule):
        self.buffers = buffers
        stage = buffers[0]
        self.names = [n for n, p in stage.named_parameters()
                      if p.requires_grad and n not in stage.tied_names] + stage.tied_names
        self.frozen = [p for p in stage.parameters() if not p.requires_grad]
        self.params = [[dict(b.named_parameters())[n] for n in self.names] for b in buffers]
        named = dict(hf_names_of.named_parameters())
        self.hf_names = [stage.model.hf_name(named[n]) for n in self.names]
        self.num_tied = len(stage.tied_names)  # the last of `names`
        self.updates = 0  # optimizer steps taken: the newest version

    def module(self, version: int) -> StageModule:
        return self.buffers[version % len(self.buffers)]

    def tied(self, version: int) -> list[torch.Tensor]:
        """`version`'s tied weights (what the partner stage's tied gradients are shaped like)."""
        return self.params[version % len(self.buffers)][len(self.names) - self.num_tied:]

    def latest(self) -> StageModule:
        return self.module(self.updates)

    def await_version(self, version: int) -> None:
        """Block until `version`'s weights may be computed with (they are, on the device)."""

    def settle(self) -> None:
        """Finish every update in flight."""

    def take_grads(self, version: int) -> list[torch.Tensor | None]:
        """Gradients accumulated on `version`'s buffer (None where a parameter got none, which
        the optimizer then skips, as the baseline's does); the buffer's .grad is cleared."""
        grads = []
        for p in self.params[version % len(self.buffers)]:
            grads.append(p.grad)
            p.grad = None
        return grads

    def device_tensors(self) -> list[torch.Tensor]:
        """Every weight tensor held where the stage computes."""
        return [p for version in self.params for p in version] + self.frozen

    def device_optimizer_state(self) -> list[torch.Tensor]:
        """The optimizer state held where the stage computes."""
        return []

    def host_bytes(self) -> dict[str, int]:
        """What this placement keeps in host memory apart from the device (none here)."""
        return {}

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        """Release background workers."""

    def _by_name(self, version: int) -> dict[str, torch.Tensor]:
        params = self.params[version % len(self.buffers)]
        return {n: p.detach().cpu().clone() for n, p in zip(self.hf_names, params, strict=True)}

    def _load(self, version: int, weights: dict) -> None:
        with torch.no_grad():
            for n, p in zip(self.hf_names, self.params[version % len(self.buffers)], strict=True):
                p.copy_(weights[n])


class WeightVersions(VersionBuffers):
    """Weights and optimizer state on the device: one buffer (flush) or two (2BW).

    2BW's update W(b+1) = W(b) - lr * grad(W(b-1)) goes into the buffer that held W(b-1):
    batch b, its only user, is finished by then, while W(b) must stay untouched for the
    in-flight micro-batches of batch b+1. The optimizer follows the newest buffer, its state
    re-keyed to that buffer's parameters, so two versions plus one optimizer state is all a
    stage keeps.
    """

    def __init__(self, stage: StageModule, versions: int, optim_cfg):
        super().__init__(version_copies(stage, versions), stage)
        self.optimizer = build_optimizer(zip(self.names, self.params[0], strict=True), optim_cfg)

    def apply(self, grads: list[torch.Tensor | None], lr: float) -> None:
        """One optimizer step: version `updates` becomes version `updates + 1`."""
        target = self.params[(self.updates + 1) % len(self.buffers)]
        if len(self.buffers) == 2:
            source = self.params[self.updates % 2]
            with torch.no_grad():
                torch._foreach_copy_(target, source)
            self._rekey_optimizer(source, target)
        for p, g in zip(target, grads, strict=True):
            p.grad = g
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def device_optimizer_state(self) -> list[torch.Tensor]:
        return optimizer_tensors([self.optimizer])

    def state(self) -> tuple[dict, dict, dict | None]:
        """Weights of the newest version and optimizer state by Hugging Face name, and (2BW) the
        previous version, which the next batch still computes with."""
        name = dict(zip(map(id, self.params[self.updates % len(self.buffers)]), self.hf_names, strict=True))
        newest = self._by_name(self.updates)
        optimizer = optimizer_state([self.optimizer], lambda p: name[id(p)])
        previous = self._by_name(self.updates - 1) if len(self.buffers) == 2 else None
        return newest, optimizer, previous

    def load_state(self, updates: int, weights: dict, optimizer: dict, previous: dict | None) -> None:
        """The inverse of `state` at `updates` optimizer steps; without `previous` (a checkpoint
        from another strategy) the previous version starts equal to the newest."""
        self.updates = updates
        self._load(updates, weights)
        if len(self.buffers) == 2:
            self._load(updates - 1, previous if previous else weights)
        newest = self.params[updates % len(self.buffers)]
        if newest is not self.params[0]:  # the optimizer follows the newest buffer
            self._rekey_optimizer(self.params[0], newest)
        name = dict(zip(map(id, newest), self.hf_names, strict=True))
        load_optimizer_state([self.optimizer], lambda p: name[id(p)], optimizer)

    def _rekey_optimizer(self, source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
        position = {id(p): i for i, p in enumerate(source)}
        for group in self.optimizer.param_groups:
            group["params"] = [target[position[id(p)]] for p in group["params"]]
        self.optimizer.state = defaultdict(
            dict, {target[position[id(p)]]: state for p, state in self.optimizer.state.items()}
        )
