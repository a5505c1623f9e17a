"""Expert parallelism (`strategy.expert_parallel=E`): replicas in groups of E, each holding 1/E of
every block's experts, tokens sent to their expert's holder with all-to-all (gloo on localhost),
train what the plain Hugging Face loop trains; a checkpoint holds whole tensors by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaytrain.placement.experts import ExpertShards, check_expert_parallel
from relaytrain.placement.layout import Layout
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.strategies.baseline import Baseline
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_moe
from tests.conftest import needs_extra, with_marks
from tests.models.test_moe import RUN_KEYS, trains_as_hugging_face

needs_torchao = with_marks(needs_extra("torchao", "lowbit"))
EXPERT_PARALLEL = ["strategy=baseline", "strategy.replicas=2", "strategy.expert_parallel=2"]


def same_saved_weights(ours: Path, theirs: Path, atol: float, rtol: float) -> None:
    """The models two runs saved (in `ours`, `theirs`) hold the same weights, name by name."""
    from tests.models.test_moe import saved

    mine, other = (dict(saved(d).named_parameters()) for d in (ours, theirs))
    for name, p in mine.items():
        torch.testing.assert_close(p, other[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def same_adapters(ours: Path, theirs: Path) -> dict[str, torch.Tensor]:
    """The adapters two runs saved (in `ours`, `theirs`) are the same, key by key; returns ours."""
    from safetensors.torch import load_file

    mine, other = (load_file(d / "model" / "adapter_model.safetensors") for d in (ours, theirs))
    assert mine.keys() == other.keys() and mine
    for key, value in mine.items():
        torch.testing.assert_close(value, other[key], atol=1e-6, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    return mine


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("ep") / "qwen3_moe", "qwen3_moe")


def test_two_replicas_sharing_the_experts_train_as_the_plain_loop(mixture, tmp_path):
    """Each worker holds 2 of a block's 4 experts; the weights, losses and balancing term are the
    plain loop's (AdamW with weight decay, warm-up, a linear schedule), and it evaluates alike."""
    evaluated = ["data.eval_fraction=0.25", "eval.max_batches=2"]
    cfg = compose_config([f"model.pretrained={mixture}", *EXPERT_PARALLEL, *RUN_KEYS, *evaluated])
    results, _, _ = trains_as_hugging_face(mixture, cfg, tmp_path / "run", "qwen3_moe, 2 replicas sharing the experts")
    assert "every block's experts over 2 workers" in results["strategy_report"]["summary"]["expert parallel"]
    plain = run(compose_config([f"model.pretrained={mixture}", "strategy=baseline", "strategy.replicas=2", *RUN_KEYS,
                                *evaluated]), tmp_path / "plain", table=False)
    assert results["eval"][-1]["loss"] == pytest.approx(plain["eval"][-1]["loss"], rel=1e-6)


