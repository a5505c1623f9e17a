"""Pipeline parallelism: PipeDream-Flush, PipeDream-2BW and GPipe across worker processes.

- `schedule`: the order of work as data (1F1B with flushes, 2BW, GPipe), no torch needed;
- `validate`: invariants and a dry run of every stage together; `view`: the timeline figures;
- `stage`, `comms`: a stage's module and its links;
- `runtime`: a stage as a strategy (one process each), executing its program one batch per step;
- `flush`, `twobw`, `gpipe`: the registered strategies, each naming its schedule.
"""
