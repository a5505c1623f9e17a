"""The conformance properties (`properties.py`) on every other strategy's cells: baseline, fsdp,
l2l and l2l_stash_cpu."""

from tests.conformance.properties import CellProperties
from tests.conformance.test_pipeline_cells import is_pipeline


class TestOtherCells(CellProperties):
    part = staticmethod(lambda cell: not is_pipeline(cell))
