"""Plans in the precision users train in: the planner prices a plan's precision (compute at the
profile's rate for its dtype, what crosses at its bytes), a decoder on a GPU profile defaults to
cmp_bf16, every planned command names its precision, and a dry run of amp_* casts as autocast
does (checked against a real CPU bf16 run)."""

import shlex

import pytest
import torch
import torch.nn.functional as F

from relaytrain.cost.formulas import ModelFacts
from relaytrain.cost.profile import from_spec, load_spec
from relaytrain.data import build_dataset, build_loader
from relaytrain.dryrun import meta_autocast
from relaytrain.dryrun.memory import DeviceMemory
from relaytrain.models import build_model
from relaytrain.models.quantize import Layout
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.plan import make_plan
from relaytrain.run.compose import compose, compose_config, validate
from relaytrain.strategies import build_strategy, strategy_class

TINY_BERT = ["+exp=tiny_baseline", "model.dropout=0.0"]
TINY_LLAMA = [*TINY_BERT, "model=llama_tiny", "data.seq_len=64"]


# --------------------------------------------------------------------------- autocast's rule on meta


def _operations():
    """(name, function of fp32 tensors a, b, w and a bf16 tensor h): what a transformer calls."""
    return [
        ("linear", lambda a, b, w, h: F.linear(a, w)),
        ("matmul", lambda a, b, w, h: a @ b),
        ("bmm", lambda a, b, w, h: torch.bmm(a, b)),
        ("addmm", lambda a, b, w, h: torch.addmm(w[0], a[0], b[0])),
        ("softmax", lambda a, b, w, h: F.softmax(h, -1)),
        ("layer_norm", lambda a, b, w, h: F.layer_norm(h, h.shape[-1:])),
        ("cross_entropy", lambda a, b, w, h: F.cross_entropy(h[0], torch.zeros(4, dtype=torch.long, device=h.device))),
        ("gelu", lambda a, b, w, h: F.gelu(h)),
        ("residual add", lambda a, b, w, h: a + h),
        ("cat", lambda a, b, w, h: torch.cat([a, h])),
        ("sdpa", lambda a, b, w, h: F.scaled_dot_product_attention(a, a, h)),
    ]


@pytest.mark.parametrize(("name", "op"), _operations(), ids=[n for n, _ in _operations()])
def test_the_meta_rule_gives_every_operation_the_dtype_cpu_autocast_gives(name, op):
    def tensors(device):
        return (torch.randn(2, 4, 4, device=device), torch.randn(2, 4, 4, device=device),
                torch.randn(4, 4, device=device, requires_grad=True),
                torch.randn(2, 4, 4, device=device).to(torch.bfloat16))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = op(*tensors("cpu")).dtype
    with meta_autocast.autocast(torch.bfloat16, rule="cpu"):
        emulated = op(*tensors("meta")).dtype
    assert emulated == real


def test_a_weight_is_cast_once_per_region_as_autocast_caches_it():
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    x = torch.randn(2, 8, device="meta")
    casts = []
    with meta_autocast.autocast(torch.bfloat16):
        first, second = F.linear(x, w), F.linear(x, w)
        casts.append(meta_autocast._region.cache[id(w)][1])
    assert first.dtype == second.dtype == torch.bfloat16 and len(casts) == 1
    assert meta_autocast._region.cache is None  # dropped when the outermost region ends


def _real_cpu_peak(cfg) -> int:
    strategy = build_strategy(build_model(cfg.model), cfg)
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    tracker = DeviceMemory(torch.device("cpu"), strategy.memory_holders)
    try:
        with tracker:
            tracker.register(t for held in strategy.memory_holders().values() for t in held)
            for _ in range(2):
                strategy.step(next(loader), 1e-3)
    finally:
        strategy.close()
    return tracker.peak


@pytest.mark.parametrize("model", [TINY_BERT, TINY_LLAMA, [*TINY_LLAMA, "strategy.recompute=block"]],
                         ids=["bert", "llama", "llama recomputed"])
def test_an_amp_dry_run_makes_the_allocations_of_a_real_cpu_bf16_run(model):
    """The baseline under amp_bf16, tracked on the CPU under torch.autocast, against its dry run
    under the CPU's rule: the same peak within 2 % (a checkpointed block recomputed in the region
    its forward ran in, `recompute_contexts`); without recompute, where activations outweigh the
    weights' cached half copies, below the fp32 dry run's."""
    cfg = compose_config([*model, "train.steps=2", "optim.fused=false", "precision=amp_bf16"])
    with meta_autocast.standing_for("cpu"):
        simulated = simulate(cfg, steps=2).peak_bytes
    assert simulated == pytest.approx(_real_cpu_peak(cfg), rel=0.02)
    if str(cfg.strategy.recompute) == "none":
        fp32 = compose_config([*model, "train.steps=2", "optim.fused=false", "precision=fp32"])
        assert simulated < simulate(fp32, steps=2).peak_bytes


