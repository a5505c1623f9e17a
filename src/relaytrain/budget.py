"""Before allocating anything: estimate the host memory a run needs and refuse what cannot fit.

An estimate from the config's shapes (labelled as such), not a measurement. It errs high:
a refused run costs the user one line, an out-of-memory kill costs them the machine.
"""

from __future__ import annotations

import psutil

from relaytrain.errors import ConfigError

FP32 = 4
HEADROOM = 1.0 * 2**30  # Python, torch and the libraries themselves


def activation_bytes_per_block(cfg, dtype_bytes: int) -> int:
    """Activations one block keeps for backward, for one micro-batch (Korthikanti et al., 2022)."""
    m, s, b = cfg.model, cfg.data.seq_len, cfg.strategy.microbatch_size
    return dtype_bytes * (17 * s * b * m.hidden_size + 5 * m.num_heads * s * s * b // 2)


def estimate_host_bytes(cfg, num_params: int, device_type: str) -> int:
    """Weights + gradients + optimizer state (two fp32 moments for Adam/LAMB) on the host, plus
    activations when the device *is* the host (CPU runs)."""
    optimizer_words = 1 if cfg.optim.name == "sgd" else 2
    weights_grads_state = num_params * FP32 * (2 + optimizer_words)
    if cfg.strategy.name.startswith("l2l"):
        weights_grads_state += num_params * FP32  # pinned transit copies of what crosses to the device
    activations = 0
    if device_type == "cpu":
        per_block = activation_bytes_per_block(cfg, FP32)
        live_blocks = 1 if cfg.strategy.recompute or cfg.strategy.name.startswith("l2l") else cfg.model.num_layers
        stash = cfg.model.num_layers * cfg.strategy.num_microbatches * cfg.data.seq_len * cfg.strategy.microbatch_size
        activations = per_block * live_blocks + stash * cfg.model.hidden_size * FP32
        logits = cfg.strategy.microbatch_size * cfg.data.seq_len * cfg.model.vocab_size * FP32 * 3
        if cfg.model.task == "classification":
            logits = 0
        activations += logits
    return int(weights_grads_state + activations + HEADROOM)


def check_host_memory(cfg, num_params: int, device_type: str) -> int:
    need = estimate_host_bytes(cfg, num_params, device_type)
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"this run needs about {need / 2**30:.1f} GiB of host memory (estimate) but {available / 2**30:.1f} GiB "
            f"is available; use a smaller model (model.num_layers, model.hidden_size), a smaller batch "
            f"(strategy.microbatch_size), or train.check_memory=false to try anyway"
        )
    return need
