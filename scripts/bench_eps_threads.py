"""Why the EPS's updates run where they do (docs/benchmarks.md): one fused AdamW step over
bert_base's 201 parameter tensors, its 126 small ones (biases, norms), and the same
parameters as one flat tensor, each timed on the main thread and on a second thread.

On a CPU torch runs each tensor of a fused step as an OpenMP parallel region: the main
thread's team is warm, a second thread's is not, and waking it costs per region. The last
case is what a flat update costs when the gradients arrive as separate tensors, as autograd
makes them: each step first gathers them into the flat gradient (docs/l2l.md, "Flat buffers").

    .venv/bin/python scripts/bench_eps_threads.py [--repeats 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from relaytrain.models import build_model
from relaytrain.run.compose import compose_config


def step_time(params: list[torch.nn.Parameter], repeats: int, gathered: list[torch.Tensor] | None = None) -> float:
    """Median seconds of one fused AdamW step over `params` (one unmeasured step first). With
    `gathered` (separate gradients, `params` one flat tensor), each step first copies them in."""
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    pieces = list(params[0].grad.split([g.numel() for g in gathered])) if gathered else []

    def step():
        if gathered:
            torch._foreach_copy_(pieces, [g.reshape(-1) for g in gathered])
        optimizer.step()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def on_second_thread(fn, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    model = build_model(compose_config(["model=bert_base"]).model, seed=0)
    tensors = list(model.parameters())
    flat = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in tensors]))]
    cases = {
        f"{len(tensors)} tensors": (tensors, None),
        f"{sum(p.numel() < 100_000 for p in tensors)} small tensors": ([p for p in tensors if p.numel() < 100_000], None),
        "one flat tensor": (flat, None),
        "flat, grads gathered": (flat, [torch.full_like(p, 1e-3) for p in tensors]),
    }
    print(f"fused AdamW, {torch.get_num_threads()} threads, median of {args.repeats} steps (ms)")
    for name, (params, gathered) in cases.items():
        main_ms = step_time(params, args.repeats, gathered) * 1e3
        second_ms = on_second_thread(step_time, params, args.repeats, gathered) * 1e3
        print(f"  {name:<20} main thread {main_ms:7.2f}   second thread {second_ms:7.2f}")


if __name__ == "__main__":
    main()
