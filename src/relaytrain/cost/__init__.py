"""What every cost model is made of, below the strategies that price themselves with it.

- `formulas`: Shape, ModelFacts, StepCost and the formulas strategies share (a block's work,
  activation bytes, transfers).
- `profile`: one block timed on this machine, or a GPU spec-sheet profile (configs/profiles/).
"""
