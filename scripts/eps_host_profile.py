"""Where the eager param server's time goes on one block, piece by piece (docs/benchmarks.md,
"GPU: the host update").

For one block of a decoder shape (default: Qwen2.5-7B's, 233 M parameters) this times, on the
machine it runs on, each thing the EPS does to the block every step:
- AdamW's fused step over the block's fp32 masters at several kernel thread counts (the
  worker takes the caller's count beside a CUDA device);
- the gradient's conversion from bf16 into an fp32 `.grad`: into a fresh tensor (before
  `KeptTensors`) and into one kept from the step before;
- the wire refresh: the updated fp32 masters copied into the bf16 copy that travels;
- on a CUDA device, the block's bf16 gradient downloaded into pinned memory and its bf16 wire
  uploaded from pinned memory (GB/s over PCIe).
Each figure is the median of `--repeats` after one unmeasured run. It prints one line per
figure and writes them as JSON to `--out`.

    python scripts/eps_host_profile.py --out eps_host_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # name: (hidden, query heads x head width, key/value heads x head width, intermediate)
    "qwen2.5-7b": (3584, 28 * 128, 4 * 128, 18944),
    "llama3.2-1b": (2048, 32 * 64, 8 * 64, 8192),
}


def block_sizes(shape: str) -> list[int]:
    """The element counts of one block's weight matrices (norms and biases are too small to matter)."""
    hidden, q, kv, inter = SHAPES[shape]
    return [hidden * q, hidden * kv, hidden * kv, q * hidden, hidden * inter, hidden * inter, inter * hidden]


def median_s(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    p.add_argument("--threads", default="1,4,8,16", help="kernel thread counts for the AdamW step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    sizes = block_sizes(args.shape)
    numel = sum(sizes)
    cuda = torch.cuda.is_available()
    masters = [torch.randn(n) for n in sizes]
    grads16 = [torch.randn(n).bfloat16() for n in sizes]
    wires = [m.bfloat16() for m in masters]
    kept = [torch.empty(n) for n in sizes]
    exp_avg, exp_avg_sq = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(()) for _ in sizes]
    out: dict = {"shape": args.shape, "block_parameters": numel, "cores": torch.get_num_threads(),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}

    def adamw():
        torch._fused_adamw_(masters, kept, exp_avg, exp_avg_sq, [], steps, lr=1e-5, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    callers = torch.get_num_threads()
    for threads in [int(t) for t in args.threads.split(",") if int(t) <= max(callers, 1) * 2]:
        torch.set_num_threads(threads)
        out[f"adamw_s_{threads}_threads"] = median_s(adamw, args.repeats)
    torch.set_num_threads(callers)
    out["adamw_s"] = median_s(adamw, args.repeats)
    out["grad_to_fp32_fresh_s"] = median_s(lambda: [g.float() for g in grads16], args.repeats)
    out["grad_to_fp32_kept_s"] = median_s(lambda: torch._foreach_copy_(kept, grads16), args.repeats)
    out["wire_refresh_s"] = median_s(lambda: torch._foreach_copy_(wires, masters), args.repeats)
    if cuda:
        device_grads = [g.cuda() for g in grads16]
        pinned = [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for n in sizes]
        pinned_wires = [w.pin_memory() for w in wires]
        on_device = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
        sync = torch.cuda.synchronize
        down = median_s(lambda: torch._foreach_copy_(pinned, device_grads, non_blocking=True), args.repeats, sync)
        up = median_s(lambda: torch._foreach_copy_(on_device, pinned_wires, non_blocking=True), args.repeats, sync)
        out |= {"grad_download_s": down, "wire_upload_s": up,
                "download_gb_s": 2 * numel / down / 1e9, "upload_gb_s": 2 * numel / up / 1e9}
    out["host_update_s"] = out["grad_to_fp32_kept_s"] + out["adamw_s"] + out["wire_refresh_s"]
    out["host_update_parameters_per_s"] = numel / out["host_update_s"]
    for key, value in out.items():
        print(f"eps_host_profile: {key} = {value:.4g}" if isinstance(value, float) else f"eps_host_profile: {key} = {value}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
