"""`optim=muon` equals a plain loop of torch's `Muon` on the blocks' matrices (a mixture's experts
one matrix at a time) and torch's `AdamW` on every other parameter, under every strategy.

The reference loads the checkpoint with `AutoModelForCausalLM` and splits its parameters by
Hugging Face's names here, not by relaytrain's rule: a matrix in `model.layers` that is no router
(`mlp.gate`) is Muon's; embeddings, head, norms and routers are AdamW's, norms undecayed.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.step.muon import MuonWithAdamW, is_router, muon_groups, takes_muon
from relaytrain.step.optim import build_optimizer, set_lr
from relaytrain.strategies import choices, strategy_class
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_decoder, tiny_moe
from tests.conformance.references import (
    assert_resumes_exactly,
    assert_same_weights,
    exempt_from_decay,
    hf_saved,
    reference_loop,
    torch_threads,
    update_delay,
)

STEPS = 3
# AdamW's epsilon 1e-4, as the conformance matrix's: with 1e-6 an embedding row's nearly-zero
# gradient (a token seen once), summed in another order, turns float noise into a full step.
# One torch thread on both sides: a worker process of a two-stage pipeline gets one of this VM's
# two cores, and the mixture's backward sums in another order on two threads than on one. That
# last-bit difference is the replicas' below, which Muon's bf16 steps magnify past AdamW's
# tolerance (measured on a 2-core AMD EPYC: pipe_flush with qwen3_moe equal to the loop bit for bit
# on one thread each, 1.5e-4 off after two steps with the loop on two).
THREADS = 1
RUN_KEYS = [f"train.threads={THREADS}", "data.seq_len=16", "data.num_samples=64", "optim=muon", "optim.lr=0.02", "optim.weight_decay=0.1",
            "optim.adamw_eps=1e-4",
            "optim.warmup_steps=1", "optim.schedule=linear", f"train.steps={STEPS}", "train.untimed_steps=0",
            "strategy.num_microbatches=2", "strategy.microbatch_size=2", "train.save_model=true", "model.dropout=0.0",
            "strategy.timeout_s=120"]


class TorchMuonAndAdamW:
    """torch.optim.Muon over the reference's block matrices (each expert's matrix its own
    parameter, a view of the stack, its gradient a view of the stack's) and torch.optim.AdamW over
    the rest, stepped together; `param_groups` both's, so the loop sets every group's rate."""

    def __init__(self, model: nn.Module, o):
        matrices, self.stacks, decayed, exempt = [], [], [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:  # a peft model's frozen base
                continue
            if ".layers." in f".{name}" and p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                if p.ndim == 2:
                    matrices.append(p)
                else:  # a mixture's experts: torch's Muon on each one's matrix
                    slices = [nn.Parameter(p.data[e]) for e in range(p.shape[0])]
                    self.stacks.append((p, slices))
                    matrices += slices
            else:
                (exempt if exempt_from_decay(name) else decayed).append(p)
        self.muon = torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                     nesterov=o.nesterov, ns_steps=o.ns_steps, eps=o.eps,
                                     ns_coefficients=tuple(o.ns_coefficients), adjust_lr_fn=o.adjust_lr_fn)
        groups = [g for g in ({"params": decayed, "weight_decay": o.weight_decay},
                              {"params": exempt, "weight_decay": 0.0}) if g["params"]]  # LoRA: every one is Muon's
        self.adamw = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.adamw_betas), eps=o.adamw_eps,
                                       fused=True) if groups else None
        self.param_groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])

    def step(self):
        for stack, slices in self.stacks:
            for e, piece in enumerate(slices):
                piece.grad = stack.grad[e]
        self.muon.step()
        if self.adamw:
            self.adamw.step()

    def zero_grad(self):
        self.muon.zero_grad()
        if self.adamw:
            self.adamw.zero_grad()
        for stack, _ in self.stacks:  # in neither optimizer: its gradient is let go here
            stack.grad = None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    # The mixture without its balancing term: the reference loop takes Hugging Face's cross-entropy
    # alone (the term under Muon is the term under AdamW: tests/models/test_moe.py).
    return {"llama": tiny_decoder(root / "llama", layers=4),
            "qwen3_moe": tiny_moe(root / "qwen3_moe", layers=4, output_router_logits=False)}


def muon_cfg(checkpoint: Path, *overrides: str):
    return resolve(compose_config([f"model.pretrained={checkpoint}", *RUN_KEYS, *overrides]), ())


# Every registered strategy with its defaults (FSDP's two replicas, the pipelines' two stages,
# pipe_interleaved's two chunks of the four blocks).
DEFAULT = {("baseline", "llama"), ("l2l", "qwen3_moe")}
CASES = [pytest.param(name, model, id=f"{name}-{model}", marks=() if (name, model) in DEFAULT else pytest.mark.slow)
         for name in choices() for model in ("llama", "qwen3_moe")]
# Replicas sum their gradients in another order than one process, a difference in the last fp32
# bits that Muon's Newton-Schulz steps, in bf16 as torch runs them, magnify and spread over each
# matrix: after three steps at lr 0.02, weights differ by ~2e-4 on average and up to ~5e-3 (FSDP's
# run, with the steps in fp32, equals the loop to 1e-6, measured). So there every weight is held
# within half a step and each tensor's mean difference within a twentieth of one, which a wrong
# update (every weight off by about a step) fails. The split step itself is exact:
# test_a_matrix_split_across_ranks_... below.
SUMMED_ELSEWHERE = (0.5, 0.05)  # (largest, mean) difference, in steps (optim.lr)


@pytest.mark.parametrize(("strategy", "model"), CASES)
def test_muon_equals_torchs_muon_and_adamw_in_a_plain_loop(checkpoints, tmp_path, strategy, model):
    cfg = muon_cfg(checkpoints[model], f"strategy={strategy}")
    run(cfg, tmp_path / "run", quiet=True)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[model], dtype=torch.float32)
    with torch_threads(THREADS):
        reference_loop(reference, TorchMuonAndAdamW(reference, cfg.optim), cfg, delay=update_delay(cfg))  # 2BW's: one
    ours = hf_saved(tmp_path / "run")
    if strategy_class(strategy).replicas(cfg) == 1:
        assert_same_weights(ours, reference, f"{strategy} {model}")
        return
    theirs = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        difference = (p - theirs[name]).abs()
        largest, mean = (share * cfg.optim.lr for share in SUMMED_ELSEWHERE)
        assert difference.max() <= largest and difference.mean() <= mean, (
            f"{strategy} {model} {name}: max {float(difference.max()):.2e}, mean {float(difference.mean()):.2e}")


def test_the_split_gives_muon_the_blocks_matrices_and_adamw_the_rest():
    muon = ["blocks.0.layer.self_attn.q_proj.weight", "block.3.layer.mlp.gate_proj.weight",
            "model.blocks.2.layer.self_attn.o_proj.weight",
            "blocks.1.layer.mlp.experts.gate_up_proj", "blocks.0.layer.self_attn.q_proj.lora_A.default.weight"]
    adamw = ["embed.embed_tokens.weight", "head.lm_head.weight", "blocks.0.layer.mlp.gate.weight",
             "block.2.layer.mlp.shared_expert_gate.weight", "blocks.0.layer.input_layernorm.weight"]
    shapes = {name: (4, 4) for name in muon + adamw}
    shapes["blocks.1.layer.mlp.experts.gate_up_proj"] = (2, 4, 4)
    shapes["blocks.0.layer.input_layernorm.weight"] = (4,)
    assert all(takes_muon(n, torch.empty(shapes[n])) for n in muon)
    assert not any(takes_muon(n, torch.empty(shapes[n])) for n in adamw)
    assert is_router("blocks.0.layer.mlp.gate.weight") and not is_router("blocks.0.layer.mlp.gate_proj.weight")


def test_one_step_on_stacked_experts_is_torchs_muon_on_each_matrix_and_adamw_scales_its_rate():
    """The optimizer alone against torch's, over several steps: a stack of two matrices, a
    matrix, an embedding and a norm; AdamW at `adamw_lr` through the schedule's `set_lr`."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"blocks.0.experts": (2, 6, 4), "blocks.0.q.weight": (5, 3), "embed.table.weight": (7, 3),
              "blocks.0.norm.weight": (3,)}
    ours = {n: nn.Parameter(torch.randn(s, generator=generator)) for n, s in shapes.items()}
    theirs = {n: nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    o = compose_config(["optim=muon", "optim.lr=0.05", "optim.adamw_lr=0.01", "optim.nesterov=false"]).optim
    optimizer = build_optimizer(ours.items(), o)
    assert isinstance(optimizer, MuonWithAdamW) and [g["kind"] for g in optimizer.param_groups] == ["muon", "adamw",
                                                                                                      "adamw"]
    slices = [nn.Parameter(theirs["blocks.0.experts"].data[e]) for e in range(2)]
    muon = torch.optim.Muon([*slices, theirs["blocks.0.q.weight"]], lr=0.05, weight_decay=0.1, nesterov=False)
    adamw = torch.optim.AdamW([{"params": [theirs["embed.table.weight"]], "weight_decay": 0.1},
                               {"params": [theirs["blocks.0.norm.weight"]], "weight_decay": 0.0}],
                              lr=0.01, eps=1e-6, fused=True)
    for step in range(3):
        grads = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
        for n in shapes:
            ours[n].grad, theirs[n].grad = grads[n].clone(), grads[n].clone()
        for e, piece in enumerate(slices):
            piece.grad = theirs["blocks.0.experts"].grad[e]
        set_lr(optimizer, 0.05 * (step + 1) / 3)
        for group in muon.param_groups + adamw.param_groups:
            group["lr"] = (0.05 if group in muon.param_groups else 0.01) * (step + 1) / 3
        optimizer.step()
        muon.step()
        adamw.step()
    for n in shapes:
        torch.testing.assert_close(ours[n], theirs[n], atol=0, rtol=0, msg=n)


def test_a_resumed_optimizer_continues_exactly(tmp_path):
    """Its state dict (momenta, moments, the groups' rates and kinds) saved and loaded into a new
    one, also a flat one (the eager param server's), continues bit for bit."""
    generator = torch.Generator().manual_seed(1)
    shapes = {"blocks.0.q.weight": (5, 3), "embed.table.weight": (7, 3)}
    o = compose_config(["optim=muon"]).optim
    first = {n: nn.Parameter(torch.randn(s, generator=generator)) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=generator) for n, s in shapes.items()} for _ in range(3)]
    optimizer = build_optimizer(first.items(), o)
    for g in grads[:2]:
        for n in shapes:
            first[n].grad = g[n].clone()
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optim.pt")
    for flat in (False, True):
        second = {n: nn.Parameter(p.detach().clone()) for n, p in first.items()}
        resumed = build_optimizer(second.items(), o, flat=flat)
        resumed.load_state_dict(torch.load(tmp_path / "optim.pt"))
        for n in shapes:
            second[n].grad = grads[2][n].clone()
        resumed.step()
        expected = {n: nn.Parameter(p.detach().clone()) for n, p in first.items()}
        again = build_optimizer(expected.items(), o)
        again.load_state_dict(torch.load(tmp_path / "optim.pt"))
        for n in shapes:
            expected[n].grad = grads[2][n].clone()
        again.step()
        for n in shapes:
            torch.testing.assert_close(second[n], expected[n], atol=0, rtol=0, msg=f"{n} flat={flat}")