@pytest.mark.parametrize("strategy", ["pipe_flush", "pipe_2bw"])
@pytest.mark.parametrize("recompute", ["block", "stage"])
def test_a_pipeline_recomputes_in_its_autocast_region_on_the_meta_device(strategy, recompute):
    """torch's checkpoint sees no autocast on the meta device: without the region re-entered its
    recompute would run in fp32 and torch refuse the saved tensors' dtypes."""
    cfg = compose_config([*TINY_LLAMA, "model.num_layers=4", f"strategy={strategy}", f"strategy.recompute={recompute}",
                          "precision=amp_bf16"])
    assert simulate(cfg).peak_bytes > 0


# --------------------------------------------------------------------------- the plan's precision


LLAMA_8B = ["model=llama3_8b", "data.seq_len=2048", "optim=adamw"]


def _l2l_step(precision: str):
    """The step of the plan issue 42 names: Llama-3-8B, 32 samples of 2048 tokens, b=16 u=2."""
    cfg = compose([*LLAMA_8B, "strategy=l2l", "strategy.microbatch_size=16", "strategy.num_microbatches=2",
                   f"precision={precision}"])
    profile = from_spec(load_spec("h100_80gb"), cfg, [16])
    return strategy_class("l2l").cost_model.step_cost(cfg, ModelFacts.of(cfg), profile), profile


def test_cmp_bf16_prices_compute_at_the_bf16_rate_and_transfers_at_two_bytes():
    """Llama-3-8B on one H100 profile: a block's matmuls at the profile's bf16 rate (its kernel
    launches cost the same), the relay's uploads at half the bytes, the host's optimizer over
    fp32 masters alike; the step well under the fp32 one."""
    spec = load_spec("h100_80gb")
    fp32, fp32_profile = _l2l_step("fp32")
    half, half_profile = _l2l_step("cmp_bf16")
    rate = {kind: spec["peak_tflops"][kind] * spec["compute_efficiency"][kind] for kind in ("fp32", "bf16")}
    overhead = spec["kernel_overhead_s_per_block"]
    fp32_block, half_block = (p.timings[0].block[16].forward_s - overhead for p in (fp32_profile, half_profile))
    assert fp32_block / half_block == pytest.approx(rate["bf16"] / rate["fp32"])
    assert fp32.parts["transfers"] == pytest.approx(2 * half.parts["transfers"])
    assert fp32_profile.host_optimizer_s_per_param == half_profile.host_optimizer_s_per_param
    assert half.step_s < fp32.step_s / 4


def test_cmp_bf16_halves_a_dry_run_s_weights_and_stash():
    """What the relay holds (two parts' weights) and the stash (each block's input) are half the
    fp32 dry run's; the rest of the activations are less (the loss stays fp32)."""
    def kinds(precision):
        cfg = compose_config([*LLAMA_8B, "data.seq_len=256", "model.num_layers=2", "strategy=l2l",
                              "strategy.microbatch_size=2",
                              "strategy.num_microbatches=2", f"precision={precision}"])
        return simulate(cfg).per_process[0].by_kind

    fp32, half = kinds("fp32"), kinds("cmp_bf16")
    assert half["weights"] == pytest.approx(fp32["weights"] / 2, rel=0.01)
    assert half["stash"] == pytest.approx(fp32["stash"] / 2, rel=0.01)
    assert half["activations and temporaries"] < fp32["activations and temporaries"]


DECODER_PLAN = ["model=llama_tiny", "model.num_layers=2", "data.seq_len=64", "plan.batch_size=4", "plan.workers=1",
                "plan.device=h100_80gb", "plan.strategies=[l2l,baseline]"]


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_decoder_on_a_gpu_profile_is_planned_in_cmp_bf16_and_each_command_names_its_precision():
    plan = make_plan(DECODER_PLAN, max_simulations=2)
    assert plan.precision.name == "cmp_bf16" and "default" in plan.precision.note
    ran = {c.shape.strategy: c.precision for c in plan.candidates}
    assert ran == {"l2l": "cmp_bf16", "baseline": "amp_bf16"}  # cmp_* needs an eager param server
    for c in plan.candidates:
        command = shlex.split(plan.command(c))
        assert f"precision={c.precision}" in command
        validate(compose(command[2:]))  # each runs as planned


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_precision_given_is_the_plan_s_and_replaces_the_default():
    plan = make_plan([*DECODER_PLAN, "precision=fp32"], max_simulations=1)
    assert plan.precision.name == "fp32" and plan.precision.note is None
    assert {c.precision for c in plan.candidates} == {"fp32"}
    assert plan.profile.timings[0].block[1].forward_s > make_plan(DECODER_PLAN, max_simulations=1) \
        .profile.timings[0].block[1].forward_s


