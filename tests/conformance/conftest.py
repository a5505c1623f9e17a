"""Each cell trained once per test session, whichever property test asks first; every property
test of the cell reads that one run (and its one resumed run)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from relaytrain.records import checkpoint
from relaytrain.run.train import run
from tests.checkpoints import tiny_decoder
from tests.conformance.cells import DECODERS, LAYERS, Bases, Cell, cell_cfg, cell_params
from tests.conformance.references import gpt2_checkpoint, peft_adapter


@dataclass
class TrainedCell:
    """A cell's run, trained on construction: `train.steps` steps, a checkpoint after each, the
    model saved. `resumed` is the same run resumed from its step-1 checkpoint, trained when first asked."""

    cell: Cell
    bases: Bases
    directory: Path

    def __post_init__(self):
        self.cfg = cell_cfg(self.cell, self.bases)
        self.run_dir = self.directory / "run"
        self.results = run(self.cfg, self.run_dir, table=False)

    @cached_property
    def resumed(self) -> tuple[Path, dict]:
        """The run dir and results of the run resumed from the step-1 checkpoint."""
        first = checkpoint.step_dir(checkpoint.checkpoint_dir(self.run_dir), 1)
        resumed_dir = self.directory / "resumed"
        resumed_cfg = cell_cfg(self.cell, self.bases, f"train.resume={first}", "train.untimed_steps=0")  # one step, timed
        return resumed_dir, run(resumed_cfg, resumed_dir, table=False)


@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> Bases:
    """A Llama and a GPT-2 checkpoint, each with a peft adapter made for it."""
    root = tmp_path_factory.mktemp("bases")
    checkpoints = {"llama": tiny_decoder(root / "llama", "llama", layers=LAYERS),
                   "gpt2": gpt2_checkpoint(root / "gpt2")}
    adapters = {family: peft_adapter(checkpoints[family], root / f"{family}-adapter") for family in DECODERS}
    return Bases(checkpoints, adapters)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, bases):
    """cell -> its TrainedCell, trained the first time any test asks for it."""
    runs: dict[Cell, TrainedCell] = {}

    def of(cell: Cell) -> TrainedCell:
        if cell not in runs:
            runs[cell] = TrainedCell(cell, bases, tmp_path_factory.mktemp(cell.id))
        return runs[cell]

    return of


def pytest_generate_tests(metafunc):
    """A conformance property (a method of `properties.CellProperties`) runs on the cells of its
    file's part of the matrix that it applies to."""
    applies_to = getattr(metafunc.function, "applies_to", None)
    if metafunc.cls is None or applies_to is None:
        return
    part = metafunc.cls.part
    metafunc.parametrize("cell", cell_params(lambda cell: part(cell) and applies_to(cell)))
