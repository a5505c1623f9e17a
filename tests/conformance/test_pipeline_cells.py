"""The conformance properties (`properties.py`) on the pipeline strategies' cells."""

from tests.conformance.cells import Cell
from tests.conformance.properties import CellProperties


def is_pipeline(cell: Cell) -> bool:
    return cell.strategy.startswith("pipe_")


class TestPipelineCells(CellProperties):
    part = staticmethod(is_pipeline)
