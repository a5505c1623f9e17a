"""A sweep (`relaytrain train -m ...`) ends with one table of every job, not one per job.

Hydra calls `SweepReport.on_multirun_end` once every job has run (configs/config.yaml
registers it under hydra.callbacks); it prints `relaytrain report`'s table for the sweep
directory and writes its summary.csv and plots there. Each job meanwhile prints one line, and a
job that fails is recorded (status.json) and the sweep goes on, so the table shows it as a row.
"""

from __future__ import annotations

from hydra.experimental.callback import Callback

failed_jobs: list[str] = []  # run directories of this process's failed sweep jobs (the CLI's exit code)


class SweepReport(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from relaytrain.commands.report.command import compare_runs

        compare_runs([config.hydra.sweep.dir], out=config.hydra.sweep.dir)