def test_muon_groups_follow_the_keys():
    o = compose_config(["optim=muon", "optim.lr=0.1", "optim.adamw_lr=0.02", "optim.adamw_weight_decay=0.0"]).optim
    groups = muon_groups([("blocks.0.w", nn.Parameter(torch.ones(2, 2))), ("head.w", nn.Parameter(torch.ones(2, 2)))], o)
    muon, adamw = groups
    assert (muon["kind"], muon["lr"], muon["weight_decay"]) == ("muon", 0.1, 0.1)
    assert (adamw["kind"], adamw["lr"], adamw["weight_decay"]) == ("adamw", 0.02, 0.0)
    assert adamw["lr_scale"] == pytest.approx(0.2)


@pytest.mark.parametrize(("override", "says"), [
    ("optim.adjust_lr_fn=sqrt", "optim.adjust_lr_fn=sqrt"),
    ("optim.ns_coefficients=[1.0,2.0]", "three"),
    ("optim.momentum=-1", "optim.momentum"),
])
def test_bad_muon_keys_are_one_line(tmp_path, override, says):
    with pytest.raises(ConfigError, match=says) as refused:
        validate(compose_config(["optim=muon", override]))
    assert "\n" not in str(refused.value)


# --------------------------------------------------------------------------- split matrices (FSDP)