@pytest.mark.slow  # three runs of two processes
def test_clipping_counts_every_expert_once(mixture, tmp_path):
    """Global-norm clipping that bites: the run of plain replicas (every expert whole on each)."""

    keys = [f"model.pretrained={mixture}", "strategy=baseline", "strategy.replicas=2", *RUN_KEYS, "optim.grad_clip=0.05"]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    unclipped = run(compose_config([*keys, "optim.grad_clip=0"]), tmp_path / "unclipped", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert plain["loss"][-1] != pytest.approx(unclipped["loss"][-1], rel=1e-4)  # the clip changed the step
    same_saved_weights(tmp_path / "shared", tmp_path / "plain", atol=1e-6, rtol=1e-5)


def test_lora_over_shared_frozen_experts_trains_as_over_replicated_ones(mixture, tmp_path):
    """LoRA on attention with the frozen experts shared out: the adapter of plain replicas."""
    keys = [f"model.pretrained={mixture}", "strategy=baseline", "strategy.replicas=2", *RUN_KEYS, "adapter=lora",
            "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    same_adapters(tmp_path / "shared", tmp_path / "plain")


@pytest.mark.slow  # four processes: two expert groups of two, each expert held twice
@pytest.mark.parametrize("strategy", ["baseline", "fsdp"])
def test_four_workers_in_two_expert_groups_train_as_the_plain_loop(strategy, mixture, tmp_path):
    """With block recompute too: the recomputed forward exchanges the same rows again; under FSDP
    each share is sharded over its two holders, its gradient summed over them alone."""
    cfg = compose_config([f"model.pretrained={mixture}", f"strategy={strategy}", "strategy.replicas=4",
                          "strategy.expert_parallel=2", *RUN_KEYS, "strategy.microbatch_size=4",
                          "strategy.recompute=block"])
    trains_as_hugging_face(mixture, cfg, tmp_path / "run", f"qwen3_moe, 4 {strategy} workers in expert groups of 2")


@pytest.mark.slow  # four runs of two processes
def test_dpo_over_shared_experts_trains_as_over_replicated_ones(mixture, tmp_path):
    """DPO's reference pass and its pairs go through the same dispatch: plain replicas' losses and weights."""
    from tests.objectives.test_preference_vs_trl import pairs, relaytrain_dpo
    from tests.objectives.trl_runs import write_pairs

    data = write_pairs(tmp_path / "pairs.jsonl", pairs())
    keys = ["strategy=baseline", "strategy.replicas=2", "strategy.num_microbatches=1"]
    shared = relaytrain_dpo(mixture, data, tmp_path / "shared", tmp_path / "c1", "adamw", *keys,
                            "strategy.expert_parallel=2")
    plain = relaytrain_dpo(mixture, data, tmp_path / "plain", tmp_path / "c2", "adamw", *keys)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    same_saved_weights(tmp_path / "shared", tmp_path / "plain", atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # GPT-OSS: per-expert biases cut with the matrices, experts stored (in, out)
def test_gpt_oss_experts_and_biases_are_shared_out(tmp_path):
    pretrained = tiny_moe(tmp_path / "gpt_oss", "gpt_oss")
    cfg = compose_config([f"model.pretrained={pretrained}", *EXPERT_PARALLEL, *RUN_KEYS])
    trains_as_hugging_face(pretrained, cfg, tmp_path / "run", "gpt_oss, 2 replicas sharing the experts")


@pytest.mark.slow  # four runs of two processes
@pytest.mark.parametrize(("saved_at", "resumed_at"), [(2, 1), (1, 2)])
def test_a_checkpoint_holds_whole_experts_and_resumes_at_another_degree(saved_at, resumed_at, mixture, tmp_path):
    """Saved after step 1 at one E, resumed at another (E=1: plain replicas): the end of the unbroken run."""
    from relaytrain.records import checkpoint

    keys = [f"model.pretrained={mixture}", *RUN_KEYS, "strategy=baseline", "strategy.replicas=2"]
    whole = run(compose_config([*keys, f"strategy.expert_parallel={saved_at}", "train.checkpoint_every=1"]),
                tmp_path / "whole", table=False)
    first = checkpoint.list_checkpoints(checkpoint.checkpoint_dir(tmp_path / "whole"))[0]
    resumed = run(compose_config([*keys, f"strategy.expert_parallel={resumed_at}", f"train.resume={first}"]),
                  tmp_path / "resumed", table=False)
    assert resumed["loss"][-1] == pytest.approx(whole["loss"][-1], rel=1e-5)
    same_saved_weights(tmp_path / "resumed", tmp_path / "whole", atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def wide_mixture(tmp_path_factory) -> Path:
    """Experts wide enough that torchao quantizes a share's moments (4096 values and more)."""
    return tiny_moe(tmp_path_factory.mktemp("ep_wide") / "qwen3_moe", "qwen3_moe", hidden_size=64,
                    moe_intermediate_size=128, head_dim=16)


@needs_torchao
@pytest.mark.slow  # four runs of two processes
@pytest.mark.parametrize("strategy", ["baseline", "fsdp"])
def test_8bit_moments_of_shared_experts_are_the_whole_tensors(strategy, wide_mixture, tmp_path):
    """optim.state_bits=8: each share steps torchao's moments of its experts' blocks, so the run
    trains as replicas holding every expert; saved at E=2 and resumed at E=1, the codes and
    scales are gathered whole (and cut again at E=2), ending where the unbroken run ends."""
    from relaytrain.records import checkpoint
    from tests.conformance.references import assert_same_weights_but_flipped_codes
    from tests.models.test_moe import saved

    keys = [f"model.pretrained={wide_mixture}", *RUN_KEYS, f"strategy={strategy}", "strategy.replicas=2",
            "optim.state_bits=8", "train.checkpoint_every=1"]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert_same_weights_but_flipped_codes(saved(tmp_path / "shared"), saved(tmp_path / "plain"),
                                          f"{strategy} E=2 8-bit", within=0.03)
    for saved_in, resumed_at in (("shared", 1), ("plain", 2)):
        first = checkpoint.list_checkpoints(checkpoint.checkpoint_dir(tmp_path / saved_in))[0]
        resumed = run(compose_config([*keys, f"strategy.expert_parallel={resumed_at}", f"train.resume={first}"]),
                      tmp_path / f"from_{saved_in}", table=False)
        assert resumed["loss"][-1] == pytest.approx(plain["loss"][-1], rel=1e-6)
        assert_same_weights_but_flipped_codes(saved(tmp_path / f"from_{saved_in}"), saved(tmp_path / saved_in),
                                              f"{strategy} resumed at E={resumed_at}", within=0.03)


def test_a_share_that_would_cut_torchaos_blocks_is_refused_in_one_line(mixture):
    """The tiny mixture's 4 x 48 x 32 expert tensor (6,144 values) is quantized whole, but a share
    of 3,072 values would keep fp32 moments: the run would not be the plain loop's."""
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve

    model = build_model(resolve(compose_config([f"model.pretrained={mixture}"])).model)
    shares = ExpertShards(model, Layout(replicate=2, experts=2), 0, simulated=True, timeout=None)
    with pytest.raises(ConfigError, match=r"gate_up_proj's share \(\(2, 48, 32\)\) would not hold whole blocks of 256") as err:
        shares.check_moments(model.named_parameters(), 8)
    assert "\n" not in str(err.value)


def test_groups_are_consecutive_replicas_and_holders_stride_them():
    for layout in (Layout(replicate=4, experts=2), Layout(shard=4, experts=2)):  # the baseline's replicas, FSDP's shards
        shares, holders = layout.expert_groups()
        assert shares == [[0, 1], [2, 3]] and holders == [[0, 2], [1, 3]]
        assert [layout.expert_share(rank) for rank in range(4)] == [0, 1, 0, 1]
        assert not layout.replicates_whole  # no worker holds every expert
        assert layout.describe(3).endswith("expert share 1 of 2)")
    assert Layout(replicate=4).replicates_whole


FSDP_SHARING = ["strategy=fsdp", "strategy.replicas=2", "strategy.expert_parallel=2"]


def test_fsdp_workers_sharing_the_experts_train_as_the_plain_loop(mixture, tmp_path):
    """Each of two FSDP workers holds 2 of a block's 4 experts (a DTensor over the expert mesh, its
    own unit); the rest sharded as ever: the plain loop's weights and losses."""
    cfg = compose_config([f"model.pretrained={mixture}", *FSDP_SHARING, *RUN_KEYS])
    results, _, _ = trains_as_hugging_face(mixture, cfg, tmp_path / "run", "qwen3_moe, fsdp sharing the experts")
    assert "every block's experts over 2 workers" in results["strategy_report"]["summary"]["expert parallel"]


@pytest.mark.slow  # two runs of four processes
def test_fsdp_clipping_over_shared_experts_counts_every_expert_once(mixture, tmp_path):
    """Global-norm clipping that bites, the experts' gradients DTensors over the expert mesh's two
    dims: the run of plain FSDP shards."""

    keys = [f"model.pretrained={mixture}", "strategy=fsdp", "strategy.replicas=4", *RUN_KEYS,
            "strategy.microbatch_size=4", "optim.grad_clip=0.05"]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    same_saved_weights(tmp_path / "shared", tmp_path / "plain", atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # four runs of two processes
@pytest.mark.parametrize(("saved", "resumed"), [(FSDP_SHARING, ["strategy=baseline", "strategy.replicas=2"]),
                                                (["strategy=fsdp", "strategy.replicas=2"], FSDP_SHARING)])
def test_fsdp_checkpoints_of_shared_experts_resume_by_name(saved, resumed, mixture, tmp_path):
    """A sharded checkpoint holds every expert whole (DCP over the expert mesh), so plain replicas
    resume it, and a run sharing the experts resumes a plain FSDP one: the unbroken run's end."""
    from relaytrain.records import checkpoint

    keys = [f"model.pretrained={mixture}", *RUN_KEYS]
    whole = run(compose_config([*keys, *saved, "train.checkpoint_every=1"]), tmp_path / "whole", table=False)
    first = checkpoint.list_checkpoints(checkpoint.checkpoint_dir(tmp_path / "whole"))[0]
    again = run(compose_config([*keys, *resumed, f"train.resume={first}"]), tmp_path / "resumed", table=False)
    assert again["loss"][-1] == pytest.approx(whole["loss"][-1], rel=1e-5)
    same_saved_weights(tmp_path / "resumed", tmp_path / "whole", atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # two runs of two processes each
@pytest.mark.parametrize("case", ["lora-over-frozen-experts", "gpt_oss"])
def test_fsdp_sharing_the_experts_trains_as_plain_fsdp(case, mixture, tmp_path):
    """LoRA on attention over frozen experts shared out (frozen DTensors, their own unit), and
    GPT-OSS (per-expert biases cut with the matrices): what plain FSDP trains."""
    if case == "gpt_oss":
        pretrained, extra = tiny_moe(tmp_path / "gpt_oss", "gpt_oss"), []
    else:
        pretrained, extra = mixture, ["adapter=lora", "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    keys = [f"model.pretrained={pretrained}", "strategy=fsdp", "strategy.replicas=2", *RUN_KEYS, *extra]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    if case == "gpt_oss":
        same_saved_weights(tmp_path / "shared", tmp_path / "plain", atol=1e-6, rtol=1e-5)
        return
    same_adapters(tmp_path / "shared", tmp_path / "plain")


def test_an_fsdp_dry_run_gathers_a_share_of_the_experts(mixture, tmp_path):
    """FSDP keeps 1/R of every expert either way; sharing them out, a worker gathers 1/E of them."""
    keys = [f"model.pretrained={mixture}", *RUN_KEYS, "train.device=meta", "train.save_model=false",
            "strategy=fsdp", "strategy.replicas=2"]
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    kinds = [r["memory"]["device"]["by_kind"] for r in (plain, shared)]
    for kind in ("weights", "gradients", "optimizer state"):
        assert kinds[1][kind] == pytest.approx(kinds[0][kind], abs=8), kind
    assert kinds[1]["parameters gathered"] < kinds[0]["parameters gathered"]


def test_a_dry_run_holds_a_share_of_the_experts(mixture, tmp_path):
    """On the meta device each worker computes its rows through its own experts: its weights,
    gradients and optimizer state are 1/2 of the experts'."""
    keys = [f"model.pretrained={mixture}", *RUN_KEYS, "train.device=meta", "train.save_model=false",
            "strategy=baseline", "strategy.replicas=2"]
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    weights = [r["memory"]["device"]["by_kind"]["weights"] for r in (plain, shared)]
    assert weights[1] < weights[0]


def test_a_share_is_cut_and_gathered_back_by_name(mixture):
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve

    cfg = resolve(compose_config([f"model.pretrained={mixture}"]))
    model = build_model(cfg.model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    shards = ExpertShards(model, Layout(replicate=2, experts=2), 1, simulated=True, timeout=None)
    cut = {name: p for name, p in model.named_parameters() if shards.holds(p)}
    assert cut and all(p.shape[0] == before[name].shape[0] // 2 for name, p in cut.items())
    for name, p in cut.items():
        assert torch.equal(p, before[name][2:]) and torch.equal(shards.cut(p, before[name]), p)


@pytest.mark.parametrize(("keys", "message"), [
    (["strategy.replicas=3", "strategy.expert_parallel=2"], "must divide strategy.replicas=3"),
    (["strategy.replicas=3", "strategy.expert_parallel=3"], "4 experts a block do not divide over 3"),
    (["strategy=fsdp", "strategy.replicas=2", "strategy.expert_parallel=2", "adapter=lora",
      "adapter.target_parameters=[mlp.experts.gate_up_proj]"], "runs under strategy=baseline"),
    (["strategy=fsdp", "strategy.replicas=2", "strategy.expert_parallel=2", "adapter=qlora"],
     "shares 4-bit experts \\(model.quantize=nf4\\) under strategy=baseline; not yet under strategy=fsdp"),
    (["strategy.replicas=2", "strategy.expert_parallel=2", "strategy.sequence_parallel=2"], "not supported yet"),
])
def test_bad_expert_parallel_keys_are_one_line(keys, message, mixture):
    from relaytrain.models.pretrained import resolve

    strategy = [] if any(key.startswith("strategy=") for key in keys) else ["strategy=baseline"]
    cfg = resolve(compose_config([f"model.pretrained={mixture}", *strategy, *keys]))
    with pytest.raises(ConfigError, match=message):
        check_expert_parallel(cfg, strategy_class(cfg.strategy.name),
                              adapted_experts=cfg.strategy.name == "baseline")  # as the strategies ask


@pytest.mark.parametrize("targets", [["adapter.target_modules=[q_proj,v_proj]",
                                      "adapter.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"],
                                     []], ids=["target_parameters", "all-linear"])
def test_lora_on_shared_experts_trains_as_on_replicated_ones(targets, mixture, tmp_path):
    """LoRA on the fused experts, cut with them (A's rows and B's columns of each expert): named, or
    as peft makes it of all-linear where a layer is dense. The adapter of plain replicas."""
    keys = [f"model.pretrained={mixture}", "strategy=baseline", "strategy.replicas=2", *RUN_KEYS, "adapter=lora",
            *targets]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["adapter"]["experts"]["frozen"] == []
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert any("experts" in key for key in same_adapters(tmp_path / "shared", tmp_path / "plain"))


@pytest.mark.slow  # four runs of two processes
@pytest.mark.parametrize("double", [False, True], ids=["nf4", "nf4-double"])
def test_4bit_experts_shared_out_train_as_replicated_ones(double, wide_mixture, tmp_path):
    """QLoRA with LoRA on the experts: each worker keeps its experts' NF4 codes and scales as the
    whole tensor was quantized (under double quantization whole groups of 256 scales, and the
    tensor's offset), so they dequantize to the same weights; the adapter of plain replicas."""
    keys = [f"model.pretrained={wide_mixture}", "strategy=baseline", "strategy.replicas=2", *RUN_KEYS, "adapter=qlora",
            f"model.quantize_double={str(double).lower()}", "adapter.target_modules=[q_proj,v_proj]",
            "adapter.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]
    shared = run(compose_config([*keys, "strategy.expert_parallel=2"]), tmp_path / "shared", table=False)
    plain = run(compose_config(keys), tmp_path / "plain", table=False)
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert any("experts" in key for key in same_adapters(tmp_path / "shared", tmp_path / "plain"))


def test_a_share_of_4bit_experts_that_would_cut_a_group_of_scales_is_refused_in_one_line(mixture):
    """The tiny mixture's gate_up_proj, 2 experts of 48 x 32 a share: 48 blocks of 64 values, not
    whole groups of 256 scales under double quantization."""
    from relaytrain.models.quantize_experts import ExpertsLayout

    layout = ExpertsLayout.of(torch.empty((4, 48, 32), device="meta"), double=True)
    with pytest.raises(ConfigError, match="is not whole blocks of 64 values and groups of 256 scales") as err:
        layout.share(torch.empty(layout.nbytes, dtype=torch.uint8, device="meta"), 0, 2)
    assert "\n" not in str(err.value)
    assert ExpertsLayout.of(torch.empty((4, 48, 32), device="meta"), double=False).share(
        torch.empty(0, device="meta"), 1, 2)[0].shape == (2, 48, 32)


def test_lora_on_the_experts_under_fsdp_sharing_them_is_refused_in_one_line(mixture, tmp_path):
    """all-linear reaches dense experts on this peft (a dense layer names gate_proj): said before any step."""
    from relaytrain.run.launch import WorkerFailed

    keys = [f"model.pretrained={mixture}", *FSDP_SHARING, *RUN_KEYS, "adapter=lora"]
    with pytest.raises((ConfigError, WorkerFailed), match="which runs under strategy=baseline only so far"):
        run(compose_config(keys), tmp_path / "run", table=False)


def test_fsdp_offloading_its_shards_is_refused_with_experts_shared_out(mixture):
    from relaytrain.models.pretrained import resolve

    cfg = resolve(compose_config([f"model.pretrained={mixture}", *FSDP_SHARING, "strategy.offload=host"]))
    with pytest.raises(ConfigError, match="strategy.offload=host with strategy.expert_parallel=2 is not supported yet"):
        strategy_class("fsdp").check_config(cfg)


def test_a_dense_model_has_no_experts_to_share(tmp_path):
    cfg = compose_config(["model=llama_tiny", "strategy=baseline", "strategy.replicas=2", "strategy.expert_parallel=2"])
    with pytest.raises(ConfigError, match="no experts"):
        check_expert_parallel(cfg, Baseline)


def test_the_cost_model_counts_a_workers_share_of_the_experts_and_its_all_to_alls(mixture):
    """The planner's facts of one worker hold what the placement keeps of a routed block (1/2 of its
    experts, counted parameter by parameter), and its step adds the all-to-alls."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.cost.profile import from_spec, load_spec
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve
    from relaytrain.strategies import strategy_class

    cfg = resolve(compose_config([f"model.pretrained={mixture}", *EXPERT_PARALLEL, *RUN_KEYS]))
    facts = ModelFacts.of(cfg)
    model = build_model(cfg.model)
    routed = model.blocks[0]  # layer 0 routes (layer 1 is Qwen's dense mlp_only_layers)
    assert facts.block_params == sum(p.numel() for p in routed.parameters())
    ExpertShards(model, Layout(replicate=2, experts=2), 0, simulated=True, timeout=None)
    worker = facts.placed(cfg.strategy)
    assert worker.block_params == sum(p.numel() for p in routed.parameters()) < facts.block_params

    cost = strategy_class("baseline").cost_model
    profile = from_spec(load_spec("v100_16gb"), cfg, [cfg.strategy.microbatch_size])
    parts = cost.step_cost(cfg, facts, profile).parts
    assert parts["expert all-to-alls"] > 0
    plain = resolve(compose_config([f"model.pretrained={mixture}", "strategy=baseline", "strategy.replicas=2",
                                    *RUN_KEYS]))
    assert "expert all-to-alls" not in cost.step_cost(plain, facts, profile).parts
    assert cost.device_bytes(cfg, facts) < cost.device_bytes(plain, facts)
    # a worker's experts are summed over their holders alone (none here: E = R), not over every replica
    from relaytrain.cost.work import expert_weights
    from relaytrain.strategies.whole_model_cost import shared_expert_grads

    assert shared_expert_grads(worker) == facts.num_layers * expert_weights(facts.shape) // 2 > 0
    assert shared_expert_grads(facts) == 0


def test_the_cost_model_cuts_lora_on_the_experts_with_them(mixture):
    """LoRA on the fused experts at E=2: a worker trains its experts' rows of A and columns of B
    (`ExpertShards`), and the facts count what it trains so (a block's count is a mean over the
    blocks, rounded up: within a parameter a block)."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve

    cfg = resolve(compose_config([f"model.pretrained={mixture}", *EXPERT_PARALLEL, *RUN_KEYS, "adapter=lora",
                                  "adapter.target_modules=[q_proj]",
                                  "adapter.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]))
    model = build_model(cfg.model, quiet=True, adapter=cfg.adapter)
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shards = ExpertShards(model, Layout(replicate=2, experts=2), 0, simulated=True, timeout=None)
    worker_trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    facts = ModelFacts.of(cfg)
    assert facts.trained_parts.block_experts > 0 and worker_trains < trains
    layers = cfg.model.num_layers
    assert facts.trained_params == pytest.approx(trains, abs=2 * layers)
    worker = facts.placed(cfg.strategy)
    assert worker.trained_params == pytest.approx(worker_trains, abs=2 * layers)
    # Their gradients are summed over the holders of the same share alone, as the run's
    # (`ExpertShards.holds`), not with the attention's over every replica.
    from relaytrain.strategies.whole_model_cost import shared_expert_grads

    held = sum(p.numel() for p in model.parameters() if p.requires_grad and shards.holds(p))
    assert 0 < held < worker_trains
    assert shared_expert_grads(worker) == pytest.approx(held, abs=layers)


def test_the_cost_model_keeps_a_share_of_4bit_experts(mixture):
    """QLoRA at E=2: a worker's block holds half of its experts' NF4 storage, as the facts count it
    (their bytes taken in proportion to their values: within 2 % of the built block's)."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.cost.quantized import _quantized_in
    from relaytrain.models import build_model
    from relaytrain.models.pretrained import resolve

    cfg = resolve(compose_config([f"model.pretrained={mixture}", *EXPERT_PARALLEL, *RUN_KEYS, "adapter=qlora",
                                  "model.quantize_double=false", "adapter.target_modules=[q_proj]"]))
    model = build_model(cfg.model, quiet=True, adapter=cfg.adapter)
    whole = _quantized_in(model.blocks[0])  # layer 0 routes
    ExpertShards(model, Layout(replicate=2, experts=2), 0, simulated=True, timeout=None)
    share = _quantized_in(model.blocks[0])
    facts = ModelFacts.of(cfg)
    placed = facts.placed(cfg.strategy).quantized[1]
    assert facts.quantized[1] == whole and share.nbytes < whole.nbytes
    assert placed.values == share.values and placed.nbytes == pytest.approx(share.nbytes, rel=0.02)


def test_the_planner_offers_replicas_sharing_a_mixtures_experts():
    """Qwen3-30B-A3B (128 experts) on eight H100s: baseline shapes of w replicas come with every E
    dividing w, each priced with a worker's share of the experts, its command setting E; a dense
    model is offered none."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.cost.profile import load_spec
    from relaytrain.planner.candidates import GiB, Request, candidate_config, enumerate_shapes
    from relaytrain.strategies import strategy_class

    spec = load_spec("h100_80gb")
    request = Request(8, spec["memory_gb"] * GiB, 32, "h100_80gb", ("baseline",), 0)
    base = compose_config(["model=qwen3_30b_a3b", "strategy=baseline", "precision=amp_bf16"])
    shapes = enumerate_shapes(request, base)
    shared = {(s.replicas, int(dict(s.options)["expert_parallel"])) for s in shapes if "expert_parallel" in dict(s.options)}
    assert shared == {(2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)}

    cost = strategy_class("baseline").cost_model
    plain = next(s for s in shapes if s.replicas == 8 and not s.options and s.recompute == "block")
    spread = next(s for s in shapes if s.replicas == 8 and s.recompute == "block" and s.microbatch_size ==
                  plain.microbatch_size and dict(s.options).get("expert_parallel") == "8")
    assert "strategy.expert_parallel=8" in spread.overrides()
    sizes = [cost.device_bytes(cfg, ModelFacts.of(cfg)) for cfg in (candidate_config(base, s) for s in (plain, spread))]
    assert sizes[1] < sizes[0] / 4  # 97 % of the weights are experts: a worker keeps 1/8 of them

    dense = compose_config(["model=llama_tiny", "strategy=baseline"])
    assert not any("expert_parallel" in dict(s.options) for s in enumerate_shapes(request, dense))


def test_the_fsdp_cost_model_shards_every_expert_and_gathers_a_share(mixture):
    """Under FSDP a worker keeps 1/R of every expert's state, shared out or not; sharing them out
    changes what it gathers (1/E of the experts) and adds the all-to-alls."""
    from relaytrain.cost.formulas import ModelFacts
    from relaytrain.cost.profile import from_spec, load_spec
    from relaytrain.models.pretrained import resolve
    from relaytrain.strategies.whole_model_cost import gathered_bytes

    plain, shared = (resolve(compose_config([f"model.pretrained={mixture}", "strategy=fsdp", "strategy.replicas=2",
                                             *RUN_KEYS, *extra])) for extra in ([], ["strategy.expert_parallel=2"]))
    facts = ModelFacts.of(plain)
    cost = strategy_class("fsdp").cost_model
    saved = gathered_bytes(plain, facts.placed(plain.strategy)) - gathered_bytes(shared, facts.placed(shared.strategy))
    assert saved > 0
    assert cost.device_bytes(plain, facts) - cost.device_bytes(shared, facts) == pytest.approx(saved, abs=2)
    profile = from_spec(load_spec("v100_16gb"), plain, [plain.strategy.microbatch_size])
    assert cost.step_cost(shared, facts, profile).parts["expert all-to-alls"] > 0


def test_the_planner_offers_fsdp_shards_sharing_the_experts_on_the_device():
    """FSDP's shapes on the device come with their shards sharing the experts too; an offloaded one
    (refused with expert_parallel) is offered none."""
    from relaytrain.cost.profile import load_spec
    from relaytrain.planner.candidates import GiB, Request, enumerate_shapes

    spec = load_spec("h100_80gb")
    request = Request(4, spec["memory_gb"] * GiB, 16, "h100_80gb", ("fsdp",), 0)
    shapes = enumerate_shapes(request, compose_config(["model=qwen3_30b_a3b", "strategy=fsdp", "precision=amp_bf16"]))
    shared = [dict(s.options) for s in shapes if "expert_parallel" in dict(s.options)]
    assert {(o["expert_parallel"], o.get("offload", "none")) for o in shared} == {("2", "none"), ("4", "none")}
