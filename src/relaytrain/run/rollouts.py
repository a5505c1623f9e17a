"""The trainer's side of an online objective (`objective=grpo`): which model samples, which is
the reference, and when a rollout batch is made.

The policy is the strategy's own Hugging Face model, whose weights are the run's current ones
once the strategy has drained (a whole-model strategy's on its device; L2L's masters on the
host): sampling reads them where they are and copies nothing. The reference of the KL term
(`beta` > 0) is the initial model, as TRL's: with an adapter, the policy with its adapters off;
without one, a copy of the model as the run built it (its checkpoint, or the seeded fresh
weights), taken before any checkpoint of the run is loaded and held beside the policy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from pathlib import Path

import torch

from relaytrain.models.layered import MicroBatch
from relaytrain.rollout import on_device
from relaytrain.rollout.on_device import DeviceCopy, RelayCopy
from relaytrain.rollout.scoring import ReferenceView
from relaytrain.rollout.stage import RolloutBatch, RolloutStage, figures_of_total
from relaytrain.schema.row import row_values


class Rollouts:
    """Makes each step's rows for the trainer: the stage's batch when one is due, else the
    current one again (`num_iterations` > 1), keyed for the step. It takes plain values, not the
    config (resolved by the trainer)."""

    def __init__(self, spec, strategy, world, records: list[dict], tokenizer, seq_len: int, seed: int, run_dir: Path,
                 reporter: bool, adapter: bool, prompts_per_microbatch: int = 1, microbatches: int = 1):
        self.strategy, self.world, self.reporter = strategy, world, reporter
        self.simulated = world.simulated  # a dry run: rows of the longest completions, nothing sampled
        # Several processes: the first samples for all and hands every process the rows. Replicas
        # of the whole model (no shards, stages or tensor parts) sample from the first's own model,
        # current as every replica's; otherwise the processes gather their weights into a whole
        # model on the first's host (`_load_weights`), which samples as L2L's host-held policy does:
        # copied to its device, or relayed through it, where the device is a GPU.
        self.spread = world.size > 1 and not self.simulated
        self.maker = not self.spread or world.rank == 0
        self.gathers = self.spread and not strategy.layout.replicates_whole
        objective = spec.objective
        config = strategy.model.hf_config
        self.stage = RolloutStage(objective, records, tokenizer, seq_len, seed,
                                  run_dir if self.maker and (reporter or self.spread) else None, spec.precision,
                                  strategy.progress)
        self.policy = strategy.model.hf_model if self.maker and not self.gathers else None
        if self.gathers and self.maker:
            self.policy = _whole_model(config)
        self.stage.set_end_ids(_end_ids(self.policy, config), config.vocab_size)
        # How a relay sees its copy as the run's layered model: its scoring passes go through the blocks together.
        self.layered = functools.partial(spec.family.layered, objective=objective)
        sequences = prompts_per_microbatch * objective.num_generations
        # A copy on the device holds the weights as the blocks compute with them (a cross-precision run's half dtype).
        self.copy_dtype = spec.precision.half if spec.precision.cross else None
        self.device_copy = self._device_copy(world.device, config, sequences, seq_len, microbatches)
        self.stage.cache_on_host = self.device_copy is not None and self.device_copy.cache_on_host
        self.stage.decode_whole_batch = isinstance(self.device_copy, RelayCopy)
        # The reference of the KL term: the initial model, taken before any checkpoint is loaded
        # (the strategy's model is as the run built it); with adapters, the policy with them off.
        self.reference = None
        if objective.beta != 0 and not self.simulated and not adapter:
            if self.gathers:
                self._load_weights()
            self.reference = copy.deepcopy(self.policy).requires_grad_(False) if self.maker else None
        # A host-held reference scores as the policy samples: relayed through the device beside it.
        self.reference_copy = None if self.reference is None or self.device_copy is None else RelayCopy(
            self.reference, world.device, self._block_names(), self.copy_dtype, layered=self.layered)
        self.figures: dict[str, float] = {}  # the last rollout batch's, for the step that made it

    def minibatch(self, step: int, loader) -> list[MicroBatch]:
        stage = self.stage
        if stage.due(step) and self.simulated:
            stage.make_unsampled(step, loader.minibatch(stage.batch_of(step)))
        elif stage.due(step):
            self.strategy.drain()  # every update so far lands before the policy samples
            started = time.perf_counter()
            if self.gathers:
                self._load_weights()
            made = None
            if self.maker:
                with self._sampling_policy() as policy, self._scoring_reference() as reference:
                    if reference is None and stage.objective.beta != 0:
                        reference = ReferenceView(policy)
                    made = stage.make(step, loader.minibatch(stage.batch_of(step)), policy, reference,
                                      self.reporter or self.spread)
            if self.spread:
                made = self.world.broadcast(made, 0)
                stage.current = made
            self.figures = {**made.figures, "rollout_s": time.perf_counter() - started} if self.reporter else {}
        return stage.rows_for(step)

    def evaluate(self, step: int, batches: list[list[MicroBatch]], records: list[dict]) -> dict[str, float]:
        """The held-out prompts' reward figures after `step` steps (`RolloutStage.evaluate`), made
        by the process that samples and handed to every one (a collective with several)."""
        started = time.perf_counter()
        figures = None
        if self.simulated:
            figures = {}  # a dry run samples nothing
        else:
            if self.gathers:
                self._load_weights()
            if self.maker:
                prompts = [mb for group in batches for mb in group]
                with self._sampling_policy() as policy:
                    figures = {**self.stage.evaluate(step, prompts, policy, records),
                               "rollout_s": time.perf_counter() - started}
            if self.spread:
                figures = self.world.broadcast(figures, 0)
        return figures

    def _device_copy(self, device: torch.device, config, sequences: int, tokens: int, microbatches: int
                     ) -> DeviceCopy | None:
        """Where a policy held on the host (L2L's) samples, by objective.rollout_placement: auto
        chooses by the device's free memory (`on_device.choose`: a device copy, a relay of its
        blocks, or the host) and leaves a CPU run's policy where it is, as does host; copy and relay
        are taken as asked (on a CPU too, where the "device" is the host). None: the policy
        samples where it is (the whole-model strategies too)."""
        placement = self.stage.objective.rollout_placement
        host_held = self.strategy.capabilities.host_held_policy or self.gathers
        if (self.policy is None or self.simulated or not host_held
                or placement == "host" or (placement == "auto" and device.type == "cpu")):
            return None
        dtype = self.copy_dtype
        if placement == "copy":
            return DeviceCopy(self.policy, device, dtype)
        cache = on_device.kv_cache_bytes(config, sequences, tokens, dtype or torch.float32)
        free = on_device.free_bytes(device)
        if placement == "relay":
            made, said = on_device.relayed(self.policy, device, self._block_names(), dtype, cache * microbatches, free,
                                           layered=self.layered)
        else:
            made, said = on_device.choose(self.policy, device, self._block_names(), dtype, cache, free, microbatches,
                                          layered=self.layered)
        if said and self.reporter:
            print(said, flush=True)
        return made

    def _block_names(self) -> list[str]:
        """The policy's decoder layers, by module name: the ones the strategy's blocks wrap, or a
        gathered model's own (a stage's blocks are only some of them)."""
        if self.gathers:
            return on_device.decoder_layer_names(self.policy)
        names = {id(m): name for name, m in self.policy.named_modules()}
        return [names[id(b.layer)] for b in self.strategy.model.blocks]

    def _sampling_policy(self):
        """The model the policy samples with: its device copy (or relay) for the batch, else itself."""
        return self.device_copy.on_device() if self.device_copy is not None else contextlib.nullcontext(self.policy)

    def _scoring_reference(self):
        """The reference the batch scores with: its relay through the device where the policy
        samples there, else itself (None: none, or the policy's adapters off)."""
        if self.reference_copy is not None:
            return self.reference_copy.on_device()
        return contextlib.nullcontext(self.reference)

    def _load_weights(self) -> None:
        """The run's current weights, gathered from every process into the first one's whole model
        (a collective: every process calls it)."""
        shares = self.world.gather(self.strategy.weights(), 0)
        if self.maker:
            whole = {name: t for share in shares if share is not None for name, t in share.items()}
            self.policy.load_state_dict(whole, strict=False)
            self.policy.tie_weights()

    def columns(self) -> list[str]:
        """The figures a rollout batch reports, for metrics.csv's header: the loss's, the rewards'
        (in TRL's names), the completions' lengths, and the time the batch took."""
        names = [*self.stage.figure_names(), "rollout_s"]
        return [*self.stage.objective.figures, *names, *(f"eval_{name}" for name in names)]

    @staticmethod
    def progress_note(figures: dict[str, float]) -> str:
        """What the progress line shows of a rollout batch: the mean summed reward and the
        time sampling and scoring took ("" at a step that made none)."""
        if "rollout_s" not in figures:
            return ""
        reward = figures_of_total()[0]  # TRL's name of the summed reward's mean
        return f"{reward} {figures[reward]:.4f}  rollout {figures['rollout_s']:.3f} s"

    def take_figures(self) -> dict[str, float]:
        """The figures of the rollout batch made for the step just run, once (None at later steps)."""
        figures, self.figures = self.figures, {}
        return figures

    # -- checkpoints: a rollout batch trained on again after a resume (num_iterations > 1) ------
    def state(self) -> dict | None:
        current = self.stage.current
        if current is None or self.stage.objective.num_iterations == 1:
            return None
        return {"batch": current.batch, "rows": [row_values(mb) for mb in current.rows]}

    def load_state(self, state: dict | None, step: int) -> None:
        self.stage.forget_after(step)
        if state is not None:
            rows = [MicroBatch(**values) for values in state["rows"]]
            self.stage.current = RolloutBatch(state["batch"], rows, {})


def _whole_model(config):
    """A Hugging Face causal LM of the run's config, on the first process's host (the whole model
    need not fit one device): the weights every process holds are gathered into it before each
    rollout batch."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config).requires_grad_(False)


def _end_ids(model, config):
    """The model's generation config's end ids (an end-of-turn token), else its config's."""
    generation = getattr(model, "generation_config", None)
    ends = getattr(generation, "eos_token_id", None)
    return getattr(config, "eos_token_id", None) if ends is None else ends