SPLIT_SHAPES = {"blocks.0.q.weight": (6, 4), "blocks.0.experts": (4, 6, 4), "embed.table.weight": (8, 4),
                "blocks.0.norm.weight": (6,)}


def _draws(step: int) -> tuple[dict, dict]:
    """The parameters' initial values and step `step`'s gradients, the same in every process."""
    generator = torch.Generator().manual_seed(10 + step)
    start = {n: torch.randn(s, generator=generator) for n, s in SPLIT_SHAPES.items()}
    return start, {n: torch.randn(s, generator=generator) for n, s in SPLIT_SHAPES.items()}


def _split_muon(mesh, steps: int = 2) -> dict:
    """Muon with AdamW over parameters split by rows across `mesh` (FSDP's Shard(0)), fed whole
    gradients split the same way: each parameter gathered whole after `steps` steps."""
    from torch.distributed.tensor import Shard, distribute_tensor

    o = compose_config(["optim=muon", "optim.lr=0.05"]).optim
    params = {n: nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None))
              for n, t in _draws(0)[0].items()}
    optimizer = build_optimizer(params.items(), o)
    for step in range(steps):
        grads = _draws(step)[1]
        for n, p in params.items():
            p.grad = distribute_tensor(grads[n], mesh, [Shard(0)], src_data_rank=None)
        optimizer.step()
    return {n: p.full_tensor() for n, p in params.items()}


