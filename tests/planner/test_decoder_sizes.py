"""Today's decoders in the planner: real sizes count their published parameters, the cost model
is right for grouped-query attention, heads of their own width and gated MLPs (checked against
hand counts and against the dry run), host memory is a budget a candidate can exceed, and a tiny
Llama is planned like any model."""

from __future__ import annotations

import pytest

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import ModelFacts, block_activation_bytes
from relaytrain.cost.profile import load_spec, spec_names
from relaytrain.cost.work import (
    attention_flops,
    block_matmul_flops,
    block_shape,
    model_flops_per_token,
    model_work,
    query_width,
)
from relaytrain.models import count_parameters
from relaytrain.models.family import BlockShape
from relaytrain.planner import plan as planning
from relaytrain.planner.candidates import GiB
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.plan import make_plan
from relaytrain.run.compose import compose_config
from relaytrain.strategies import strategy_class
from tests.conftest import TINY_BERT

# A tiny Llama with every twist: 2 key/value heads for 4 query heads, heads of width 16 (not
# hidden / heads = 8), a SwiGLU MLP.
TINY_LLAMA = ["model=llama_tiny", "model.num_layers=3", "model.hidden_size=32", "model.num_heads=4",
              "model.num_kv_heads=2", "model.head_dim=16", "model.intermediate_size=64", "model.vocab_size=300",
              "data.seq_len=16", "data.num_samples=256"]
ON_A100 = ["plan.device=a100_80gb", "plan.workers=1", "plan.batch_size=4"]

# Published parameter counts (the model cards; see each config's comment).
PUBLISHED = {"llama3_1b": 1.24e9, "llama3_8b": 8.03e9, "llama3_1_8b": 8.03e9, "llama3_70b": 70.6e9, "qwen3_8b": 8.19e9,
             "mistral_7b": 7.24e9, "gemma2_9b": 9.24e9}


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_decoder_config_has_its_published_parameter_count(name):
    params = count_parameters(compose_config([f"model={name}"]).model)  # on the meta device: no memory
    assert params == pytest.approx(PUBLISHED[name], rel=0.01)


def test_the_new_gpu_profiles_are_spec_sheets():
    assert {"rtx4090_24gb", "a100_80gb", "h100_80gb"} <= set(spec_names())
    for name in ("rtx4090_24gb", "a100_80gb", "h100_80gb"):
        spec = load_spec(name)
        assert spec["source"].startswith("spec sheet, not measured") and spec["peak_tflops"]["bf16"] > 0


# --------------------------------------------------------------------------- hand counts

GATED = BlockShape(hidden=32, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=64, gated_mlp=True)


def test_gated_grouped_query_flops_are_the_hand_count():
    # q = 4 x 16 = 64, kv = 2 x 16 = 32: 2 x (32 x 64 + 2 x 32 x 32 + 64 x 32 + 3 x 32 x 64) per token
    assert block_matmul_flops(GATED) == 2 * (2048 + 2048 + 2048 + 6144)
    assert attention_flops(GATED, 16) == 4 * 16 * 64
    cfg = compose_config(TINY_LLAMA)
    assert block_shape(cfg.model) == GATED
    s, m = cfg.data.seq_len, cfg.model
    assert s == 16 and 2 * model_work(m, s).block == 2 * 16 * (24576 + 4096)
    assert query_width(block_shape(m)) == 64
    # forward + backward (3x) of every block and the LM head (h x vocabulary on every token; no transform)
    per_sample = m.num_layers * 16 * (24576 + 4096) + 2 * 32 * m.vocab_size * 16
    assert model_flops_per_token(m, s) == 3 * per_sample / 16


def test_gated_grouped_query_activation_bytes_are_the_hand_count():
    """Per token: attention 32 + 64 + 2 x 32 + 64 + 16 and, eager, the scores 2.5 x 4 x 16 (fused:
    the log-sum-exp, 4); the MLP 32 + 4 x 64 + 16 (gate, up, the activation's output, the
    product); the norms 2 x 32."""
    rest = (32 + 64 + 64 + 64 + 16) + (32 + 256 + 16) + 64
    assert block_activation_bytes(2, 16, GATED, 4) == 4 * 2 * 16 * (rest + 160)
    assert block_activation_bytes(2, 16, GATED, 4, fused=True) == 4 * 2 * 16 * (rest + 4)
    cfg = compose_config(TINY_LLAMA)
    assert ModelFacts.of(cfg).block_activation_bytes(2) == 4 * 2 * 16 * (rest + 4)  # sdpa
    eager = compose_config([*TINY_LLAMA, "model.attn_implementation=eager"])
    assert ModelFacts.of(eager).block_activation_bytes(2) == 4 * 2 * 16 * (rest + 160)


