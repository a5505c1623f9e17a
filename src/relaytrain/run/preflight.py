"""Before anything starts: can this machine start the run's processes, and hold its host memory?

`check_can_start(cfg, cls, device)` is the one pre-launch check: `relaytrain train` runs it on every
combination of a sweep before Hydra makes a run directory, the trainer again before it starts
workers, and the planner on each candidate it would run on this machine. The host memory is an
estimate from the config's shapes (labelled as such), not a measurement; the strategy makes it
(`CostModel.estimate_host_bytes`, its `cost_model`'s), since only it knows where its weights, gradients, optimizer
state and activations live. It errs high: a refused run costs the user one line, an
out-of-memory kill costs them the machine.
"""

from __future__ import annotations

import psutil
import torch

from relaytrain.models import count_parameters, float8
from relaytrain.placement.world import under_torchrun, usable_cores
from relaytrain.run.resolve import choose
from relaytrain.utils.errors import ConfigError

HEADROOM = 1.0 * 2**30  # Python, torch and the libraries themselves
WORKERS_PER_CPU = 4  # more processes than this per core makes transfers time out, not progress


def check_can_start(cfg, cls, device: torch.device, parameters: int | None = None) -> int:
    """Refuse, in one line, a run this machine cannot start or hold on its decided `device`
    (`parameters`: the model's, counted here when not given). Returns the host memory the run
    needs there, by its strategy's cost model (`CostModel.estimate_host_bytes`, HEADROOM, and
    an online objective's gathered model, `gathered_policy_bytes`): a dry run reports it."""
    check_machine(cfg.strategy, cls.processes(cfg), device)
    if parameters is None:
        parameters = count_parameters(cfg.model)
    gathered = gathered_policy_bytes(cfg, cls, parameters)
    cls.check_device(cfg, device)
    if cfg.train.compile:
        from relaytrain.models import compile as compiling

        compiling.check(device)
    float8.check(cfg.precision.name, device.type)
    need = int(cls.cost_model.estimate_host_bytes(cfg, parameters, device.type) + HEADROOM + gathered)
    # A dry run plans for the machine the real run will have, not this one: it allocates no
    # such memory, and reports the estimate (results.json's memory.host_estimate_bytes).
    if cfg.train.check_memory and device.type != "meta":
        check_host_memory(need)
    return need


def gathered_policy_bytes(cfg, cls, parameters: int) -> int:
    """What the first process's host adds where shards or stages split the model an online
    objective samples (`run.rollouts`): the whole model gathered in fp32 before each rollout
    batch and, with a KL term, the initial model kept as its reference. 0 elsewhere (one
    process's layout replicates the whole model too)."""
    goal = choose(cfg).objective
    if not goal.learns_online or cls.rank_layout(cfg).replicates_whole:
        return 0
    return 4 * parameters * (2 if goal.beta != 0 else 1)


def check_machine(s, processes: int, device: torch.device) -> None:
    """Refuse a run whose workers this machine cannot start (`s`: the strategy keys)."""
    backend = str(getattr(s, "backend", "auto"))
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("strategy.backend=nccl needs CUDA devices; use strategy.backend=gloo or auto")
    if processes == 1 or under_torchrun():
        return
    if device.type == "cuda" and processes > torch.cuda.device_count():
        raise ConfigError(f"strategy={s.name} runs {processes} workers, one GPU each, and "
                          f"{torch.cuda.device_count()} are visible; lower strategy.stages or strategy.replicas, "
                          f"or run under torchrun on more machines")
    cpus = usable_cores()
    if device.type == "cpu" and processes > WORKERS_PER_CPU * cpus:
        raise ConfigError(f"strategy={s.name} runs {processes} workers on {cpus} CPU cores, more than "
                          f"{WORKERS_PER_CPU} per core; lower strategy.stages or strategy.replicas")


def check_host_memory(need: int) -> int:
    """Refuse a run whose estimated host memory (`need` bytes) this machine does not have free."""
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"this run needs about {need / 2**30:.1f} GiB of host memory (estimate) but {available / 2**30:.1f} GiB "
            f"is available; use a smaller model (model.num_layers, model.hidden_size), a smaller batch "
            f"(strategy.microbatch_size), or train.check_memory=false to try anyway"
        )
    return need
