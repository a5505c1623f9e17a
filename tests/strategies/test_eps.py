"""Eager param server: per-part updates on the worker equal one whole-model optimizer step."""

import threading
import time

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from relaytrain.records.optimizer_state import load_optimizer_state, optimizer_state
from relaytrain.step.optim import build_optimizer, optimizer_schemas, set_lr
from relaytrain.step.precision import LossScaler
from relaytrain.strategies.eps import EagerParamServer, Shipment
from relaytrain.strategies.eps.worker import Worker


def optim_cfg(name="adamw", grad_clip=0.0, **overrides):
    extra = {"momentum": 0.9} if name == "sgd" else {}
    cfg = OmegaConf.structured(optimizer_schemas()[name](grad_clip=grad_clip, lr=1e-2, **extra))
    return OmegaConf.merge(cfg, overrides)


class Chain(nn.Module):
    """Three parts; `tied` makes the last part reuse the first part's weight, as GPT-2's LM head."""

    def __init__(self, tied: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.parts = nn.ModuleList([nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 8)])
        if tied:
            self.parts[2].weight = self.parts[0].weight

    def named_modules_in_order(self):
        return [(f"part.{i}", m) for i, m in enumerate(self.parts)]


def random_grads(module: nn.Module, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in module.parameters()]


def run_eps(model: Chain, cfg, steps=3, scaler=None, grad_scale=1.0, wire_dtype=torch.float32):
    eps = EagerParamServer(model.named_modules_in_order(), cfg, scaler or LossScaler(False), wire_dtype)
    overflows = []
    try:
        for step in range(steps):
            eps.set_lr(cfg.lr)
            for index in reversed(range(len(eps.parts))):
                grads = [g * grad_scale for g in random_grads(model.parts[index], 100 * step + index)]
                eps.submit(index, grads)
            overflows.append(eps.wait())
    finally:
        eps.close()
    return eps, overflows


def run_whole_model(model: Chain, cfg, steps=3, first_step=0, optimizer=None):
    """The reference: one optimizer over the whole model; tied gradients summed by hand."""
    optimizer = optimizer or build_optimizer(model.named_parameters(), cfg)
    for step in range(first_step, first_step + steps):
        for index in reversed(range(len(model.parts))):
            for p, g in zip(model.parts[index].parameters(), random_grads(model.parts[index], 100 * step + index),
                            strict=True):
                p.grad = g if p.grad is None else p.grad + g
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def assert_same(a: nn.Module, b: nn.Module):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
@pytest.mark.parametrize("tied", [False, True])
def test_per_part_updates_equal_a_whole_model_step(name, tied):
    cfg = optim_cfg(name)
    ours, reference = Chain(tied), Chain(tied)
    eps, _ = run_eps(ours, cfg)
    run_whole_model(reference, cfg)
    assert_same(ours, reference)
    assert not eps.defer


def test_tied_weight_has_one_master_updated_once():
    model = Chain(tied=True)
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg("sgd"), LossScaler(False))
    try:
        shared = model.parts[0].weight
        owners = [part.name for part in eps.parts if any(p is shared for p in part.owned)]
        users = [part.name for part in eps.parts if any(p is shared for p in part.masters)]
        assert owners == ["part.0"] and users == ["part.0", "part.2"]
        assert sum(p.numel() for part in eps.parts for p in part.owned) == sum(p.numel() for p in model.parameters())
    finally:
        eps.close()


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_global_norm_clipping_defers_updates_and_matches_clip_grad_norm(name):
    cfg = optim_cfg(name, grad_clip=0.1)  # random unit-variance gradients: the clip always acts
    ours, reference = Chain(tied=True), Chain(tied=True)
    eps, _ = run_eps(ours, cfg)
    run_whole_model(reference, cfg)
    assert eps.defer
    assert_same(ours, reference)


def test_fp16_overflow_skips_every_update_and_lowers_the_scale():
    model, before = Chain(), Chain()
    scaler = LossScaler(True, init_scale=1024.0)
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), scaler)
    try:
        eps.set_lr(1e-2)
        for index in reversed(range(3)):
            grads = random_grads(model.parts[index], index)
            if index == 0:  # the last part to arrive overflows: the parts above must not have moved
                grads[0][0, 0] = float("inf")
            eps.submit(index, grads)
        assert eps.wait() is True
    finally:
        eps.close()
    assert_same(model, before)
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    assert all(p.grad is None for p in model.parameters())