def test_bert_and_gpt2_blocks_keep_the_korthikanti_count():
    """q = kv = h and i = 4h: 34 sbh + 5 as^2b bytes at 2 bytes a value, as before."""
    plain = BlockShape(hidden=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate=256, gated_mlp=False)
    b, s = 3, 16
    assert block_activation_bytes(b, s, plain, 2) == 2 * (17 * s * b * 64 + 5 * 4 * s * s * b // 2)
    assert block_matmul_flops(plain) + attention_flops(plain, s) == 2 * (4 * 64 * 64 + 2 * 64 * 256) + 4 * s * 64


# --------------------------------------------------------------------------- against the dry run


def _block_activations(overrides: list[str]) -> tuple[float, int]:
    """What the dry run keeps per block (the difference between 4 and 2 blocks' activations, so
    the head and the embeddings cancel), and the closed form's figure."""
    common = [*overrides, "strategy.microbatch_size=4", "model.hidden_size=64", "model.intermediate_size=256",
              "data.seq_len=64"]
    kept = {}
    for n in (2, 4):
        cfg = compose_config([*common, f"model.num_layers={n}"])
        kept[n] = simulate(cfg).per_process[0].by_kind["activations and temporaries"]
    return (kept[4] - kept[2]) / 2, ModelFacts.of(cfg).block_activation_bytes(4)


@pytest.mark.parametrize("kernel", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])  # eager's: the slow step (5 s)
def test_a_block_s_closed_form_is_close_to_its_dry_run_under_either_attention_kernel(kernel):
    """Close for BERT and a grouped-query, gated decoder alike: the fused kernel keeps no s x s
    scores (within 15 %: the dry run of grouped-query attention repeats the key/value heads as
    Hugging Face's sdpa path does, the closed form counts them once); eager keeps every head's,
    which Korthikanti's count takes at 2 bytes a value with a 1-byte dropout mask (errs high)."""
    kind = [f"model.attn_implementation={kernel}"]
    high = 1.15 if kernel == "sdpa" else 1.4
    for overrides in (TINY_BERT, [*TINY_LLAMA, "model.head_dim=32"]):
        measured, closed = _block_activations([*overrides, *kind])
        assert 0.85 <= closed / measured <= high, (overrides[0], kernel, closed / measured)


# --------------------------------------------------------------------------- host memory


