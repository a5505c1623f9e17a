"""Pipeline parallelism: PipeDream-Flush and PipeDream-2BW across worker processes.

- `schedule`: the order of work as data (1F1B with flushes, 2BW, GPipe), no torch needed;
- `validate`: invariants and a dry run of every stage together; `view`: the timeline figures;
- `stage`, `comms`, `worker`: a stage's module, its links, and the executor of its program;
- `launch`: refusals, local worker processes (or one torchrun worker), results.
"""

from __future__ import annotations

__all__ = ["run_pipeline"]


def run_pipeline(cfg, run_dir, overrides: list[str]) -> dict:
    """Train `cfg` (strategy pipe_flush or pipe_2bw), write run_dir/results.json, return the results."""
    # Imported here so the schedule tools (`relaytrain schedule`) start without torch.
    from relaytrain.strategies.pipeline.launch import run_pipeline as run

    return run(cfg, run_dir, overrides)