def test_fp16_loss_scale_is_divided_out_before_the_update():
    scale = 1024.0
    ours, reference = Chain(), Chain()
    _, overflows = run_eps(ours, optim_cfg("sgd"), scaler=LossScaler(True, init_scale=scale), grad_scale=scale)
    run_whole_model(reference, optim_cfg("sgd"))
    assert overflows == [False, False, False]
    assert_same(ours, reference)


def test_updates_run_behind_the_caller_then_on_it_in_order_one_at_a_time():
    """While the caller computes, updates run on the worker thread; what is still queued when it
    waits runs on the caller's own thread (its warm kernel threads). Never two at once, in order."""
    model = Chain()
    ran, running, overlapped = [], [0], []
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), LossScaler(False))
    first_done = threading.Event()

    def enter(index):
        running[0] += 1
        overlapped.append(running[0] > 1)
        ran.append((index, threading.current_thread().name))
        time.sleep(0.01)  # long enough that a concurrent task would show

    def leave(index):
        running[0] -= 1
        if index == 2:
            first_done.set()

    try:
        def traced(update, index):
            def run():
                enter(index)
                update()
                leave(index)
            return run

        for index, part in enumerate(eps.parts):  # the EPS steps a part with `update()`, no hooks
            part.optimizer.update = traced(part.optimizer.update, index)
        eps.submit(2, random_grads(model.parts[2], 2))
        assert first_done.wait(10)  # the caller "computes" while the worker updates part 2
        for index in (1, 0):
            eps.submit(index, random_grads(model.parts[index], index))
        eps.wait()
    finally:
        eps.close()
    assert [index for index, _ in ran] == [2, 1, 0]
    assert ran[0][1] == "eps-worker" and not any(overlapped)
    assert {name for _, name in ran} <= {"eps-worker", threading.current_thread().name}
    stats = eps.stats.as_dict()
    assert stats["updated_parameters"] == sum(p.numel() for p in model.parameters())
    assert stats["parameters_per_s"] > 0 and 0.0 <= stats["exposed_fraction"] <= 1.0


def test_the_worker_leaves_the_callers_thread_count_alone():
    threads = torch.get_num_threads()
    eps = EagerParamServer(Chain().named_modules_in_order(), optim_cfg(), LossScaler(False))
    eps.close()
    assert torch.get_num_threads() == threads
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [threads]  # threads started afterwards keep torch's default too


