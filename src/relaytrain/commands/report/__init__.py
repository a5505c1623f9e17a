"""`relaytrain report`: runs and sweeps side by side.

- `command`: the command itself (`compare_runs`): filters, order, summary.csv.
- `runs`: a run directory read as a row (what a run left there, a failed one included).
- `table`: the rows as one terminal table.
- `plots`: the rows as PNG plots (with matplotlib).
"""
