"""optim.state_bits=8|4: AdamW's moments in 8 or 4 bits, torchao's AdamW8bit and AdamW4bit, under
relaytrain's strategies: equal to torchao's optimizer in a plain Hugging Face loop, kept in
their bits on the eager param server's host, resumed exactly, counted by the planner, and refused
in one line where they are not checked.

torchao compiles its update once per tensor shape (about 17 s each on this 2-core VM); the tests
run it eagerly (`torch.compiler.set_stance("force_eager")`), the same operations uncompiled, in
single-process strategies (a spawned worker would compile). The compiled path is the slow step's.
torchao is the `lowbit` extra, which the slow step installs (`make test-slow`); where it is
missing, as in the default suite's environment, the runs are skipped (the checks still run).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.step.lowbit import BLOCK, HOST_LOOP_TIME_VS_FP32, HOST_TIME_VS_FP32, state_words
from relaytrain.strategies import choices, strategy_class
from relaytrain.strategies.l2l_cost import eps_state_bytes
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder
from tests.conformance.references import (
    assert_resumes_exactly,
    assert_same_weights_but_flipped_codes,
    exempt_from_decay,
    hf_saved,
    reference_loop,
    update_delay,
)
from tests.conftest import needs_extra, with_marks

# The runs need torchao; the checks and the planner's counts do not.
needs_torchao = with_marks(needs_extra("torchao", "lowbit"))

STEPS = 3
RUN_KEYS = ["data.seq_len=16", "data.num_samples=64", "optim.lr=0.01", "optim.weight_decay=0.1", "optim.eps=1e-4",
            "optim.warmup_steps=1", "optim.schedule=linear", f"train.steps={STEPS}", "train.untimed_steps=0",
            "strategy.num_microbatches=2", "strategy.microbatch_size=2", "train.save_model=true", "model.dropout=0.0",
            "optim.host_loops=false"]  # torchao's own update; relaytrain's host loop: the last test


@pytest.fixture(autouse=True)
def eager():
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Four blocks: pipe_interleaved cuts two stages of two chunks. Wide enough that the block's
    # matrices are quantized (torchao: 4096 elements and more, a multiple of the block); the
    # key/value projections (2048) keep fp32 moments, as torchao does.
    return tiny_decoder(tmp_path_factory.mktemp("lowbit") / "llama", layers=4, hidden_size=64, head_dim=16,
                        intermediate_size=128)


def lowbit_cfg(checkpoint: Path, *overrides: str):
    return resolve(compose_config([f"model.pretrained={checkpoint}", *RUN_KEYS, *overrides]), ())


def torchao_adamw(model: torch.nn.Module, o):
    """torchao's own optimizer over the reference, decaying what relaytrain decays."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not exempt_from_decay(n)], "weight_decay": o.weight_decay},
              {"params": [p for n, p in named if exempt_from_decay(n)], "weight_decay": 0.0}]
    import torchao.optim

    kind = getattr(torchao.optim, f"AdamW{o.state_bits}bit")
    return kind([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)


# Every registered strategy in 8 bits, and l2l in 4 too. The default suite runs the single-process
# ones; a strategy of several processes compiles torchao's update in each (the slow step).
DEFAULT = {("baseline", 8), ("l2l", 8), ("l2l", 4)}
CASES = [pytest.param(name, bits, id=f"{name}-{bits}",
                      marks=() if (name, bits) in DEFAULT or not strategy_class(name).capabilities.lowbit_states
                      else pytest.mark.slow)
         for name, bits in [*((name, 8) for name in choices()), ("l2l", 4)]]


@needs_torchao
@pytest.mark.parametrize(("strategy", "bits"), CASES)
def test_lowbit_states_train_as_torchaos_optimizer_in_a_plain_loop(checkpoint, tmp_path, strategy, bits):
    """Equal to torchao's optimizer in a plain loop (2BW's delayed rule for pipe_2bw), or refused
    in one line where the strategy says it cannot hold them."""
    cfg = lowbit_cfg(checkpoint, f"strategy={strategy}", f"optim.state_bits={bits}")
    if not strategy_class(strategy).capabilities.lowbit_states:
        with pytest.raises(ConfigError, match=f"optim.state_bits={bits} under strategy={strategy}") as err:
            validate(cfg)
        assert "\n" not in str(err.value)
        return
    run(cfg, tmp_path / "run", quiet=True)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torchao_adamw(reference, cfg.optim)
    # Worker processes compile torchao's update: so does the reference then. Eager and compiled
    # round differently in the last bit, and a code of 8 bits can flip on that (one element).
    compiled = strategy_class(strategy).processes(cfg) > 1
    with torch.compiler.set_stance("default" if compiled else "force_eager"):
        reference_loop(reference, optimizer, cfg, delay=update_delay(cfg))
    quantized = [s["exp_avg"] for s in optimizer.state.values() if type(s["exp_avg"]).__name__.startswith("OptimState")]
    assert quantized  # the test's model has matrices torchao quantizes
    assert_same_weights_but_flipped_codes(hf_saved(tmp_path / "run"), reference, f"{strategy} state_bits={bits}",
                                          within=STEPS * cfg.optim.lr)


@needs_torchao
@pytest.mark.parametrize("bits", [8, 4])
def test_the_eps_keeps_the_moments_in_their_bits(checkpoint, bits):
    """The host holds codes of `bits` and a scale per block, not fp32 moments: the bytes of each
    quantized moment are bits/32 of fp32's and a block's scale."""
    from relaytrain.models import build_model
    from relaytrain.strategies import build_strategy
    from tests.conformance.references import minibatches

    cfg = lowbit_cfg(checkpoint, "strategy=l2l", f"optim.state_bits={bits}")
    strategy = build_strategy(build_model(cfg.model, seed=cfg.train.seed), cfg)
    try:
        strategy.step(minibatches(cfg)[0], cfg.optim.lr)
        strategy.drain()
        moments = [s[key] for part in strategy.eps.parts if part.optimizer
                   for s in part.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    finally:
        strategy.close()
    quantized = [m for m in moments if hasattr(m, "codes")]
    assert quantized and all(m.codes.dtype == torch.uint8 for m in quantized)
    for m in quantized:
        held = m.codes.numel() * m.codes.element_size() + m.scale.numel() * m.scale.element_size()
        assert held == m.numel() * bits // 8 + m.numel() // BLOCK[bits] * 4


@needs_torchao
def test_a_run_resumed_from_its_step_one_checkpoint_ends_on_the_same_weights(checkpoint, tmp_path):
    """The codes and scales come back as they were saved."""
    assert_resumes_exactly(partial(lowbit_cfg, checkpoint), ["strategy=l2l", "optim.state_bits=8"], tmp_path)


def test_the_planner_counts_the_states_in_their_bits():
    """8-bit moments and a scale per 256: about a quarter of fp32's state; the EPS's host bytes
    (fp32 masters, their gradients, the state) shrink by the difference."""
    assert state_words(32) == 2 and state_words(8) == pytest.approx(2 * (1 / 4 + 1 / 256))
    assert state_words(4) == pytest.approx(2 * (1 / 8 + 1 / 128))
    fp32, eight = (compose_config(["strategy=l2l", f"optim.state_bits={b}"]) for b in (32, 8))
    n = 10**9
    saved = eps_state_bytes(fp32, n, workers=1) - eps_state_bytes(eight, n, workers=1)
    assert saved == pytest.approx(n * 4 * (2 - state_words(8)))
    # and the host's update at its measured rate on a CPU (relaytrain's loop, or torchao's own
    # without it), not at the fewer bytes' rate
    spec = load_spec("h200_141gb")
    torchaos = compose_config(["strategy=l2l", "optim.state_bits=8", "optim.host_loops=false"])
    fp32_s, eight_s, torchao_s = (from_spec(spec, c, [1]).host_optimizer_s_per_param for c in (fp32, eight, torchaos))
    assert eight_s == pytest.approx(fp32_s * HOST_LOOP_TIME_VS_FP32[8])
    assert torchao_s == pytest.approx(fp32_s * HOST_TIME_VS_FP32[8])


@pytest.mark.parametrize(("overrides", "says"), [
    (["optim.state_bits=16"], "optim.state_bits=16 must be 32 (fp32 moments), 8 or 4"),
    (["optim.state_bits=8", "strategy=fsdp", "strategy.replicas=2", "strategy.tensor_parallel=2"],
     "optim.state_bits=8 with strategy=fsdp strategy.tensor_parallel=2: FSDP's shards of a tensor rank's columns"),
    (["optim.state_bits=8", "optim.host_kernel=deepspeed"], "optim.host_kernel=deepspeed DeepSpeed's fp32 one"),
])
def test_what_is_not_checked_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")) as err:
        validate(compose_config(["+exp=tiny_baseline", *overrides]))
    assert "\n" not in str(err.value)


def test_without_torchao_the_run_is_refused_in_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ModuleNotFoundError("No module named 'torchao'", name="torchao")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ConfigError, match=r"pip install 'relaytrain\[lowbit\]'"):
        validate(compose_config(["+exp=tiny_baseline", "strategy=l2l", "optim.state_bits=4"]))


def test_the_planner_says_once_that_torchao_is_missing(monkeypatch, capsys):
    """Not as every candidate's refusal under "nothing fits": the plan stops at once, in one line."""
    from relaytrain.commands.cli import main

    monkeypatch.setattr("relaytrain.step.lowbit._torchao_optim", _missing)
    assert main(["plan", "model=llama_tiny", "optim.state_bits=8", "plan.workers=1", "plan.device=h200_141gb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["relaytrain: error: optim.state_bits=8 needs torchao here"]


def _missing(bits: int):
    raise ConfigError(f"optim.state_bits={bits} needs torchao here")


@needs_torchao
@pytest.mark.slow
def test_relaytrains_host_loop_trains_as_torchaos_compiled_optimizer(checkpoint, tmp_path):
    """optim.host_loops: the host update in relaytrain's C++ loop equals torchao's compiled one (its
    uncompiled one rounds a few intermediates differently, and a code can flip). The gradients it
    steps carry the float noise of another order of operations (a block at a time against the
    whole model): on an AVX2 CPU one code of 8192 flipped on that (2026-11-30)."""
    cfg = lowbit_cfg(checkpoint, "strategy=l2l", "optim.state_bits=8", "optim.host_loops=true")
    results = run(cfg, tmp_path / "run", quiet=True)
    assert results["strategy_report"]["eps"]["host_kernel"] == "torchao AdamW8bit, relaytrain's host loop"
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torchao_adamw(reference, cfg.optim)
    with torch.compiler.set_stance("default"):
        reference_loop(reference, optimizer, cfg)
    assert_same_weights_but_flipped_codes(hf_saved(tmp_path / "run"), reference, "l2l state_bits=8 host loop",
                                          within=STEPS * cfg.optim.lr)


@needs_torchao
@pytest.mark.slow  # runs of two processes
def test_fsdp_resumes_its_quantized_shards_exactly_and_carries_them_to_other_layouts(checkpoint, tmp_path):
    """DCP keeps each shard's codes and scales: the same layout resumes bit for bit, and another
    strategy reads them whole (and FSDP cuts a whole checkpoint's into its shards), ending where
    the uninterrupted run ends."""
    from relaytrain.records.checkpoint import checkpoint_dir

    every = ["optim.state_bits=8", "optim.host_loops=true", "train.checkpoint_every=1", "train.keep_checkpoints=0"]
    fsdp, baseline = ["strategy=fsdp", "strategy.replicas=2"], ["strategy=baseline", "strategy.replicas=2"]
    assert_resumes_exactly(partial(lowbit_cfg, checkpoint), [*fsdp, *every[:2]], tmp_path)
    run(lowbit_cfg(checkpoint, *baseline, *every), tmp_path / "baseline", quiet=True)
    one_shard = ["strategy=fsdp", "strategy.replicas=1", "strategy.num_microbatches=4"]  # the same minibatches
    # FSDP's shards read whole, a whole checkpoint cut into shards, two shards resharded into one
    for saved, resumed in (("whole", baseline), ("baseline", fsdp), ("whole", one_shard)):
        step_one = checkpoint_dir(tmp_path / saved) / "step-00000001"
        into = tmp_path / f"resumed_from_{saved}_{len(resumed)}"
        run(lowbit_cfg(checkpoint, *resumed, *every, f"train.resume={step_one}"), into, quiet=True)
        assert_same_weights_but_flipped_codes(hf_saved(into), hf_saved(tmp_path / saved),
                                              f"{' '.join(resumed)} resumed from {saved}'s 8-bit moments",
                                              within=STEPS * 0.01)


@needs_torchao
@pytest.mark.slow  # runs of two processes
def test_tensor_ranks_step_whole_blocks_of_their_parts_and_resume_at_any_degree(tmp_path):
    """strategy.tensor_parallel=2: a rank's columns of o_proj and down_proj (256 of 512) and rows of
    the others hold whole blocks of torchao's 256, so its moments are the whole tensor's: the run
    ends where one process does; its moments saved whole (codes and scales joined column by column)
    resume at T=1, and a T=1 checkpoint's are cut again at T=2."""
    from relaytrain.records.checkpoint import checkpoint_dir

    wide = tiny_decoder(tmp_path / "wide", layers=2, hidden_size=64, num_attention_heads=8, head_dim=64,
                        num_key_value_heads=2, intermediate_size=512)
    keys = ["strategy=baseline", "optim.state_bits=8", "optim.host_loops=true", "train.checkpoint_every=1",
            "train.keep_checkpoints=0"]
    run(lowbit_cfg(wide, *keys, "strategy.tensor_parallel=2"), tmp_path / "split", quiet=True)
    run(lowbit_cfg(wide, *keys), tmp_path / "whole", quiet=True)
    assert_same_weights_but_flipped_codes(hf_saved(tmp_path / "split"), hf_saved(tmp_path / "whole"),
                                          "tensor_parallel=2 state_bits=8", within=STEPS * 0.01)
    for saved, degree in (("split", 1), ("whole", 2)):
        step_one = checkpoint_dir(tmp_path / saved) / "step-00000001"
        into = tmp_path / f"from_{saved}"
        run(lowbit_cfg(wide, *keys, f"strategy.tensor_parallel={degree}", f"train.resume={step_one}"), into, quiet=True)
        assert_same_weights_but_flipped_codes(hf_saved(into), hf_saved(tmp_path / "whole"),
                                              f"resumed at tensor_parallel={degree} from {saved}", within=STEPS * 0.01)


@needs_torchao
@pytest.mark.slow  # two processes
def test_tensor_ranks_whose_parts_would_cut_torchaos_blocks_are_refused_in_one_line(checkpoint, tmp_path):
    """The tiny model's o_proj (64 x 64) at T=2: each rank's 32 columns a row cut blocks of 256."""
    from relaytrain.run.launch import WorkerFailed

    cfg = lowbit_cfg(checkpoint, "strategy=baseline", "strategy.tensor_parallel=2", "optim.state_bits=8")
    with pytest.raises((ConfigError, WorkerFailed), match=r"o_proj.weight's shards \(\(64, 32\) of \(64, 64\)\) cut"):
        run(cfg, tmp_path / "run", quiet=True)


@needs_torchao
@pytest.mark.slow  # three processes
def test_fsdp_shards_that_would_cut_torchaos_blocks_are_refused_in_one_line(checkpoint, tmp_path):
    """Three shards of a 64 x 64 projection hold 22 rows of 64 values: torchao's blocks of 256 would
    straddle two workers, and the moments would not be the plain loop's."""
    from relaytrain.run.launch import WorkerFailed

    cfg = lowbit_cfg(checkpoint, "strategy=fsdp", "strategy.replicas=3", "optim.state_bits=8",
                     "strategy.num_microbatches=1")
    with pytest.raises((ConfigError, WorkerFailed), match="cut torchao's blocks of 256 values"):
        run(cfg, tmp_path / "run", quiet=True)