def test_a_candidate_over_the_host_memory_does_not_fit(tmp_path, capsys):
    plan = make_plan([*TINY_LLAMA, *ON_A100, "plan.host_memory_gb=0.5"])
    assert plan.best is None and plan.request.host_memory_bytes == 0.5 * GiB
    timed = [c for c in plan.candidates if c.cost is not None]
    assert timed and all(c.fits is False and c.host_bytes > 0.5 * GiB for c in timed)
    assert all("GiB of host memory" in c.why_not and "plan.host_memory_gb=0.5" in c.why_not for c in timed)
    assert all(c.simulated_bytes is None for c in timed)  # refused before any dry run
    assert main(["plan", *TINY_LLAMA, *ON_A100, "plan.host_memory_gb=0.5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.host_memory_gb=0.5" in err[0]


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_tiny_llama_is_planned_with_costs_and_host_memory(tmp_path, capsys):
    plan = make_plan([*TINY_LLAMA, *ON_A100])
    assert plan.request.host_memory_bytes is None  # a profile's host: unlimited unless given
    assert plan.best is not None and plan.best.fits and plan.best.memory_bytes > 0
    assert all(c.cost.step_s > 0 and c.host_bytes > 0 for c in plan.candidates if c.cost is not None)
    l2l = next(c for c in plan.candidates if c.shape.strategy == "l2l" and not c.shape.options)
    facts = ModelFacts.of(compose_config(TINY_LLAMA))
    eps = facts.params * 4 * (1 + 1 + 2)  # fp32 masters, gradients and AdamW's two moments
    assert strategy_class("l2l").cost_model.host_state_bytes(compose_config([*TINY_LLAMA, "strategy=l2l"]), facts) == eps
    assert l2l.host_bytes >= eps
    assert main(["plan", *TINY_LLAMA, *ON_A100, "--out", str(tmp_path)]) == 0
    assert "host GiB" in capsys.readouterr().out


def test_l2l_under_cross_mixed_precision_counts_the_half_copies_its_eps_keeps_to_send():
    """cmp_bf16: beside the fp32 masters the EPS keeps each in bf16 (what travels); the planner and
    the run's own host check count those 2 bytes a parameter, and nothing for fp32 (its masters travel)."""
    cost = strategy_class("l2l").cost_model
    cfgs = {p: compose_config([*TINY_LLAMA, "strategy=l2l", f"precision={p}"]) for p in ("fp32", "cmp_bf16")}
    facts = ModelFacts.of(cfgs["fp32"])
    planned = {p: cost.host_state_bytes(cfg, facts) for p, cfg in cfgs.items()}
    assert planned["cmp_bf16"] - planned["fp32"] == 2 * facts.params
    params = count_parameters(cfgs["fp32"].model)
    run = {p: cost.estimate_host_bytes(cfg, params, "cuda") for p, cfg in cfgs.items()}
    assert run["cmp_bf16"] - run["fp32"] == 2 * params


class _Answer:
    """What make_plan reads of a plan: the batch it was asked and whether something fits."""

    def __init__(self, batch: int, fitting_batch: int):
        self.request = type("Request", (), {"batch": batch})()
        self.best = object() if batch <= fitting_batch else None
        self.batch_note = ""


def _plans_asked(monkeypatch, fitting_batch: int) -> list[int]:
    """Stands a stub in for planning one batch (what fits: batches up to `fitting_batch`); the
    batches make_plan asked for, in order."""
    asked = []

    def plan_one(overrides, *_):
        given = [int(o.split("=")[1]) for o in overrides if o.startswith("plan.batch_size=")]
        asked.append(given[-1] if given else 32)
        return _Answer(asked[-1], fitting_batch)

    monkeypatch.setattr(planning, "_make_plan", plan_one)
    return asked


def test_a_default_batch_that_nothing_fits_is_halved_until_one_fits_and_the_plan_says_so(monkeypatch):
    asked = _plans_asked(monkeypatch, fitting_batch=8)
    plan = make_plan(["model=llama_tiny"])
    assert asked == [32, 16, 8] and plan.request.batch == 8
    assert "the default batch of 32 does not fit; 8 is the largest" in plan.batch_note


@pytest.mark.parametrize("given", ["plan.batch_size=32", "strategy.microbatch_size=8", "strategy.num_microbatches=4"])
def test_a_batch_the_user_gave_is_planned_as_given(monkeypatch, given):
    asked = _plans_asked(monkeypatch, fitting_batch=8)
    plan = make_plan(["model=llama_tiny", given])
    assert len(asked) == 1 and plan.best is None and not plan.batch_note


def test_when_no_smaller_batch_fits_either_the_plan_at_the_default_batch_says_so(monkeypatch):
    asked = _plans_asked(monkeypatch, fitting_batch=0)
    plan = make_plan(["model=llama_tiny"])
    assert asked == [32, 16, 8, 4, 2, 1] and plan.request.batch == 32 and plan.best is None
    assert plan.batch_note == "no batch from 32 down to 1 fits either"


def _overrides_planned(monkeypatch) -> list[list[str]]:
    """Stands a stub in for planning one batch (everything fits); the overrides each was given."""
    planned = []

    def plan_one(overrides, *_):
        planned.append(overrides)
        return _Answer(32, fitting_batch=32)

    monkeypatch.setattr(planning, "_make_plan", plan_one)
    return planned


def test_a_rotary_model_asked_past_its_positions_is_planned_with_them_raised_and_says_so(monkeypatch):
    """`relaytrain plan model=llama3_8b data.seq_len=32768`: Llama 3 has 8,192 positions, rotary, so
    the length is plannable; the planned command carries the raised limit a run needs."""
    planned = _overrides_planned(monkeypatch)
    plan = make_plan(["model=llama_tiny", "data.seq_len=1024"])
    assert planned[0][-1] == "model.max_seq_len=1024"
    assert plan.positions_note.startswith("model.max_seq_len raised from 256 to data.seq_len=1024")


@pytest.mark.parametrize("overrides", [["model=gpt2_tiny", "data.seq_len=4096"],  # a learned position table
                                       ["model=llama_tiny", "model.max_seq_len=512", "data.seq_len=1024"]])
def test_a_learned_table_or_a_limit_the_user_gave_is_left_to_the_runs_refusal(monkeypatch, overrides):
    planned = _overrides_planned(monkeypatch)
    plan = make_plan(overrides)
    assert planned[0] == overrides and not plan.positions_note


@pytest.mark.slow
def test_llama3_1_8b_at_32k_tokens_plans_the_largest_batch_its_host_holds(tmp_path, capsys):
    """Two blocks of Llama 3.1 8B at 32,768 tokens under L2L with the stash on the host: the
    default batch of 32 outgrows 36 GiB of host memory (the EPS and 32 sequences' stash); 16 fits."""
    overrides = ["model=llama3_1_8b", "model.num_layers=2", "data.seq_len=32768", "plan.workers=1",
                 "plan.device=rtx4090_24gb", "plan.host_memory_gb=36", "plan.strategies=[l2l]"]
    assert main(["plan", *overrides, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the default batch of 32 does not fit; 16 is the largest" in out
    assert "strategy.num_microbatches=16" in out and "strategy.microbatch_size=1" in out
