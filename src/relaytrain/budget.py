"""Before allocating anything: estimate the host memory a run needs and refuse what cannot fit.

An estimate from the config's shapes (labelled as such), not a measurement; the strategy
makes it (`Strategy.estimate_host_bytes`), since only it knows where its weights, gradients,
optimizer state and activations live. It errs high: a refused run costs the user one line,
an out-of-memory kill costs them the machine.
"""

from __future__ import annotations

import psutil

from relaytrain.errors import ConfigError
from relaytrain.models import count_parameters
from relaytrain.world import pick_device

HEADROOM = 1.0 * 2**30  # Python, torch and the libraries themselves


def estimate_host_bytes(cfg, cls) -> int:
    device_type = pick_device(cfg.train.device).type
    return int(cls.estimate_host_bytes(cfg, count_parameters(cfg.model), device_type) + HEADROOM)


def check_host_memory(cfg, cls) -> int:
    need = estimate_host_bytes(cfg, cls)
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"this run needs about {need / 2**30:.1f} GiB of host memory (estimate) but {available / 2**30:.1f} GiB "
            f"is available; use a smaller model (model.num_layers, model.hidden_size), a smaller batch "
            f"(strategy.microbatch_size), or train.check_memory=false to try anyway"
        )
    return need
