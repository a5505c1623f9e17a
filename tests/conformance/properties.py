"""One suite every strategy passes, on every cell of the conformance matrix (`cells.py`): each cell
is trained once (`conftest.trained`) and every property below is asserted on that one run.

The properties are the methods of `CellProperties`; each test file subclasses it for one part of
the matrix (`test_pipeline_cells.py`, `test_other_cells.py`) so that pytest-xdist's `loadfile`
hands the two parts to two workers, each training its own cells once. `applies_to` says which
cells a property is asserted on; the conftest's `pytest_generate_tests` parametrizes each method
over the cells of its file's part it applies to: the pairwise cover's in the default suite, the
rest `slow`. docs/design.md ("What the suite runs where") lists both.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relaytrain.records import checkpoint
from tests.conformance.cells import STEPS, Cell
from tests.conformance.references import (
    adapters_of,
    assert_same_weights,
    hf_reference,
    hf_saved,
    peft_reference,
    plain_loop,
    saved_model,
    update_delay,
)


def applies_to(where):
    """Mark a property: asserted on the cells `where` holds (of its file's part of the matrix)."""
    def mark(test):
        test.applies_to = where
        return test
    return mark


def every(cell: Cell) -> bool:
    return True


def saved_tensors(run_dir) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file the run saved (the model, or the adapter alone)."""
    files = sorted((run_dir / "model").glob("*.safetensors"))
    assert files, f"{run_dir} saved no model"
    return {f"{file.name}:{key}": t for file in files for key, t in load_file(file).items()}


class CellProperties:
    """Every property of a trained cell; a subclass named Test* with `part` (a predicate over cells)
    makes pytest collect them for that part of the matrix."""

    @staticmethod
    def part(cell: Cell) -> bool:
        raise NotImplementedError("a test file's subclass says which cells it holds")

    @applies_to(lambda cell: not cell.lora)
    def test_the_weights_equal_the_plain_loop_or_the_delayed_rule(self, cell, trained):
        """The saved weights equal relaytrain's plain loop over the whole minibatch (2BW: its delayed
        rule), dropout masks included: every strategy draws each part's masks by the part's key."""
        run = trained(cell)
        assert run.cfg.model.dropout == (0.1 if cell.dropout else 0.0)
        assert_same_weights(saved_model(run.run_dir, run.cfg), plain_loop(run.cfg), cell.id)

    @applies_to(lambda cell: cell.independent and not cell.lora)
    def test_the_checkpoint_trains_as_a_plain_hugging_face_loop(self, cell, trained):
        """The decoder checkpoint trained from `model.pretrained=DIR` alone equals a loop with nothing
        of relaytrain's model, loss or optimizer on its path; every weight moved, the losses agree,
        and GPT-2's head is tied again once loaded."""
        run = trained(cell)
        pretrained = run.cfg.model.pretrained
        ours = hf_saved(run.run_dir)
        reference, losses = hf_reference(pretrained, run.cfg, update_delay(run.cfg))
        assert_same_weights(ours, reference, cell.id)
        start = dict(AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).named_parameters())
        assert all((p - start[key]).abs().max() > 1e-3 for key, p in ours.named_parameters()), "a weight did not train"
        assert run.results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
        assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == (cell.family == "gpt2")

    @applies_to(lambda cell: cell.lora)
    def test_the_adapter_continues_as_a_plain_peft_loop(self, cell, trained):
        """A peft adapter continued under the strategy: only the adapter is saved, and it equals
        peft's own model and loss trained by torch's AdamW; every adapter matrix moved."""
        run = trained(cell)
        base, adapter, saved = run.cfg.model.pretrained, run.cfg.adapter.pretrained, run.run_dir / "model"
        assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
        assert not (saved / "model.safetensors").exists()  # the adapter only, not the base again
        ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), saved)
        reference, losses = peft_reference(base, adapter, run.cfg, update_delay(run.cfg))
        mine, theirs = adapters_of(ours), adapters_of(reference)
        assert mine.keys() == theirs.keys() and mine
        start = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter))
        for key, p in mine.items():
            torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{cell.id} {key}: {m}")
            assert (p - start[key]).abs().max() > 1e-3, f"{key} did not train"
        assert run.results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)

    @applies_to(every)
    def test_it_evaluates_held_out_data(self, cell, trained):
        (evaluation,) = trained(cell).results["eval"]
        assert evaluation["step"] == STEPS and evaluation["items"] > 0 and torch.isfinite(torch.tensor(evaluation["loss"]))

    @applies_to(every)
    def test_it_resumes_from_its_step_one_checkpoint_bit_for_bit(self, cell, trained):
        """The run resumed from its step-1 checkpoint saves the uninterrupted run's weights bit for bit,
        with its losses and evaluation; an adapter's checkpoint holds the adapter, not the base."""
        run = trained(cell)
        resumed_dir, resumed = run.resumed
        whole, again = saved_tensors(run.run_dir), saved_tensors(resumed_dir)
        assert whole.keys() == again.keys()
        for key, t in whole.items():
            assert torch.equal(t, again[key]), f"{cell.id}: {key} differs after resuming"
        assert resumed["loss"] == run.results["loss"] and resumed["eval"] == run.results["eval"]
        if cell.lora:
            first = checkpoint.step_dir(checkpoint.checkpoint_dir(run.run_dir), 1)
            saved = set(torch.load(first / "part-0.pt", weights_only=False)["weights"])
            if (first / checkpoint.SHARDED).is_dir():  # fsdp: every shard in torch.distributed.checkpoint's files
                saved |= {key for key in checkpoint.sharded_contents(first / checkpoint.SHARDED) if "/" not in key}
            assert saved and all("lora_" in name for name in saved)

    @applies_to(every)
    def test_phase_times_sum_to_no_more_than_the_step_time_beside_them(self, cell, trained):
        """What the report shows: the phases of a step (each pipeline stage's) take no longer than the
        step, and the step time of the reporter (a pipeline's last stage, first replica) is the measured one."""
        results = trained(cell).results
        report = results["strategy_report"]
        measured = results["measured_steps"] * results["throughput"]["step_time_s"]
        if "per_stage" in report:
            for stage in report["per_stage"]:
                phases = stage["phases_s"]
                inside = sum(seconds for name, seconds in phases.items() if name != "step")
                assert inside <= phases["step"] * 1.001, (stage["stage"], phases)
            last_stage = max(stage["stage"] for stage in report["per_stage"])
            (reporter,) = [st for st in report["per_stage"] if st["stage"] == last_stage and st["replica"] == 0]
            assert 0.5 * measured < reporter["phases_s"]["step"] <= measured * 1.001  # the reporter's clock times its steps
        else:
            assert sum(report["phase_times_s"].values()) <= measured * 1.001, report["phase_times_s"]
