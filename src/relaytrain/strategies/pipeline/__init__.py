"""Pipeline parallelism: PipeDream-Flush, PipeDream-2BW, GPipe and interleaved 1F1B across worker
processes. Its files:

- `schedule`: the order of work as data (1F1B with flushes, 2BW, GPipe, interleaved), no torch
  needed; the registry of schedules, each named as the strategy that runs it;
- `validate`: invariants per stage and an event replay of every stage together (not the
  meta-device dry run); `view`: the timeline figures drawn from that replay;
- `config`: the keys every pipeline strategy has; `cost`: the closed-form step time and memory
  the planner asks, and the measured bubble beside the predicted one;
- `stage`, `comms`: a stage's module and its links;
- `weights`, `offload`: a stage's weight versions, on the device or with `strategy.offload=host`;
- `runtime`: a stage as a strategy (one process each), executing its program one batch per step;
  `handlers`: one function per instruction of the program; `inflight`: what a stage holds between
  them; `executor`: static or message-driven order (`strategy.execution`);
- `jitter`: a seeded delay on one stage, for benchmarks and tests;
- `flush`, `twobw`, `gpipe`, `interleaved`: the registered strategies, each naming its schedule.
"""
