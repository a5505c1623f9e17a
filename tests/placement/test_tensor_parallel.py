"""Tensor parallelism (`placement/tensor_parallel.py`) on real gloo process groups: two tensor ranks
split every block of a tiny Llama and a tiny Qwen3 (its per-head q/k norms replicated, their
gradients summed) and train, with keyed dropout on, to the plain loop's losses, gradients and
(AdamW, weight decay, warm-up) weights in fp32; two all-reduces a block each way; the replicated
parts stay equal on both ranks; whole state by name saved at T=2 resumes at T=1 and the other way
round. In one process: each rank's attention draws its heads' slice of the unsplit run's dropout
mask, and what cannot be split exactly is refused in one line.
"""

from __future__ import annotations

import functools
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.models.family import family_spec
from relaytrain.placement.tensor_parallel import (
    PREFIX,
    HeadSplit,
    block_plan,
    full_optimizer_state,
    full_state,
    load_full_optimizer_state,
    load_full_state,
    own_kernel,
    parallelize_blocks,
    split_attention,
    whole,
)
from relaytrain.run.launch import _worker_context
from relaytrain.step.optim import build_optimizer, lr_at, set_lr
from relaytrain.strategies.base import minibatch_divisor
from relaytrain.utils.errors import ConfigError
from tests.conftest import tiny_cfg, train_plain_loop

STEPS = 3
TOLERANCE = {"atol": 2e-6, "rtol": 1e-5}  # fp32; the row-wise sums add their halves in another order


def tp_cfg(model_type: str, *overrides: str):
    """A tiny decoder (4 heads, 2 key/value heads), two micro-batches of 2 a step, keyed dropout on,
    AdamW with weight decay and a warm-up."""
    return tiny_cfg("llama", f"model.model_type={model_type}", "model.dropout=0.1", f"train.steps={STEPS}",
                    "strategy.microbatch_size=2", "strategy.num_microbatches=2", "optim=adamw", "optim.lr=0.01",
                    "optim.weight_decay=0.1", "optim.warmup_steps=2", "optim.eps=1e-4", *overrides)


# --------------------------------------------------------------------------- the loop, split or not


def train_steps(cfg, mesh=None, first: int = 0, last: int = STEPS, state: dict | None = None) -> dict:
    """Steps first..last-1 of `train_plain_loop`'s loop (its model, optimizer, schedule and data),
    the blocks split over `mesh` where given; from `state` (whole weights and optimizer state by
    name) when it starts past step 0. Returns each step's loss, the first step's gradients whole
    by name, and the whole state after the last step."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    if mesh is not None:
        parallelize_blocks(model, mesh, family_spec(cfg.model.family))
    optimizer = build_optimizer(model.named_parameters(), cfg.optim)
    if state is not None:
        load_full_state(model, state["weights"])
        load_full_optimizer_state(model, [optimizer], state["optimizer"])
    loader = build_loader(cfg, build_dataset(cfg))
    losses, grads = [], None
    for step in range(last):
        minibatch = next(loader)
        if step < first:
            continue
        divisor = minibatch_divisor(model, minibatch)
        loss = 0.0
        for mb in minibatch:
            part = model(mb, divisor)
            part.backward()
            loss += float(part.detach())
        losses.append(loss)
        if grads is None:
            grads = {name: whole(p.grad).clone() for name, p in _named(model)}
        set_lr(optimizer, lr_at(step, cfg.optim, cfg.train.steps))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "weights": full_state(model),
            "optimizer": full_optimizer_state(model, [optimizer]), "model": model}


def _named(model):
    return ((model.hf_name(p), p) for p in model.parameters())


def block_collectives(model, cfg) -> tuple[dict, dict]:
    """The DTensor collectives of one block's forward, and of its backward, by kind."""
    mb = next(build_loader(cfg, build_dataset(cfg)))[0]
    hidden = model.embed_input(mb.input_ids, mb.draw).detach().requires_grad_()
    ctx = model.context(mb, hidden)
    with warnings.catch_warnings(), CommDebugMode() as forward:
        warnings.filterwarnings("ignore", "Full backward hook")  # the counter's own hooks on the inner modules
        out = model.blocks[0](hidden, ctx)
    with warnings.catch_warnings(), CommDebugMode() as backward:
        warnings.filterwarnings("ignore", "Full backward hook")
        out.sum().backward()
    return tuple({str(k): v for k, v in mode.get_comm_counts().items()} for mode in (forward, backward))


