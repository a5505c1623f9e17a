"""What every cost model is made of, below the strategies that price themselves with it.

- `model`: CostModel, the planner's questions, which each strategy's cost model answers.
- `shape`: Shape, a candidate, and the placements that spread a replica (`DEGREES`).
- `formulas`: ModelFacts (a worker's share of them under a placement), StepCost and the
  formulas strategies share (a part's work, activation bytes, host memory).
- `links`: what moving bytes costs (transfers, messages, collectives).
- `work`: the one count of a block's and the head's FLOPs (profile, layouts, model FLOP/s).
- `profile`: one block timed on this machine, or a GPU spec-sheet profile (configs/profiles/).
- `quantized`: what a 4-bit (NF4) base weighs: each part's quantized weights as values and bytes.
"""