@pytest.mark.slow  # two spawned ranks, ~10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_matrix_split_across_ranks_steps_as_torchs_muon_on_the_whole_one(tmp_path):
    """Under FSDP each rank holds some rows: the update is gathered, orthogonalized whole and each
    rank keeps its rows, bit for bit the one-process optimizer on the whole matrix (itself torch's
    Muon on each expert's matrix and torch's AdamW: the tests above). A whole run under FSDP also
    sums its gradients in another order, which the bf16 Newton-Schulz steps magnify: that
    equality is the looser one of `SUMMED_ELSEWHERE`."""
    from tests.placement.test_tensor_parallel import on_tensor_ranks

    ranks = on_tensor_ranks(_split_muon, tmp_path)
    whole = {n: nn.Parameter(t.clone()) for n, t in _draws(0)[0].items()}
    optimizer = build_optimizer(whole.items(), compose_config(["optim=muon", "optim.lr=0.05"]).optim)
    for step in range(2):
        grads = _draws(step)[1]
        for n, p in whole.items():
            p.grad = grads[n].clone()
        optimizer.step()
    for rank in ranks:
        for n, p in whole.items():
            torch.testing.assert_close(rank[n], p.detach(), atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("strategy", ["l2l", pytest.param("fsdp", marks=pytest.mark.slow),
                                      pytest.param("pipe_flush", marks=pytest.mark.slow)])
def test_a_run_resumed_from_its_step_one_checkpoint_ends_on_the_same_weights(checkpoints, tmp_path, strategy):
    """The momenta and moments (flat under l2l, split under FSDP, per stage) come back exactly."""
    assert_resumes_exactly(partial(muon_cfg, checkpoints["qwen3_moe"]), [f"strategy={strategy}"], tmp_path)


def test_the_planner_times_a_blocks_update_with_muons_matrices_in_it(checkpoints):
    """The cost model profiles one block's optimizer step over the block's parameters named as in
    a run, so Muon's Newton-Schulz steps are in the planner's step times."""
    from relaytrain.cost.profile import block_named_parameters
    from relaytrain.models import build_model

    model = build_model(muon_cfg(checkpoints["llama"]).model, quiet=True)
    named = block_named_parameters(model)
    groups = muon_groups(named, compose_config(["optim=muon"]).optim)
    matrices = {id(p) for g in groups if g["kind"] == "muon" for p in g["params"]}
    assert {n for n, p in named if id(p) in matrices} == {n for n, p in named if p.ndim == 2}


@pytest.mark.parametrize("strategy", ["l2l", pytest.param("baseline", marks=pytest.mark.slow)])
def test_lora_continues_an_adapter_with_muon_on_its_matrices_as_a_plain_peft_loop(checkpoints, tmp_path, strategy):
    """adapter=lora: every trained tensor is an adapter's matrix in a block, so Muon steps them all
    (each lora_A and lora_B its own matrix), as torch's Muon does in a plain peft loop."""
    from peft import PeftModel

    from tests.conformance.references import adapters_of, peft_adapter

    base = checkpoints["llama"]
    adapter = peft_adapter(base, tmp_path / "adapter")
    cfg = muon_cfg(base, f"strategy={strategy}", "adapter=lora", f"adapter.pretrained={adapter}")
    run(cfg, tmp_path / "run", quiet=True)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter,
                                          is_trainable=True)
    optimizer = TorchMuonAndAdamW(reference, cfg.optim)
    assert optimizer.adamw is None and optimizer.muon.param_groups[0]["params"]
    reference_loop(reference, optimizer, cfg)
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     tmp_path / "run" / "model")
    theirs, mine = adapters_of(reference), adapters_of(ours)
    start = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter))
    assert mine.keys() == theirs.keys() and mine
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=key)
        assert (p - start[key]).abs().max() > 1e-3, f"{key} did not train"