# --------------------------------------------------------------------------- two tensor ranks


def on_tensor_ranks(job, tmp_path: Path, size: int = 2) -> list:
    """`job(mesh)` on `size` processes of one gloo group (a 1-D "tensor" mesh over them); what each
    returned, by rank. A rank's exception fails the test with its traceback."""
    context = _worker_context()  # forked from the runs' warm server: no seconds of imports per rank
    store = tmp_path / "store"
    procs = [context.Process(target=_rank_main, args=(job, rank, size, store, tmp_path)) for rank in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)  # a bound on a hang, not on speed
        if proc.is_alive():
            proc.kill()
    errors = [path.read_text() for path in sorted(tmp_path.glob("rank-*.err"))]
    assert not errors and all(proc.exitcode == 0 for proc in procs), "\n".join(errors) or [p.exitcode for p in procs]
    return [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(size)]


def _rank_main(job, rank: int, size: int, store: Path, out: Path) -> None:
    torch.set_num_threads(1)  # two ranks on the test's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))  # a rank left alone fails rather than waits
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tensor",))
        torch.save(job(mesh), out / f"rank-{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank-{rank}.err").write_text(f"rank {rank}: {traceback.format_exc()}")
        raise


def _trained(cfg, mesh, count: bool = True) -> dict:
    """`train_steps` on this rank, and (`count`) the collectives of a block of the trained model."""
    result = train_steps(cfg, mesh)
    model = result.pop("model")
    if count:
        result["collectives"] = block_collectives(model, cfg)
    return result


def assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], **TOLERANCE, msg=lambda why, n=name: f"{what} {n}: {why}")


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_two_tensor_ranks_train_as_the_plain_loop_with_dropout_on(model_type, tmp_path):
    cfg = tp_cfg(model_type)
    ranks = on_tensor_ranks(functools.partial(_trained, cfg), tmp_path)
    plain = train_steps(cfg)
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(plain["losses"]), **TOLERANCE)
        assert_same(rank["grads"], plain["grads"], "gradient of")
        assert_same(rank["weights"], plain["weights"], "weight")
    for name, p in ranks[0]["weights"].items():  # replicated parts computed alike: no drift between ranks
        assert torch.equal(p, ranks[1]["weights"][name]), name
    forward, backward = ranks[0]["collectives"]  # Megatron's two each way; Qwen3's norms' gradients beside them
    norms = {"c10d.allreduce_": 2} if model_type == "qwen3" else {}
    assert forward == {"c10d_functional.all_reduce": 2} and backward == {"c10d_functional.all_reduce": 2, **norms}


@pytest.mark.slow  # one process, ~3 s: a guard on the loop the tests above hold the split model to
def test_the_loop_these_tests_run_is_the_plain_loop_every_strategy_is_held_to():
    cfg = tp_cfg("llama")
    reference = {name: p.detach() for name, p in _named(train_plain_loop(cfg, STEPS))}
    ours = train_steps(cfg)["weights"]
    assert all(torch.equal(ours[name], reference[name]) for name in reference)


def _resumed_both_ways(cfg, plain_at_two: dict, mesh) -> dict:
    saved = train_steps(cfg, mesh, last=2)  # T=2's state after two steps, whole
    resumed = train_steps(cfg, mesh, first=2, state=plain_at_two)  # T=1's state resumed at T=2
    return {"saved": {key: saved[key] for key in ("weights", "optimizer")}, "resumed": resumed["weights"]}


@pytest.mark.slow  # two ranks, ~10 s
def test_whole_state_saved_at_two_ranks_resumes_at_one_and_back(tmp_path):
    cfg = tp_cfg("llama")
    plain_at_two = train_steps(cfg, last=2)
    plain_at_two = {key: plain_at_two[key] for key in ("weights", "optimizer")}
    ranks = on_tensor_ranks(functools.partial(_resumed_both_ways, cfg, plain_at_two), tmp_path)
    plain = train_steps(cfg)["weights"]
    assert_same(ranks[0]["resumed"], plain, "T=1 -> T=2:")
    at_one = train_steps(cfg, first=2, state=ranks[0]["saved"])["weights"]
    assert_same(at_one, plain, "T=2 -> T=1:")


