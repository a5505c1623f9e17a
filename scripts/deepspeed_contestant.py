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
    process, as bench_hf_trainer's Trainer contestant runs it (`train_with_trainer`, its
    arguments with DeepSpeed's added): samples/s and step times after `warmup` steps, each step's
    loss, the parameters, the optimizer that stepped, the device's and the host's peaks."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_hf_trainer import train_with_trainer
    from relaytrain.models import count_parameters
    from relaytrain.run.compose import compose_config

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # one process: DeepSpeed's group of one
    cfg = compose_config(overrides)
    parameters = count_parameters(cfg.model)  # before the Trainer's DeepSpeed config partitions every model built
    on_gpu = torch.cuda.is_available() and not cpu
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    stepped = innermost_optimizer()
    found = train_with_trainer(cfg, warmup, callbacks=[stepped], deepspeed=zero3_offload(bf16=not cpu),
                               bf16=not cpu, logging_strategy="steps", logging_steps=1)
    return {**found, "step_s": statistics.median(found["step_times_s"]), "parameters": parameters,
            "optimizer": stepped.name, "device_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def innermost_optimizer():
    """A Trainer callback that names the optimizer that stepped, under the wrappers around it
    (accelerate's, DeepSpeed's ZeRO stage): DeepSpeedCPUAdam where ZeRO offloads it."""
    from transformers import TrainerCallback

    class Innermost(TrainerCallback):
        name = None

        def on_train_end(self, args, state, control, optimizer=None, **kwargs):
            while hasattr(optimizer, "optimizer"):
                optimizer = optimizer.optimizer
            self.name = type(optimizer).__name__

    return Innermost()
