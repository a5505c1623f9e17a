"""The early update of an input embedding table (`EagerParamServer.update_table_early`).

An input embedding's gradient from its own backward is zero outside the rows the minibatch
looked up, so every other row's update is final once the head's gradients (a tied head's
share) are in: the EPS steps the whole table while the backward runs through the blocks,
keeping the looked-up rows as they were (`HeldRows`), and the part's regular update redoes
just those rows with their whole gradient. Exact for update rules that read an element only
(`ELEMENTWISE`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Optimizers whose update of an element reads only that element (and its state): a subset of
# rows stepped on its own ends bit-identical to the same rows of a whole-tensor step. LAMB's
# per-tensor trust ratio is not.
ELEMENTWISE = (torch.optim.AdamW, torch.optim.SGD)


@dataclass
class HeldRows:
    """Rows of an embedding table its early update left out: their values and optimizer state
    from before it, and the gradient they had then (a tied head's share)."""

    table: nn.Parameter
    rows: torch.Tensor
    values: torch.Tensor
    state: dict
    grad: torch.Tensor | None

    @property
    def table_rest(self) -> int:
        """Parameters of the table the early update already counted."""
        return self.table.numel() - len(self.rows) * self.table[0].numel()

    @classmethod
    @torch.no_grad()
    def take(cls, optimizer: torch.optim.Optimizer, table: nn.Parameter, rows: torch.Tensor) -> HeldRows:
        state = {k: v.index_select(0, rows) if _per_row(v, table) else (v.clone() if torch.is_tensor(v) else v)
                 for k, v in optimizer.state.get(table, {}).items()}
        grad = table.grad.index_select(0, rows) if table.grad is not None else None
        return cls(table, rows, table.detach().index_select(0, rows), state, grad)

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the held rows with their whole gradient (the tied share first, as `accumulate`
        sums them), by the table's own update rule, and write them back."""
        table = self.table
        grad = table.grad.index_select(0, self.rows) if table.grad is not None else None
        if self.grad is not None:
            grad = self.grad if grad is None else self.grad.add_(grad)
        table.grad = None  # the table's other rows are final: the part's step must skip it
        if grad is None:
            return
        rows = nn.Parameter(self.values)
        rows.grad = grad
        group = next(g for g in optimizer.param_groups if any(p is table for p in g["params"]))
        step = type(optimizer)([{**group, "params": [rows]}])
        if self.state:
            step.state[rows] = self.state
        step.step()
        table.index_copy_(0, self.rows, rows.detach())
        for key, value in optimizer.state[table].items():
            if _per_row(value, table):
                value.index_copy_(0, self.rows, step.state[rows][key])


def _per_row(value, table: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == table.shape