def test_newton_schulz_on_the_device_beside_host_masters_steps_as_on_the_host(checkpoints, tmp_path):
    """`optim.orthogonalize_on=device` ships each update to the device in bf16 and back; on this
    CPU the "device" is the host, so the same path runs and the l2l run ends on the same weights
    bit for bit (and so on the plain loop's: the test above). A GPU checks it on its device
    (tests/test_gpu.py)."""
    names = {}
    for where in ("host", "device"):
        run(muon_cfg(checkpoints["qwen3_moe"], "strategy=l2l", f"optim.orthogonalize_on={where}"),
            tmp_path / where, quiet=True)
        names[where] = dict(hf_saved(tmp_path / where).named_parameters())
    for name, p in names["host"].items():
        torch.testing.assert_close(names["device"][name], p, rtol=0, atol=0, msg=name)


def test_where_the_newton_schulz_steps_run_follows_the_key_and_the_faster_side(monkeypatch, capsys):
    """host: the host; device: the run's device; auto: the host beside no GPU, else the faster of
    the two for the largest matrix (timed once a process, said in one line); no matrix: nowhere."""
    from relaytrain.step import muon

    o = compose_config(["optim=muon"]).optim
    cpu, gpu, shapes = torch.device("cpu"), torch.device("cuda", 0), [torch.Size([8, 4]), torch.Size([16, 32])]
    for where, device, expected in (("host", gpu, None), ("device", gpu, gpu), ("device", cpu, cpu), ("auto", cpu, None)):
        o.orthogonalize_on = where
        assert muon.orthogonalizing_device(o, device, shapes) == expected, (where, device)
    assert muon.orthogonalizing_device(o, gpu, []) is None
    o.orthogonalize_on = "auto"
    for host_s, device_s, expected in ((0.2, 0.05, gpu), (0.05, 0.2, None)):
        monkeypatch.setattr(muon, "_CHOSEN", {})
        timed = []
        monkeypatch.setattr(muon, "_newton_schulz_seconds",
                            lambda shape, on, h=host_s, d=device_s, t=timed: t.append(shape) or (h if on is None else d))
        assert muon.orthogonalizing_device(o, gpu, shapes) == expected
        assert muon.orthogonalizing_device(o, gpu, shapes) == expected and timed == [(16, 32)] * 2  # once
        said = capsys.readouterr().err
        assert said.count("\n") == 1 and "16 x 32" in said and f"{host_s * 1e3:.1f} ms on the host" in said
        assert said.rstrip().endswith("device" if expected is not None else "host")
