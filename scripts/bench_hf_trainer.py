"""relaytrain's baseline against Hugging Face's `transformers.Trainer`: the same training, two tools.

`Trainer` is what a user would run instead of relaytrain. Two comparisons, one headline each:
`baseline_vs_hf_trainer` on bert_base for classification, `decoder_baseline_vs_hf_trainer` on
a causal LM of the Llama layout (benchlib.DECODER: 8 blocks of hidden 512, grouped-query
attention 8/2). In each, both contestants train the same model (built from relaytrain's config
and seed, fresh weights) on the same samples in the same order (relaytrain's synthetic data,
from its own dataset builder and loader) with the same minibatch (Trainer: per-device batch = micro-batch
size, gradient accumulation = number of micro-batches), sequence length, fp32, dropout and
torch threads, and the same optimizer: fused AdamW with relaytrain's lr, betas, eps and weight
decay, a constant learning rate, no clipping. Trainer's own decay grouping (not biases, not
norms) splits both models' parameters as relaytrain's does (matrices and embeddings); each run
checks that the two optimizers agree group by group. With dropout off both report the same mean
loss (tests/test_bench_hf_trainer.py). Trainer evaluates, saves, logs and prints nothing, loads
data in the main process and keeps no KV cache (it only serves generation; relaytrain's blocks
keep none either).

Each contestant runs in a fresh process of its own, so its peak RSS (VmHWM) is its own and
neither inherits the other's allocator or thread pool; the order alternates round by round
(ABBA) so drift on the machine hits both alike. Both time whole optimizer steps after the same
warm-up: relaytrain its own loop (results.json's throughput), Trainer a callback from
`on_step_begin` (the step's micro-batches already collated, as relaytrain's loader has them) to
`on_step_end` (optimizer step and zero_grad done), the device synchronised. The headline is the
median of the rounds' ratios of samples/s, relaytrain / Trainer (benchlib.headline).

What still differs is each tool's own: Trainer computes the gradient norm every step for its
logs, clipping or not (one more pass over the gradients); relaytrain's process keeps freed
memory for reuse (its launcher's malloc setting), Trainer's runs with glibc's defaults, as a
user's script would.

    .venv/bin/python scripts/bench_hf_trainer.py [--only NAME,...] [--rounds 5] [--steps 5] [--warmup 2] [--quick]
                                                  [--json out.json] [KEY=VALUE ...]

Trainer needs accelerate: `pip install -e '.[bench]'` (`make bench` installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
from omegaconf import OmegaConf
from torch.utils.data import StackDataset

from benchlib import DECODER, OtherLoad, headline
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.step import metrics
from relaytrain.step.optim import build_optimizer

BATCH = ["data.seq_len=128", "strategy.microbatch_size=2", "strategy.num_microbatches=4"]
QUICK_BATCH = ["model.vocab_size=512", "data.seq_len=32", "data.num_samples=256"]
# Each comparison's model and batch (its headline's name -> overrides), and the tiny ones of --quick.
DEFAULT = {"baseline_vs_hf_trainer": ["model=bert_base", *BATCH],
           "decoder_baseline_vs_hf_trainer": [*DECODER, *BATCH]}
QUICK = {"baseline_vs_hf_trainer": ["model=bert_tiny", "model.num_layers=2", "model.hidden_size=64",
                                    "model.intermediate_size=256", *QUICK_BATCH],
         "decoder_baseline_vs_hf_trainer": [*DECODER, "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                            "model.intermediate_size=172", *QUICK_BATCH]}
RUN = {"rounds": 5, "steps": 5, "warmup": 2}
QUICK_RUN = {"rounds": 1, "steps": 2, "warmup": 1}
TARGET = 1.05
# What the Trainer side reproduces; any other setting is refused rather than compared unlike for unlike.
# Not masked_lm: Hugging Face's masked LM loss is each micro-batch's mean over its own masked
# tokens, relaytrain's the minibatch's sum over all of them, which differ with uneven masks.
COMPARABLE = {"strategy.name": ("baseline",), "model.task": ("classification", "causal_lm"), "optim.name": ("adamw",),
              "optim.schedule": ("constant",), "optim.warmup_steps": (0,), "precision.name": ("fp32",)}
# What decides an AdamW update, per parameter group.
UPDATE_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "fused")


def compose(overrides: list[str], steps: int, warmup: int):
    """The run's config: `warmup` steps left out of the figures, then `steps` measured ones."""
    cfg = compose_config([*overrides, f"train.steps={warmup + steps}", f"train.untimed_steps={warmup}"])
    for key, wanted in COMPARABLE.items():
        if OmegaConf.select(cfg, key) not in wanted:
            sys.exit(f"bench_hf_trainer: {key}={OmegaConf.select(cfg, key)} is not compared; "
                     f"the Trainer side reproduces {key}={' or '.join(map(str, wanted))}")
    return cfg