def test_bert_and_this_machine_keep_the_config_s_precision():
    assert make_plan(["+exp=tiny_baseline", "plan.batch_size=4", "plan.device=h100_80gb",
                      "plan.strategies=[baseline]"], max_simulations=1).precision.name == "fp32"


# --------------------------------------------------------------------------- a 4-bit base


QLORA = ["model=llama_tiny", "model.num_layers=2", "data.seq_len=64", "strategy=l2l",
         "model.checkpoint_dtype=bfloat16", "adapter=lora"]


def test_an_nf4_base_is_planned_at_its_bytes():
    """A block's linear weights at their NF4 storage's bytes (bitsandbytes' layout, by hand from
    the block's widths), everything else as with a bf16 base; the parameter count unchanged."""
    bf16 = ModelFacts.of(compose(QLORA))
    nf4 = ModelFacts.of(compose([*QLORA, "model.quantize=nf4"]))
    shape = nf4.shape
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linears = [(q, shape.hidden), (kv, shape.hidden), (kv, shape.hidden), (shape.hidden, q),
               (shape.intermediate, shape.hidden), (shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]
    stored = sum(Layout(layer, False).nbytes for layer in linears)
    dense = sum(rows * columns for rows, columns in linears)
    assert nf4.params == bf16.params and nf4.trained_params == bf16.trained_params
    assert nf4.quantized[1].nbytes == stored and nf4.quantized[1].values == dense
    assert bf16.upload_bytes(1) - nf4.upload_bytes(1) == 2 * dense - stored  # what the relay no longer moves
    assert bf16.frozen_host_bytes - nf4.frozen_host_bytes == nf4.num_layers * (2 * dense - stored)
    l2l = strategy_class("l2l").cost_model
    nf4_cfg, bf16_cfg = compose([*QLORA, "model.quantize=nf4"]), compose(QLORA)
    assert l2l.host_state_bytes(bf16_cfg, bf16) - l2l.host_state_bytes(nf4_cfg, nf4) == \
        bf16.frozen_host_bytes - nf4.frozen_host_bytes


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_4_bit_base_read_as_fp32_masters_is_planned_at_that_peak():
    """Under a strategy that does not keep the base compact, a 4-bit base is read as fp32 masters
    and quantized after: the host check counts that moment (the fp32 model), not only the smaller
    model it leaves. L2L reads the base in the checkpoint's half dtype and never holds it in fp32.
    Llama-3-8B over NF4 on one 24 GB card with 24 GB of host memory: the baseline's read (32 GB)
    does not fit, L2L's does."""
    qlora = [*LLAMA_8B, "adapter=qlora", "plan.device=rtx4090_24gb", "plan.workers=1", "plan.batch_size=8"]
    facts = ModelFacts.of(compose(qlora))
    assert facts.build_peak_bytes(compact_base=False) == facts.params * 4 > 3 * facts.built_bytes(compact_base=False)
    assert facts.build_peak_bytes(compact_base=True) == facts.built_bytes(compact_base=True)
    plan = make_plan([*qlora, "plan.host_memory_gb=24", "plan.strategies=[baseline,l2l]"], max_simulations=2)
    baseline = [c for c in plan.candidates if c.shape.strategy == "baseline" and c.cost is not None]
    assert baseline and all(c.over_host and c.host_bytes > facts.params * 4 for c in baseline)
    assert plan.best is not None and plan.best.shape.strategy == "l2l"


def test_the_baseline_s_dry_run_holds_a_4_bit_base_at_its_bytes(tmp_path):
    """The dry run counts every weight on the device, the frozen base too, and a 4-bit one at its
    storage's bytes: what the planner's facts say the base as built weighs (fp32 but the NF4)."""
    from relaytrain.models import hf_config
    from relaytrain.models.pretrained import resolve

    hf_config(compose(QLORA).model).save_pretrained(tmp_path)  # planning reads a checkpoint's config only
    for adapter in ("lora", "qlora"):
        overrides = [*TINY_LLAMA, "model.num_layers=2", f"model.pretrained={tmp_path}", f"adapter={adapter}"]
        cfg = resolve(compose_config(overrides), overrides)
        facts = ModelFacts.of(cfg)
        (process,) = simulate(cfg).per_process
        assert process.by_kind["weights"] == facts.built_bytes(compact_base=False)