def test_the_worker_thread_computes_on_one_kernel_thread_whatever_the_callers_count():
    """Beside the caller's team, a second multi-threaded OpenMP team would oversubscribe the
    cores (and stop libgomp's threads spinning between the caller's regions)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    model = Chain()
    seen, done = [], threading.Event()
    try:
        eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), LossScaler(False))
        update = eps.parts[2].optimizer.update

        def traced():
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            update()
            done.set()

        eps.parts[2].optimizer.update = traced
        try:
            eps.submit(2, random_grads(model.parts[2], 2))
            assert done.wait(10)  # run by the worker thread: the caller has not waited yet
            eps.wait()
        finally:
            eps.close()
        assert seen == [("eps-worker", 1)]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_beside_a_cuda_device_the_worker_thread_takes_the_callers_count():
    """There the caller's compute is the GPU's: the host's cores are the worker's (Worker's `threads`)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    seen, done = [], threading.Event()
    worker = Worker(threads=torch.get_num_threads())
    try:
        worker.put(lambda: (seen.append(torch.get_num_threads()), done.set()))
        assert done.wait(10)
        worker.join()
    finally:
        worker.close()
        torch.set_num_threads(saved)
    assert seen == [2]


def test_half_wires_follow_the_fp32_masters():
    model = Chain(tied=True)
    eps, _ = run_eps(model, optim_cfg(), wire_dtype=torch.bfloat16, steps=1)
    for part in eps.parts:
        for wire, master in zip(part.wires, part.masters, strict=True):
            assert wire.dtype == torch.bfloat16 and master.dtype == torch.float32
            torch.testing.assert_close(wire, master.detach().to(torch.bfloat16), rtol=0, atol=0)
    head = eps.parts[2]
    head_wire = next(w for w, p in zip(head.wires, head.masters, strict=True) if p is model.parts[0].weight)
    assert head_wire is eps.parts[0].wires[0]  # one wire per tied master, refreshed by its owner


@pytest.mark.parametrize("tied", [False, True])
def test_half_gradients_reuse_their_fp32_tensors_and_equal_the_fp32_step(tied):
    """bf16 gradients (cross mixed precision) become fp32 .grads in tensors the EPS lends again
    the next step, tied sums included: the update is the whole-model step on the same values."""
    ours, reference = Chain(tied), Chain(tied)
    cfg = optim_cfg()
    eps = EagerParamServer(ours.named_modules_in_order(), cfg, LossScaler(False))
    storages = []
    try:
        for step in range(3):
            eps.set_lr(cfg.lr)
            for index in reversed(range(len(eps.parts))):
                grads = [g.bfloat16() for g in random_grads(ours.parts[index], 100 * step + index)]
                eps.submit(index, grads)
                if index == 1:  # a part stepped already holds no .grad, its tensors are back in the pool
                    eps.settle()
                    storages.append({p.grad.data_ptr() for p in ours.parts[0].parameters() if p.grad is not None})
            eps.wait()
    finally:
        eps.close()
    optimizer = build_optimizer(reference.named_parameters(), cfg)
    for step in range(3):  # the reference sees the same (bf16-rounded) values in fp32
        for index in reversed(range(len(reference.parts))):
            for p, g in zip(reference.parts[index].parameters(), random_grads(reference.parts[index], 100 * step + index),
                            strict=True):
                g = g.bfloat16().float()
                p.grad = g if p.grad is None else p.grad + g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_same(ours, reference)
    if tied:  # the head's share of the tied weight waits in a lent tensor, the same one each step
        assert storages[0] == storages[1] == storages[2] and storages[0]
    assert all(p.grad is None for p in ours.parameters())


@pytest.mark.parametrize("caller_takes_over", [True, False], ids=["cpu", "beside a gpu"])
def test_carried_updates_land_lowest_part_first_each_at_its_own_steps_rate(caller_takes_over):
    """Carrying updates into the next step: `wait` leaves the queued updates, the next forward
    awaits only the part it uploads, the lowest part runs first, and every update uses the
    learning rate of the step that shipped it: the weights equal the whole-model steps. On a
    CPU the waiting caller runs the queued updates; beside a GPU it waits for the worker."""
    lrs = [1e-2, 3e-3]
    ours, reference = Chain(), Chain()
    eps = EagerParamServer(ours.named_modules_in_order(), optim_cfg(), LossScaler(False), carry=True)
    eps._caller_takes_over = caller_takes_over  # what pin=True (a CUDA device) sets; pinning needs CUDA
    order, first_running, gate = [], threading.Event(), threading.Event()

    def landed(index):
        order.append(index)
        if len(order) == 1:  # the first update to run holds the worker: the others queue behind it
            first_running.set()
            gate.wait()

    try:
        assert eps.carry
        for step, lr in enumerate(lrs):
            eps.set_lr(lr)
            for index in reversed(range(len(eps.parts))):  # as backward ships them: last part first
                grads = random_grads(ours.parts[index], 100 * step + index)
                eps.submit(index, Shipment(grads, then=lambda index=index: landed(index)))
            if step == 0:
                first_running.wait()
                assert not eps.wait() and order == order[:1]  # the step ends; its updates are still queued
                gate.set()
                for index in range(len(eps.parts)):  # the next forward's uploads, in order
                    eps.await_part(index)
                    assert index in order
                first, rest = order[0], order[1:]
                assert rest == sorted(set(range(len(eps.parts))) - {first})  # lowest first behind the one running
        eps.drain()
    finally:
        gate.set()
        eps.close()
    optimizer = build_optimizer(reference.named_parameters(), optim_cfg())
    for step, lr in enumerate(lrs):
        set_lr(optimizer, lr)
        run_whole_model(reference, optim_cfg(), steps=1, first_step=step, optimizer=optimizer)
    assert_same(ours, reference)


@pytest.mark.parametrize("why", ["tied", "clipping"])
def test_updates_are_not_carried_where_a_step_needs_them_all(why):
    """A tied head's gradient sums into the embeddings' before their step, and clipping needs
    every gradient: the step then waits for its updates as before."""
    model, cfg = Chain(tied=why == "tied"), optim_cfg(grad_clip=1.0 if why == "clipping" else 0.0)
    eps = EagerParamServer(model.named_modules_in_order(), cfg, LossScaler(False), carry=True)
    try:
        assert not eps.carry
    finally:
        eps.close()


def test_a_failed_update_is_raised_by_wait():
    model = Chain()
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), LossScaler(False))
    try:
        eps.submit(0, [torch.zeros(3), torch.zeros(3)])  # wrong shapes
        with pytest.raises(RuntimeError):
            eps.wait()
        eps.submit(0, random_grads(model.parts[0], 0))  # the server keeps working afterwards
        assert eps.wait() is False
    finally:
        eps.close()