@pytest.mark.slow  # two ranks, ~10 s: BERT's plan, hidden dropout on replicated tensors beside attention's
def test_bert_splits_by_its_own_plan_with_hidden_and_attention_dropout(tmp_path):
    cfg = tiny_cfg("bert", "model.dropout=0.1", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
                   f"train.steps={STEPS}", "optim.lr=0.01")
    ranks = on_tensor_ranks(functools.partial(_trained, cfg, count=False), tmp_path)
    plain = train_steps(cfg)
    assert_same(ranks[0]["grads"], plain["grads"], "gradient of")
    assert_same(ranks[0]["weights"], plain["weights"], "weight")


# --------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_each_rank_draws_its_heads_share_of_the_unsplit_attention_dropout(kernel):
    """Attention over 2 of 4 heads (and 1 of 2 key/value heads) equals that share of the whole
    attention with its dropout, and leaves the generator where the whole attention leaves it."""
    cfg = tiny_cfg("llama", "model.dropout=0.3", f"model.attn_implementation={kernel}")
    attention = build_model(cfg.model).blocks[0].layer.self_attn.train()
    config = attention.config
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.zeros(2, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.manual_seed(7)
    whole_out, _ = own_kernel(attention, kernel)(attention, query, key, value, mask, dropout=0.3,
                                                 scaling=attention.scaling)
    after_whole = torch.rand(1)
    config._attn_implementation = PREFIX + kernel
    for part in (0, 1):
        attention.tensor_split = HeadSplit(part, 2)
        torch.manual_seed(7)
        mine, _ = split_attention(attention, query[:, 2 * part:2 * part + 2], key[:, part:part + 1],
                                   value[:, part:part + 1], mask, dropout=0.3, scaling=attention.scaling)
        torch.testing.assert_close(mine, whole_out[:, :, 2 * part:2 * part + 2], atol=1e-6, rtol=1e-6)
        assert torch.equal(torch.rand(1), after_whole)
    assert (whole_out == 0).any()  # dropout did drop


def _plan_of(*overrides: str, family: str = "llama", size: int = 2):
    cfg = tiny_cfg(family, *overrides)
    model = build_model(cfg.model, adapter=cfg.adapter)
    return block_plan(model, family_spec(cfg.model.family), size)


def test_a_llama_plan_is_transformers_own_and_qwen3_sums_its_norms_gradients():
    assert _plan_of() == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                          "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                          "mlp.down_proj": "rowwise"}
    qwen3 = _plan_of("model.model_type=qwen3")
    assert qwen3["self_attn.q_norm"] == qwen3["self_attn.k_norm"] == "replicated_with_grad_allreduce"


@pytest.mark.parametrize(("overrides", "size", "says"), [
    (["model.num_kv_heads=4"], 3, "model.num_heads=4 must be a multiple of strategy.tensor_parallel=3"),
    ([], 4, "model.num_kv_heads=2 must be a multiple of strategy.tensor_parallel=4"),
    (["model.intermediate_size=63"], 2, "model.intermediate_size=63 must be a multiple"),
    (["model.model_type=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2"], 2, "mixtures of experts"),
    (["model.model_type=phi3"], 2, "colwise_gather_output"),
    (["model.model_type=stablelm"], 2, "has no tensor-parallel plan"),
    (["adapter=lora"], 2, "adapter-wrapped"),
    (["model.dropout=0.1", "model.attn_implementation=flex_attention"], 2, "set model.attn_implementation=sdpa"),
])
def test_what_cannot_be_split_exactly_is_refused_in_one_line(overrides, size, says):
    with pytest.raises(ConfigError, match=says) as refused:
        _plan_of(*overrides, size=size)
    assert "\n" not in str(refused.value)


def test_gpt2_is_refused_for_its_packed_projections():
    with pytest.raises(ConfigError, match="GPT-2 packs its query, key and value projections"):
        _plan_of(family="gpt2")
