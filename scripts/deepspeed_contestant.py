"""Hugging Face's Trainer with DeepSpeed ZeRO-3, parameters and optimizer offloaded to the host:
the contestant L2L is measured against on a GPU (issue 59; MegaTrain's, at 14 B).

Trained as relaytrain trains the same config: the same model (relaytrain's build of it, its
Hugging Face module), the same rows in the same order (`bench_hf_trainer.relaytrain_samples`),
the same batch (micro-batch x accumulation steps), AdamW with relaytrain's settings, run by
DeepSpeed's own host optimizer (DeepSpeedCPUAdam, as ZeRO-Offload does). On a GPU in DeepSpeed's
bf16 mode (bf16 weights in the forward and backward, fp32 masters with the optimizer on the
host); on the CPU (`cpu=True`, a smoke run of the script) in fp32.

DeepSpeed initialises torch.distributed and keeps it, so each run has a process of its own
(`measure`): the bench's other runs, and the next of these, start clean.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).resolve().parent


def zero3_offload(bf16: bool) -> dict:
    """DeepSpeed's config: ZeRO stage 3, parameters and optimizer state on the host (pinned),
    its AdamW; "auto" values filled by the Trainer from its arguments."""
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload,
                              "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }


def free_port() -> int:
    """A port nothing listens on now, for the group of one's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(overrides: list[str], warmup: int, cpu: bool = False) -> dict:
    """One run of `train` in a fresh process: its figures."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(train, overrides, warmup, cpu).result()


def train(overrides: list[str], warmup: int, cpu: bool) -> dict:
    """`overrides`' run (relaytrain's keys) under Trainer + DeepSpeed ZeRO-3 offload, in this
    process: samples/s and step times after `warmup` steps, each step's loss, the parameters, the
    device's and the host's peaks."""
    import torch

    sys.path.insert(0, str(HERE))
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from bench_hf_trainer import relaytrain_samples
    from benchlib import step_timer
    from relaytrain.models import build_model
    from relaytrain.run.compose import compose_config

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # one process: DeepSpeed's group of one
    cfg = compose_config(overrides)
    s, o = cfg.strategy, cfg.optim
    model = build_model(cfg.model, cfg.train.seed).hf_model
    model.config.use_cache = False
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    arguments = TrainingArguments(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "deepspeed_contestant"), max_steps=cfg.train.steps,
        seed=cfg.train.seed, use_cpu=cpu, bf16=not cpu, deepspeed=zero3_offload(bf16=not cpu),
        per_device_train_batch_size=s.microbatch_size, gradient_accumulation_steps=s.num_microbatches,
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        weight_decay=o.weight_decay, lr_scheduler_type="constant", max_grad_norm=o.grad_clip,
        train_sampling_strategy="sequential", dataloader_num_workers=0, dataloader_pin_memory=False,
        eval_strategy="no", save_strategy="no", logging_strategy="steps", logging_steps=1, report_to="none",
        disable_tqdm=True)
    timer = step_timer()
    trainer = Trainer(model=model, args=arguments, train_dataset=relaytrain_samples(cfg), callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    if torch.cuda.is_available() and not cpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = timer.times[warmup:]
    step_s = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and not cpu else None
    return {"samples_per_s": s.microbatch_size * s.num_microbatches / step_s, "step_s": step_s,
            "step_times_s": timer.times, "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "parameters": parameters, "optimizer": type(trainer.model_wrapped.basic_optimizer).__name__,
            "device_peak_bytes": peak, "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
