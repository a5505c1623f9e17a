"""LoRA (adapter=lora): the base untouched, merging, resuming over the wrong base refused, the
adapters alone in the EPS, and a chat fine-tune from the command line.

Every strategy continuing an adapter as a plain peft loop, and resuming it bit for bit, is the
`lora` adapter of the conformance matrix (tests/conformance/): a peft adapter with both matrices
non-zero (a continued fine-tune: with lora_B = 0 the adapters' first gradients would miss half
the product) is made for a tiny random Llama and GPT-2 by peft itself. Each strategy continues
it (`adapter.pretrained=DIR`) and saves the adapter; the reference is peft's own
`PeftModel.from_pretrained(base, DIR, is_trainable=True)` with its own forward and loss, torch's
AdamW over the trainable parameters, the same minibatches and learning rates. Nothing of
relaytrain's model, loss or optimizer is on its path.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from relaytrain.records import checkpoint
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder
from tests.conformance.references import (  # noqa: F401  (adapters_of, peft_reference: tests import them from here)
    adapters_of,
    gpt2_checkpoint,
    minibatches,
    peft_adapter,
    peft_reference,
)

STEPS = 3
RUN_KEYS = [
    "data.seq_len=16", "data.num_samples=128", "optim=adamw", "optim.lr=0.02", "optim.eps=1e-4",
    "optim.weight_decay=0.1", "optim.warmup_steps=1", "optim.schedule=linear", f"train.steps={STEPS}",
    "train.untimed_steps=0", "strategy.num_microbatches=4", "strategy.microbatch_size=2", "train.save_model=true",
    "adapter=lora", "model.dropout=0.0",
]
# Every strategy users weigh, with the variants that have their own code paths.
VARIANTS = {
    "baseline": ["strategy=baseline"],
    "baseline_replicas": ["strategy=baseline", "strategy.replicas=2"],
    "fsdp": ["strategy=fsdp"],
    "l2l": ["strategy=l2l"],
    "l2l_stash_cpu": ["strategy=l2l_stash_cpu"],
    "l2l_replicas": ["strategy=l2l", "strategy.replicas=2"],
    "pipe_flush": ["strategy=pipe_flush"],
    "pipe_2bw": ["strategy=pipe_2bw"],
    "pipe_interleaved": ["strategy=pipe_interleaved"],
    "pipe_gpipe": ["strategy=pipe_gpipe"],
    "pipe_flush_offload": ["strategy=pipe_flush", "strategy.offload=host"],
}
DELAYED = {"pipe_2bw"}  # PipeDream-2BW's rule: gradients at the weights one update older


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """family -> (base checkpoint, adapter made for it), made the first time a test asks."""
    made: dict[str, tuple[Path, Path]] = {}

    def of(family: str) -> tuple[Path, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            base = (gpt2_checkpoint(root / "base") if family == "gpt2"
                    else tiny_decoder(root / "base", "llama", layers=4))
            made[family] = base, peft_adapter(base, root / "adapter")
        return made[family]

    return of


def lora_cfg(base: Path, adapter: Path, variant: str, *overrides: str):
    return compose_config([f"model.pretrained={base}", f"adapter.pretrained={adapter}", *VARIANTS[variant],
                           *RUN_KEYS, *overrides])


@pytest.mark.parametrize("variant", ["baseline", "l2l", pytest.param("pipe_2bw", marks=pytest.mark.slow)])
def test_the_base_is_bit_for_bit_unchanged_and_merging_writes_a_plain_model(variant, bases, tmp_path):
    base, adapter = bases("llama")
    run(lora_cfg(base, adapter, variant, "adapter.merge_on_save=true"), tmp_path / "run", table=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32)
    run(lora_cfg(base, adapter, variant), tmp_path / "adapter_run", table=False)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "adapter_run" / "model")
    base_state = plain.state_dict()
    for name, t in unmerged.base_model.model.state_dict().items():  # the base the adapter sits on
        if "lora_" not in name:
            assert torch.equal(t, base_state[name.replace(".base_layer.", ".")]), name
    folded = unmerged.merge_and_unload()
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(t, folded.state_dict()[name], atol=1e-6, rtol=1e-6)


def test_a_checkpoint_refuses_to_resume_over_another_base(bases, tmp_path):
    base, adapter = bases("llama")
    keys = ("train.checkpoint_every=1", "train.steps=1", "strategy=baseline")
    run(lora_cfg(base, adapter, "baseline", *keys), tmp_path / "run", table=False)
    other = tiny_decoder(tmp_path / "other", "llama", layers=4, seed=7)
    first = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 1)
    cfg = compose_config([f"model.pretrained={other}", f"adapter.pretrained={adapter}", *RUN_KEYS,
                          "train.steps=2", f"train.resume={first}"])
    with pytest.raises(ConfigError, match="another base"):
        run(cfg, tmp_path / "resumed", table=False)


def test_frozen_means_frozen_in_the_param_server_and_the_optimizer(bases, tmp_path):
    """L2L's EPS holds the adapters' masters and state only; the planner counts what trains."""
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve
    from relaytrain.placement.world import World
    from relaytrain.strategies import strategy_class

    base, adapter = bases("llama")
    cfg = resolve(lora_cfg(base, adapter, "l2l"))
    model = build_model(cfg.model, adapter=cfg.adapter)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    strategy = strategy_class("l2l")(model, cfg, World())
    try:
        parts = strategy.eps.parts
        assert sum(part.num_owned for part in parts) == trainable < model.num_parameters() / 4
        assert all(p.requires_grad for part in parts for p in part.owned)
        assert not any(p.requires_grad for part in parts for p in part.frozen)
        strategy.start(0)
        strategy.step(minibatches(cfg)[0], lr=1e-3)
        strategy.drain()
        state = [t for part in parts if part.optimizer for s in part.optimizer.state.values()
                 for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        assert sum(t.numel() for t in state) == 2 * trainable  # Adam's two moments, of the adapters only
        assert all(p.grad is None for p in model.parameters())  # nothing kept between steps, none for the base
    finally:
        strategy.close()


@pytest.mark.parametrize(("override", "message"), [
    ("adapter.r=0", "adapter.r=0 must be a positive rank"),
    ("adapter.target_modules=[nothing_here]", "matches no linear layer of the blocks"),
])
def test_bad_adapter_keys_are_one_line(override, message, bases, tmp_path, capsys):
    from relaytrain.commands.cli import main

    base, _ = bases("llama")
    capsys.readouterr()  # what making the checkpoint printed
    assert main(["train", f"model.pretrained={base}", "adapter=lora", override, "train.steps=1",
                 f"hydra.run.dir={tmp_path}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0]


def test_an_adapter_for_another_base_is_refused(bases, tmp_path):
    llama_base, _ = bases("llama")
    _, gpt2_adapter = bases("gpt2")
    cfg = compose_config([f"model.pretrained={llama_base}", f"adapter.pretrained={gpt2_adapter}", *RUN_KEYS])
    with pytest.raises(ConfigError, match="another base"):
        run(cfg, tmp_path / "run", table=False)
    assert json.loads((gpt2_adapter / "adapter_config.json").read_text())["r"] == 4


def test_a_lora_chat_fine_tune_saves_merges_loads_and_generates(tmp_path, capsys):
    """As a new user: their bf16 checkpoint, the example chat file, adapter=lora under L2L; the
    adapter directory answers through `relaytrain generate`, the merged model through
    AutoModelForCausalLM, and both give the same greedy answer."""
    from relaytrain.commands.cli import main
    from relaytrain.commands.generate import load, new_token_ids, parse_request

    base = tiny_decoder(tmp_path / "base", "llama", dtype=torch.bfloat16)
    common = [f"model.pretrained={base}", "adapter=lora", "data=chat", "data.path=examples/chat.jsonl",
              "data.seq_len=64", "strategy=l2l", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
              "train.steps=2", "train.untimed_steps=0", "train.save_model=true", "optim.lr=1e-2"]
    assert main(["train", *common, f"hydra.run.dir={tmp_path / 'adapter'}"]) == 0
    assert main(["train", *common, "adapter.merge_on_save=true", f"hydra.run.dir={tmp_path / 'merged'}"]) == 0
    adapter_dir, merged_dir = tmp_path / "adapter" / "model", tmp_path / "merged" / "model"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 8
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.dtype == torch.bfloat16 and not any("lora" in n for n, _ in merged.named_parameters())
    answers = []
    for directory in (adapter_dir, merged_dir):
        request = parse_request([f"model.pretrained={directory}", "prompt=What is 2+2?", "max_new_tokens=6"])
        model, tokenizer = load(str(directory))
        answers.append(new_token_ids(request, model, tokenizer).tolist())
    assert answers[0] == answers[1] and len(answers[0]) > 0
    capsys.readouterr()
    assert main(["generate", f"model.pretrained={adapter_dir}", "prompt=What is 2+2?", "max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.strip() != ""