def process_figures() -> dict:
    """This process's torch threads and peak RSS: the contestant's own, as each has a process of its own."""
    return {"threads": torch.get_num_threads(), "peak_rss_bytes": metrics.HostMemory().peak_bytes()}


def relaytrain_contestant(overrides: list[str], steps: int, warmup: int) -> dict:
    """relaytrain's baseline through its own API, as `relaytrain train` runs it."""
    cfg = compose(overrides, steps, warmup)
    with tempfile.TemporaryDirectory() as run_dir:
        results = run(cfg, run_dir, quiet=True)
    return {"samples_per_s": results["throughput"]["samples_per_s"], "step_times_s": results["step_times_s"][warmup:],
            "mean_loss": statistics.mean(results["loss"]), **process_figures()}


def hf_trainer_contestant(overrides: list[str], steps: int, warmup: int) -> dict:
    """The same training under transformers.Trainer."""
    return {**train_with_trainer(compose(overrides, steps, warmup), warmup), **process_figures()}


def train_with_trainer(cfg, warmup: int, callbacks=(), **arguments) -> dict:
    """`cfg`'s training (as `compose` made it) under transformers.Trainer in this process, with
    `arguments` added to its TrainingArguments (bench_long_context.py: activation checkpointing):
    the samples/s and times of the steps after `warmup`, the mean loss, each step's loss where
    `arguments` turn Trainer's per-step logging on, and whether its optimizer is relaytrain's;
    `callbacks`: more of Trainer's callbacks (bench_step_overhead.py's profiler)."""
    # Imported here, so only Trainer's process loads it: about 130 MB of RSS that would otherwise
    # count in relaytrain's peak too.
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging

    logging.set_verbosity_error()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # as relaytrain's launcher does
    model = build_model(cfg.model, cfg.train.seed).hf_model
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a decoder would fill a KV cache each forward, for generation only
    timer = step_timer()
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(model=model, args=training_arguments(cfg, out_dir, **arguments),
                          train_dataset=relaytrain_samples(cfg), callbacks=[timer, *callbacks])
        trainer.remove_callback(PrinterCallback)  # it prints the end-of-training figures, warm-up included
        # BERT's forward takes **kwargs, so Trainer assumes it divides the loss by the accumulated
        # minibatch's item count, and does not divide by the accumulation steps itself. Its
        # classification head returns each micro-batch's mean instead: left alone, the gradients
        # (and the reported loss) would be num_microbatches times relaytrain's. A causal LM's loss
        # does divide by that count (the minibatch's shifted labels, as relaytrain's does).
        if cfg.model.task != "causal_lm":
            trainer.loss_is_scaled_for_ga = False
        trainer.create_optimizer()
        reference = build_optimizer(model.named_parameters(), cfg.optim)
        same_optimizer = update_rule(trainer.optimizer) == update_rule(reference)
        mean_loss = trainer.train().training_loss
    measured = timer.times[warmup:]
    samples = cfg.strategy.microbatch_size * cfg.strategy.num_microbatches
    return {"samples_per_s": samples / statistics.mean(measured), "step_times_s": measured, "mean_loss": mean_loss,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "optimizer_as_relaytrain": same_optimizer}


def training_arguments(cfg, out_dir: str, **arguments):
    """Trainer's settings for relaytrain's run: the same batch, optimizer and seed, and nothing
    else in the step (no evaluation, checkpoint, logging, progress bar or worker processes),
    unless `arguments` (TrainingArguments' own keys) say otherwise."""
    from transformers import TrainingArguments

    s, o = cfg.strategy, cfg.optim
    settings = dict(
        output_dir=out_dir, max_steps=cfg.train.steps, seed=cfg.train.seed, use_cpu=cfg.train.device == "cpu",
        per_device_train_batch_size=s.microbatch_size, gradient_accumulation_steps=s.num_microbatches,
        optim="adamw_torch_fused" if o.fused else "adamw_torch", learning_rate=o.lr, adam_beta1=o.betas[0],
        adam_beta2=o.betas[1], adam_epsilon=o.eps, weight_decay=o.weight_decay, lr_scheduler_type="constant",
        max_grad_norm=o.grad_clip,  # 0 turns clipping off in both
        train_sampling_strategy="sequential",  # the dataset is already in relaytrain's order
        dataloader_num_workers=0, dataloader_pin_memory=False,
        eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **arguments})


def relaytrain_samples(cfg) -> StackDataset:
    """The samples of relaytrain's first train.steps minibatches, in the order relaytrain trains on them."""
    loader = build_loader(cfg, build_dataset(cfg))
    micro = [mb for step in range(cfg.train.steps) for mb in loader.minibatch(step)]
    columns = {name: [getattr(mb, name) for mb in micro] for name in ("input_ids", "labels", "attention_mask")}
    return StackDataset(**{name: torch.cat(parts) for name, parts in columns.items() if parts[0] is not None})


