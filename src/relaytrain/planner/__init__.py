"""The planner: "which strategy, which shape, will it fit" answered before any work.

- `plan`: the request, the profile, `make_plan()`, and `predict(cfg)` for one config.
- `candidates`: every strategy's shapes checked against the closed forms, timed, host memory
  counted, the survivors dry-run.
- `output`: the table, plan.json and the best command.
- `dryrun`: a config's simulated device memory (a run on the meta device, quietly).
- `estimate`: the one-line estimate a run prints before it starts.

The planner uses the trainer (a dry run is a run) and the strategies' cost models, which are
built of `relaytrain.cost`; nothing below imports it.
"""