class Embedded(nn.Module):
    """An embeddings part (a 50-row table and a norm) and a head that may reuse the table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.ModuleDict({"table": nn.Embedding(50, 16), "norm": nn.LayerNorm(16)})
        self.head = nn.Linear(16, 16)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_table_updated_early_but_for_its_looked_up_rows_ends_bit_identical(optimizer, tied):
    """Every row but those the minibatch looked up is updated before the embeddings' backward;
    those rows are redone with their whole gradient after it. Three steps, against the part's
    plain update."""
    results = []
    for early in (False, True):
        model = Embedded()
        table = model.embed["table"].weight
        head = nn.ModuleDict({"head": model.head, **({"table": model.embed["table"]} if tied else {})})
        eps = EagerParamServer([("embed", model.embed), ("head", head)], optim_cfg(optimizer), LossScaler(False))
        generator = torch.Generator().manual_seed(1)
        try:
            for _ in range(3):
                rows = torch.unique(torch.randint(0, 50, (12,), generator=generator))
                head_grads = [torch.randn(p.shape, generator=generator) for p in eps.parts[1].masters]
                embed_grads = [torch.randn(p.shape, generator=generator) for p in eps.parts[0].masters]
                looked_up = torch.zeros(50, 1)
                looked_up[rows] = 1.0
                embed_grads[0] *= looked_up  # an embedding's own gradient: zero outside its rows
                assert eps.can_update_table_early(0, table)
                eps.submit(1, head_grads)
                if early:
                    eps.update_table_early(0, table, rows)
                    eps.await_table_early()
                eps.submit(0, embed_grads)
                eps.wait()
        finally:
            eps.close()
        results.append([p.detach().clone() for p in model.parameters()])
        assert eps.stats.updated_parameters == 3 * sum(p.numel() for p in model.parameters())
    for plain, early in zip(*results, strict=True):
        assert torch.equal(plain, early)


def test_the_early_table_update_is_refused_where_it_would_not_be_exact():
    model = Embedded()
    table = model.embed["table"].weight
    parts = [("embed", model.embed), ("head", model.head)]
    cases = [(optim_cfg("lamb"), 0),  # a per-tensor trust ratio
             (optim_cfg(grad_clip=1.0), 0),  # deferred: every update waits for the global norm
             (optim_cfg(), 1)]  # a part that does not own the table
    for cfg, index in cases:
        eps = EagerParamServer(parts, cfg, LossScaler(False))
        assert not eps.can_update_table_early(index, table)
        eps.close()


def test_waiting_for_the_early_table_after_a_failed_update_raises_instead_of_hanging():
    model = Embedded()
    table = model.embed["table"].weight
    eps = EagerParamServer([("embed", model.embed), ("head", model.head)], optim_cfg(), LossScaler(False))
    try:
        eps.submit(1, [torch.zeros(3, 3), None])  # the wrong shape: the worker's update fails
        eps.update_table_early(0, table, torch.tensor([1, 2]))  # skipped after the failure
        with pytest.raises(RuntimeError):
            eps.await_table_early()
    finally:
        eps.close()


# -- flat per-part buffers ---------------------------------------------------------------------


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("tied", [False, True])
def test_each_parts_masters_are_views_into_its_one_buffer(tied):
    """Every master the part owns lies inside the part's buffer, the pieces tile it, and no other
    storage holds a master: views, not copies. The tied head reads the embeddings' buffer."""
    model = Chain(tied)
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), LossScaler(False))
    eps.close()
    for part in eps.parts:
        buffer = part.buffer
        assert buffer.untyped_storage().nbytes() == buffer.numel() * 4 == sum(p.numel() for p in part.owned) * 4
        end = buffer.data_ptr()
        for p in sorted(part.owned, key=torch.Tensor.data_ptr):  # the pieces tile the buffer
            assert storage(p) == storage(buffer) and p.data_ptr() == end
            end += p.numel() * 4
        assert end == buffer.data_ptr() + buffer.numel() * 4
        assert all(w.data_ptr() == p.data_ptr() for w, p in zip(part.wires, part.masters, strict=True))  # fp32
    assert {storage(p) for p in model.parameters()} == {storage(part.buffer) for part in eps.parts}
    if tied:
        assert storage(model.parts[2].weight) == storage(eps.parts[0].buffer)


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_each_parts_optimizer_state_is_views_into_one_buffer_per_kind(name):
    """Adam's moments, SGD's momentum: one buffer per kind and part, a view per parameter."""
    model = Chain()
    eps, _ = run_eps(model, optim_cfg(name), steps=2)
    for part in eps.parts:
        state = part.optimizer.state
        assert set(state) == set(part.owned)
        for key in state[part.owned[0]]:
            if key == "step":
                continue
            views = [state[p][key] for p in part.owned]
            assert len({storage(v) for v in views}) == 1, key
            assert views[0].untyped_storage().nbytes() == sum(p.numel() for p in part.owned) * 4