def update_rule(optimizer) -> list:
    """Each parameter group's parameters (by identity) and settings: equal lists, equal updates."""
    return sorted((sorted(id(p) for p in g["params"]), *(g[k] for k in UPDATE_SETTINGS)) for g in optimizer.param_groups)


def step_timer():
    """A Trainer callback that times whole optimizer steps."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            metrics.synchronize(args.device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            metrics.synchronize(args.device)
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


CONTESTANTS = {"relaytrain": relaytrain_contestant, "hf_trainer": hf_trainer_contestant}


def in_own_process(contestant, *args) -> dict:
    """`contestant(*args)` in a fresh process (its own allocator, thread pool and peak RSS), and
    the cores other processes kept busy meanwhile: on a shared machine, what slowed it."""
    with OtherLoad() as others, ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        figures = pool.submit(contestant, *args).result()
    return {**figures, "other_cores_busy": others.cores}


def compare(name: str, overrides: list[str], rounds: int, steps: int, warmup: int) -> dict:
    """Both contestants once per round, in alternating order; the headline `name` is the median round's ratio."""
    cfg = compose(overrides, steps, warmup)  # refuses what Trainer would not reproduce before any process starts
    results = []
    for r in range(rounds):
        order = list(CONTESTANTS) if r % 2 == 0 else list(reversed(CONTESTANTS))
        results.append({name: in_own_process(CONTESTANTS[name], overrides, steps, warmup) for name in order})
        print(f"round {r + 1}: " + ", ".join(f"{name} {f['samples_per_s']:.2f} samples/s "
                                             f"(other processes {f['other_cores_busy']:.1f} cores busy)"
                                             for name, f in results[-1].items()), flush=True)
    per_round = [r["relaytrain"]["samples_per_s"] / r["hf_trainer"]["samples_per_s"] for r in results]
    m, s = cfg.model, cfg.strategy
    return {
        "benchmark": name,
        "model": f"{m.name} L{m.num_layers} H{m.hidden_size} seq{cfg.data.seq_len} dropout {m.dropout}",
        "minibatch": f"{s.microbatch_size}x{s.num_microbatches}",
        "overrides": overrides,
        "steps": steps,
        "warmup": warmup,
        "rounds": results,
        "samples_per_s": {name: statistics.median(r[name]["samples_per_s"] for r in results) for name in CONTESTANTS},
        "peak_rss_gib": {name: statistics.median(r[name]["peak_rss_bytes"] for r in results) / 2**30
                         for name in CONTESTANTS},
        "headlines": {name: headline(per_round, TARGET)},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help=f"alternating rounds (default {RUN['rounds']}, quick {QUICK_RUN['rounds']})")
    parser.add_argument("--steps", type=int, help=f"measured steps per contestant and round (default {RUN['steps']}, "
                                                  f"quick {QUICK_RUN['steps']})")
    parser.add_argument("--warmup", type=int, help=f"steps before them, left out (default {RUN['warmup']}, "
                                                   f"quick {QUICK_RUN['warmup']})")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny models, one short round")
    parser.add_argument("--only", default=",".join(DEFAULT), help="the comparisons to run, comma-separated")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*", help="relaytrain config overrides, applied to every contestant")
    args = parser.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(DEFAULT))
    if unknown:
        parser.error(f"--only: no comparison {', '.join(unknown)}; choose from {', '.join(DEFAULT)}")
    for key, default in (QUICK_RUN if args.quick else RUN).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    return args


def main() -> None:
    args = parse_args()
    if importlib.util.find_spec("accelerate") is None:
        sys.exit("bench_hf_trainer: transformers.Trainer needs accelerate: pip install -e '.[bench]' (make bench does)")
    models = QUICK if args.quick else DEFAULT
    results = {}
    for name in args.only.split(","):
        results[name] = result = compare(name, [*models[name], *args.overrides], args.rounds, args.steps, args.warmup)
        h, rate, rss = result["headlines"][name], result["samples_per_s"], result["peak_rss_gib"]
        print(f"{name} ({result['model']}, minibatch {result['minibatch']}): "
              f"relaytrain {rate['relaytrain']:.2f} samples/s (peak RSS {rss['relaytrain']:.2f} GiB), "
              f"Trainer {rate['hf_trainer']:.2f} samples/s ({rss['hf_trainer']:.2f} GiB); "
              f"median round {h['median']:.3f} (target >= {h['target']})", flush=True)
    if args.json:
        headlines = {key: h for result in results.values() for key, h in result["headlines"].items()}
        with open(args.json, "w") as f:
            json.dump({"comparisons": results, "headlines": headlines}, f, indent=2)


if __name__ == "__main__":
    main()
