"""What `relaytrain plan` answers with: a header naming the batch and the sequence length it planned
for, and a command that names `model.pretrained=CHECKPOINT` where the run trains over a frozen base."""

from __future__ import annotations

import json
import shlex

import pytest

from relaytrain.commands.cli import main
from relaytrain.models import hf_config
from relaytrain.models.pretrained import explicit_overrides, resolve
from relaytrain.planner.plan import CHECKPOINT, make_plan
from relaytrain.run.compose import compose_config, validate
from tests.conftest import TINY_LLAMA

ON_A_GPU = ["plan.device=a100_80gb", "plan.workers=1", "plan.batch_size=4", "plan.strategies=[l2l]"]


def plan_output(tmp_path, capsys, *overrides: str) -> tuple[list[str], dict]:
    """The lines `relaytrain plan` prints and the plan.json it writes."""
    assert main(["plan", *TINY_LLAMA, *ON_A_GPU, *overrides, "--out", str(tmp_path)]) == 0
    return capsys.readouterr().out.splitlines(), json.loads((tmp_path / "plan.json").read_text())


def test_the_header_names_the_batch_and_the_sequence_length_planned_for(tmp_path, capsys):
    lines, plan = plan_output(tmp_path, capsys, "data.seq_len=32")
    assert lines[0] == ("planned for: a batch of 4 samples of 32 tokens (128 tokens a step; plan.batch_size, "
                        "data.seq_len) on 1 worker(s) of 80 GiB")
    assert plan["request"]["seq_len"] == 32 and plan["request"]["batch_size"] == 4
    assert not any(CHECKPOINT in line for line in lines)  # a full training run needs no checkpoint
    assert "model.pretrained" not in plan["best"]["command"]


@pytest.mark.parametrize("adapter", ["adapter=lora", pytest.param("adapter=qlora", marks=pytest.mark.slow)])  # qlora's: slow step
def test_a_frozen_base_s_command_names_the_checkpoint_it_needs(tmp_path, capsys, adapter):
    """An adapter over a named shape trains nothing worth having without its checkpoint: the
    command names one, and with the user's copy in its place it composes and passes the checks."""
    lines, plan = plan_output(tmp_path / "plan", capsys, adapter)
    command = plan["best"]["command"]
    run_it = next(line for line in lines if line.startswith("run it: "))
    assert run_it == f"run it: {command}" and f"model.pretrained={CHECKPOINT}" in command.split()
    assert any(line.startswith(f"{CHECKPOINT}: your copy of the checkpoint") for line in lines)

    copy = tmp_path / "checkpoint"  # the user's copy: planning and checking read only its config
    hf_config(compose_config([*TINY_LLAMA, adapter]).model).save_pretrained(copy)
    args = [a.replace(f"={CHECKPOINT}", f"={copy}") for a in shlex.split(command)[2:]]
    validate(resolve(compose_config(args), explicit_overrides(args)))


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_frozen_base_is_planned_as_its_bf16_checkpoint_would_run(tmp_path):
    """The plan of `adapter=lora` on a named shape is the plan of the same shape's bf16 checkpoint."""
    config = hf_config(compose_config(TINY_LLAMA).model)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path)
    shape = make_plan([*TINY_LLAMA, *ON_A_GPU, "adapter=lora"], max_simulations=2)
    checkpoint = make_plan([*TINY_LLAMA, *ON_A_GPU, "adapter=lora", f"model.pretrained={tmp_path}"],
                           max_simulations=2)
    assert [(c.shape, c.host_bytes, c.memory_bytes) for c in shape.candidates] == \
        [(c.shape, c.host_bytes, c.memory_bytes) for c in checkpoint.candidates]