def test_one_fused_kernel_call_per_part_and_param_group(monkeypatch):
    """The whole update of a part is one call of torch's fused AdamW per param group (decayed or
    not) over all of that group's tensors, not torch.optim's per-call machinery."""
    calls = []
    kernel = torch._fused_adamw_

    def counted(params, *args, **kwargs):
        calls.append(len(params))
        return kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counted)
    model = Chain(tied=True)
    eps, _ = run_eps(model, optim_cfg("adamw"), steps=2)
    groups = [len(g["params"]) for part in reversed(eps.parts) for g in part.optimizer.param_groups]  # as submitted
    assert calls == 2 * groups  # two steps
    assert len(groups) == 5 and sum(groups) == len(list(model.parameters()))


FLAT_CASES = [("adamw", {}), ("adamw", {"fused": False}), ("lamb", {}), ("sgd", {}), ("sgd", {"momentum": 0.0}),
              ("sgd", {"weight_decay": 0.01})]


@pytest.mark.parametrize("name,overrides", FLAT_CASES)
@pytest.mark.parametrize("tied", [False, True])
def test_flat_updates_are_bit_identical_to_the_per_tensor_optimizer(name, overrides, tied):
    """Weights and optimizer state, by parameter name (the checkpoint's format), equal those of
    the per-tensor torch optimizer over the whole model, bit for bit, over four steps."""
    cfg = optim_cfg(name, **overrides)
    ours, reference = Chain(tied), Chain(tied)
    eps, _ = run_eps(ours, cfg, steps=4)
    whole = run_whole_model(reference, cfg, steps=4)
    for (name_, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name_
    assert_same_state(optimizer_state([p.optimizer for p in eps.parts], names(ours)),
                      optimizer_state([whole], names(reference)))


def names(model: nn.Module):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return lambda p: by_id[id(p)]


def assert_same_state(ours: dict, theirs: dict):
    assert ours.keys() == theirs.keys()
    for name, state in theirs.items():
        assert list(ours[name]) == list(state), name
        for key, value in state.items():
            mine = ours[name][key]
            assert (torch.equal(mine, value) and mine.dtype == value.dtype) if torch.is_tensor(value) else mine == value


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_a_checkpoint_of_the_per_tensor_optimizer_loads_into_the_flat_buffers(name):
    """Optimizer state saved by name from a whole-model torch optimizer (the baseline's part of a
    checkpoint) loads into the EPS's flat buffers, and training goes on bit for bit."""
    cfg = optim_cfg(name)
    ours, reference = Chain(tied=True), Chain(tied=True)
    whole = run_whole_model(reference, cfg, steps=2)
    with torch.no_grad():
        for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
            a.copy_(b)
    eps = EagerParamServer(ours.named_modules_in_order(), cfg, LossScaler(False))
    try:
        load_optimizer_state([part.optimizer for part in eps.parts], names(ours),
                             optimizer_state([whole], names(reference)))
        for part in eps.parts:  # loaded into the buffers, not kept beside them
            states = [part.optimizer.state[p] for p in part.owned]
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                assert len({storage(state[key]) for state in states if key in state}) <= 1, key
        eps.set_lr(cfg.lr)
        for index in reversed(range(len(eps.parts))):
            eps.submit(index, random_grads(ours.parts[index], 100 * 2 + index))
        eps.wait()
    finally:
        eps.close()
    run_whole_model(reference, cfg, steps=1, first_step=2, optimizer=whole)
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_eps_runs_on_the_meta_device_for_a_dry_run():
    """A dry run's EPS holds meta tensors: the same buffers and updates, nothing computed."""
    model = Chain(tied=True).to("meta")
    eps = EagerParamServer(model.named_modules_in_order(), optim_cfg(), LossScaler(False))
    try:
        eps.set_lr(1e-2)
        for index in reversed(range(len(eps.parts))):
            eps.submit(index, [torch.empty_like(p) for p in eps.parts[index].masters])
        eps.wait()
    finally:
        eps.close()
    assert all(part.buffer.is_meta and part.optimizer.state for part in eps.parts)
    assert all(p.is_meta for p in model.parameters())
