"""The GPU acceptance benchmark: L2L on a Llama-layout decoder of real width, on one CUDA device.

For 8, 16 and 32 blocks of a decoder of the Llama layout (default: hidden 2048, 32 query heads
and 8 key/value heads of width 64, SwiGLU width 8192, as Llama 3.2 1B; a 32,000-word vocabulary),
one table row per run:
- L2L (cross mixed precision cmp_bf16, AdamW in the eager param server): model TFLOP/s, the share
  of the step spent waiting for host-to-device transfers (the strategy's `transfer_wait_s`) and
  the share the EPS's work stays exposed after overlapping with backward (`eps.exposed_s`), both
  over the sum of step times; device memory from torch.cuda.max_memory_allocated (the L2L paper's
  claim: flat in depth);
- the same model under fsdp with its shards and optimizer on the host (strategy.offload=host) and
  under the baseline (block recompute), both amp_bf16, where they fit ("out of memory" otherwise);
- the same model, rows and AdamW under Hugging Face's Trainer with DeepSpeed ZeRO-3, parameters
  and optimizer offloaded to the host (`deepspeed_contestant.py`; needs deepspeed and accelerate),
  in DeepSpeed's bf16 mode: `l2l_vs_deepspeed_zero3_offload` is L2L's samples/s over its, by depth.

Runs go through relaytrain's Python API (compose_config, train.run), L2L first at every depth,
then the baseline, then fsdp; a run that would start after `--budget-s` is listed as not run, so
the whole benchmark ends inside one 10-minute device call on an H100. The table is printed as
markdown after every run and written, as JSON, to `--out` (partial results survive a kill).

    make gpu-install bench-gpu BENCH_GPU_OUT=$OUT/bench_gpu.json      # on the GPU machine
    .venv/bin/python scripts/bench_gpu.py --out bench_gpu.json          # any CUDA machine

Without a CUDA device it prints one line and exits 0 (`--cpu-smoke` runs tiny sizes on the CPU
instead, to check the script itself: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

GiB = 2**30
UNTIMED = 1  # steps left out of every figure: the first allocates the optimizer state and the pinned buffers
# Decoder widths: hidden, query heads, key/value heads, head width, SwiGLU width, vocabulary.
SHAPES = {"qwen2.5-7b": (3584, 28, 4, 128, 18944, 152064), "qwen2.5-14b": (5120, 40, 8, 128, 13824, 152064),
          "llama3.2-1b": (2048, 32, 8, 64, 8192, 32000)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the table as JSON here (the record benchmarks/gpu/ keeps)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a preset of the width keys below (and the vocabulary)")
    p.add_argument("--depths", default="8,16,32", help="block counts, comma-separated")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per run, the first a warm-up left out of throughput")
    p.add_argument("--l2l-precision", default="cmp_bf16")
    p.add_argument("--precision", default="amp_bf16", help="the baseline's and fsdp's")
    p.add_argument("--optim", default="adamw")
    p.add_argument("--l2l-extra", default="", help="more keys for the L2L rows, comma-separated (e.g. "
                   "strategy.overlap_next_step=false); the rows' label says them")
    p.add_argument("--commit", default=os.environ.get("RELAYTRAIN_COMMIT"),
                   help="the commit the checkout is at, for the record (the device machine gets no .git)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no run after this many seconds (the device call allows 600 in all)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="which, comma-separated")
    p.add_argument("--no-adapters", action="store_true", help="leave out the LoRA and QLoRA rows under l2l")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the script, not the GPU")
    args = p.parse_args(argv)
    if args.shape:
        (args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, args.vocab) = SHAPES[args.shape]
    if args.cpu_smoke:
        args.depths, args.hidden, args.heads, args.kv_heads, args.head_dim = "2,4", 32, 4, 2, 8
        args.intermediate, args.vocab, args.seq_len, args.microbatch_size, args.microbatches = 64, 300, 16, 2, 2
    args.model_name = args.shape if args.shape and not args.cpu_smoke else f"llama-h{args.hidden}"
    return args


class Run(NamedTuple):
    label: str  # the table's strategy column
    strategy: str
    blocks: int
    extra: list[str]  # keys beside the shape's, the data's and the strategy's
    pretrained: bool = False  # over a bf16 checkpoint of the shape (`write_checkpoint`), not a fresh model


STRATEGIES = ("l2l", "l2l_stash_cpu", "baseline", "fsdp", "deepspeed")  # the order they run in
DEEPSPEED = "deepspeed zero3 offload"  # the Trainer + DeepSpeed contestant's label (`deepspeed_contestant.py`)


def runs(args) -> list[Run]:
    """In the order they run: L2L at every depth first (the claim under test), with its stash on
    the device and then on the host, then LoRA and QLoRA under L2L at the shallowest depth (over
    a bf16 checkpoint of that model; `--no-adapters` leaves them out), then the contestants; only
    the strategies `--strategies` names."""
    depths, names = [int(d) for d in args.depths.split(",")], args.strategies.split(",")
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"bench_gpu: --strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    extra = [kv for kv in args.l2l_extra.split(",") if kv]
    l2l = [f"precision={args.l2l_precision}", *extra]
    suffix = f" ({', '.join(extra)})" if extra else ""
    options = {"l2l": l2l, "l2l_stash_cpu": l2l,
               "baseline": [f"precision={args.precision}", "strategy.recompute=block"],
               "fsdp": [f"precision={args.precision}", "strategy.replicas=1", "strategy.offload=host"],
               "deepspeed": []}
    labels = {"deepspeed": DEEPSPEED}

    def each_depth(chosen: tuple[str, ...]) -> list[Run]:
        return [Run(labels.get(name, name) + (suffix if options[name] is l2l else ""), name, blocks, options[name])
                for name in chosen if name in names for blocks in depths]

    adapters = [] if args.no_adapters or "l2l" not in names else [
        Run(f"l2l {adapter}", "l2l", depths[0], [*l2l, f"adapter={adapter}"], pretrained=True)
        for adapter in ("lora", "qlora")]
    return each_depth(STRATEGIES[:2]) + adapters + each_depth(STRATEGIES[2:])


def shape(args, blocks: int) -> list[str]:
    return ["model=llama_tiny", f"model.num_layers={blocks}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}", f"model.num_kv_heads={args.kv_heads}", f"model.head_dim={args.head_dim}",
            f"model.intermediate_size={args.intermediate}", f"model.vocab_size={args.vocab}",
            f"model.max_seq_len={args.seq_len}"]


def overrides(args, r: Run, checkpoint: Path | None = None) -> list[str]:
    """The run's keys: the model's shape, or (an adapter's run) the checkpoint written of it."""
    samples = args.microbatch_size * args.microbatches * args.steps
    model = [f"model.pretrained={checkpoint}"] if r.pretrained else shape(args, r.blocks)
    return [
        *model, f"data.seq_len={args.seq_len}", f"data.num_samples={samples}",
        f"strategy={r.strategy}", f"strategy.microbatch_size={args.microbatch_size}",
        f"strategy.num_microbatches={args.microbatches}", f"optim={args.optim}",
        f"train.steps={args.steps}", f"train.untimed_steps={UNTIMED}", f"train.device={'cpu' if args.cpu_smoke else 'cuda'}",
        *r.extra,
    ]


def write_checkpoint(args, blocks: int, directory: Path) -> Path:
    """A Hugging Face checkpoint of the benchmark's shape, random weights saved in bf16 (how
    released bases ship), for the adapter rows: LoRA reads it as is, QLoRA quantizes it at load."""
    from relaytrain.models import build_model
    from relaytrain.run.compose import compose_config

    if not (directory / "config.json").exists():
        cfg = compose_config([*shape(args, blocks), "train.device=cpu"])
        build_model(cfg.model, seed=cfg.train.seed).hf_model.to(torch.bfloat16).save_pretrained(directory)
        release()
    return directory


# A row's figures that only relaytrain's strategies report (None for the DeepSpeed contestant's).
STRATEGY_FIGURES = ("transfer_wait_share", "eps_exposed_share", "eps_busy_share", "eps_parameters_per_s", "eps_kernel",
                    "updates_into_next_step")


def table_row(args, name: str, blocks: int, *, precision: str, params: int, step_s: float, flops: float | None,
              device_peak: int | None, host_rss: int, **strategy_figures) -> dict:
    """One row of the table and the record, for any contestant: `strategy_figures` among
    `STRATEGY_FIGURES`, the others None."""
    return {"strategy": name, "model": args.model_name, "blocks": blocks, "precision": precision, "params": params,
            "seq_len": args.seq_len, "tokens_per_step": args.seq_len * args.microbatch_size * args.microbatches,
            "status": "ok", "step_s": step_s, "useful_tflops": flops / 1e12 if flops else None,
            **dict.fromkeys(STRATEGY_FIGURES), **strategy_figures,
            "device_peak_gib": device_peak / GiB if device_peak is not None else None, "host_rss_gib": host_rss / GiB}


def row(args, name: str, blocks: int, results: dict) -> dict:
    """The table's figures from a run's results (results.json's fields). `useful_tflops` is the
    summary's model FLOP/s: 6 x parameters x tokens, real tokens only (the benchmark's rows are
    full), no recompute counted."""
    # The strategy's figures cover the measured steps (the trainer resets them after the untimed ones).
    report, total_s = results["strategy_report"], sum(results["step_times_s"][UNTIMED:])
    eps = report.get("eps") if isinstance(report, dict) else None
    return table_row(
        args, name, blocks, precision=results["precision"], params=results["model"]["parameters"],
        step_s=results["throughput"]["step_time_s"], flops=results["throughput"]["model_flops_per_s"],
        device_peak=results["memory"]["device"]["peak_allocated_bytes"], host_rss=results["memory"]["host_peak_rss_bytes"],
        transfer_wait_share=report["transfer_wait_s"] / total_s if "transfer_wait_s" in report else None,
        eps_exposed_share=eps["exposed_s"] / total_s if eps else None,
        eps_busy_share=eps["busy_s"] / total_s if eps else None,
        eps_parameters_per_s=eps["parameters_per_s"] if eps else None,
        eps_kernel=eps["host_kernel"] if eps else None,
        updates_into_next_step=report.get("updates_into_next_step") if isinstance(report, dict) else None)


def measure(args, r: Run, scratch: Path) -> dict:
    from relaytrain.run.compose import compose_config
    from relaytrain.run.train import run
    from relaytrain.utils.errors import ConfigError, first_line

    base = {"strategy": r.label, "blocks": r.blocks}
    try:
        if r.strategy == "deepspeed":
            return deepspeed_row(args, r)
        checkpoint = write_checkpoint(args, r.blocks, scratch / f"checkpoint-{r.blocks}") if r.pretrained else None
        with tempfile.TemporaryDirectory(dir=scratch) as run_dir:
            return row(args, r.label, r.blocks, run(compose_config(overrides(args, r, checkpoint)), run_dir, quiet=True))
    except torch.cuda.OutOfMemoryError:
        return {**base, "status": "out of memory"}
    except ConfigError as err:  # a refusal: the host cannot hold it, a key this torch lacks
        return {**base, "status": f"refused: {err}"}
    except Exception as err:  # one broken run must not cost the device call the other rows
        traceback.print_exc()
        return {**base, "status": f"failed: {type(err).__name__}: {first_line(err)}"}
    finally:
        release()


def deepspeed_row(args, r: Run) -> dict:
    """The Trainer + DeepSpeed ZeRO-3 offload contestant's row (a process of its own), its figures
    as a run's: model FLOP/s as 6 x parameters x tokens over the median step."""
    import importlib.util

    import deepspeed_contestant

    missing = [name for name in ("deepspeed", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        return {"strategy": r.label, "blocks": r.blocks, "status": f"not run: {', '.join(missing)} not installed "
                f"(make gpu-wheels GPU_WHEELS_ARGS=--with-deepspeed carries them)"}
    keys = [key for key in overrides(args, r) if not key.startswith(("strategy=", "train.untimed_steps"))]
    found = deepspeed_contestant.measure(keys, UNTIMED, cpu=args.cpu_smoke)
    tokens = args.seq_len * args.microbatch_size * args.microbatches
    return table_row(args, r.label, r.blocks, precision="fp32" if args.cpu_smoke else "bf16 (DeepSpeed)",
                     params=found["parameters"], step_s=found["step_s"],
                     flops=6 * found["parameters"] * tokens / found["step_s"], device_peak=found["device_peak_bytes"],
                     host_rss=found["host_peak_rss_bytes"], eps_kernel=found["optimizer"])


def against_deepspeed(rows: list[dict]) -> dict[int, float]:
    """L2L's samples/s over the DeepSpeed contestant's (its step time over L2L's), at each depth both ran."""
    steps = {(r["strategy"], r["blocks"]): r["step_s"] for r in rows if r.get("status") == "ok"}
    return {blocks: step / steps[("l2l", blocks)] for (name, blocks), step in steps.items()
            if name == DEEPSPEED and ("l2l", blocks) in steps}


def release() -> None:
    """Give back what the last run held before the next one measures its own peak: the device's
    cached blocks and, where this torch can, the pinned host blocks its caching allocator keeps."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def markdown(rows: list[dict]) -> str:
    lines = ["| strategy | blocks | params (B) | precision | step (s) | TFLOP/s | transfer wait | EPS exposed "
             "| device peak (GiB) | host RSS (GiB) | status |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['blocks']} | {fmt(r.get('params'), '.2f', 1e-9)} | {r.get('precision', '—')} "
            f"| {fmt(r.get('step_s'), '.3f')} | {fmt(r.get('useful_tflops'), '.1f')} "
            f"| {fmt(r.get('transfer_wait_share'), '.1%')} | {fmt(r.get('eps_exposed_share'), '.1%')} "
            f"| {fmt(r.get('device_peak_gib'), '.2f')} | {fmt(r.get('host_rss_gib'), '.1f')} | {r['status']} |")
    return "\n".join(lines)


def machine(args) -> dict:
    import transformers

    device = "cpu (smoke run)" if args.cpu_smoke else f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return {"device": device, "driver": driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cores": os.cpu_count(), "commit": args.commit, "date": time.strftime("%Y-%m-%d"),
            # Set from the rows at the end where they ran (`contests`); null, not a figure, otherwise.
            "l2l_vs_deepspeed_zero3_offload_14b": None, "fp8_vs_cmp_bf16": None}


def contests(args, rows: list[dict]) -> dict:
    """The record's ratios: L2L against the DeepSpeed contestant by depth, and at the deepest depth
    both ran as issue 59's `l2l_vs_deepspeed_zero3_offload_14b` where the shape is the 14 B one."""
    by_depth = against_deepspeed(rows)
    deepest = by_depth[max(by_depth)] if by_depth else None
    return {"l2l_vs_deepspeed_zero3_offload": by_depth,
            "l2l_vs_deepspeed_zero3_offload_14b": deepest if args.shape == "qwen2.5-14b" else None}


def driver() -> str | None:
    """The NVIDIA driver's version, where nvidia-smi answers."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip().splitlines()[0] if found.stdout.strip() else None


def flatness(rows: list[dict], strategy: str = "l2l") -> float | None:
    """`strategy`'s device peak at the deepest depth over the shallowest: 1.0 is flat in depth.
    With the stash on the device (l2l) it grows by each block's stashed inputs; with the stash on
    the host (l2l_stash_cpu) the L2L paper's claim is that it stays flat."""
    peaks = [(r["blocks"], r["device_peak_gib"]) for r in rows if r["strategy"] == strategy and r.get("device_peak_gib")]
    return max(peaks)[1] / min(peaks)[1] if len(peaks) > 1 else None


def flatnesses(rows: list[dict]) -> dict:
    return {name: flatness(rows, name) for name in ("l2l", "l2l_stash_cpu")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device visible to torch {torch.__version__} here; nothing run")
        return 0
    start, rows = time.monotonic(), []
    about = {**machine(args), "args": {k: str(v) for k, v in vars(args).items()}}
    scratch = Path(tempfile.mkdtemp(prefix="bench_gpu-"))  # the adapter rows' checkpoint, the runs' folders
    for r in runs(args):
        if time.monotonic() - start > args.budget_s:
            skipped = f"not run: past the {args.budget_s:.0f} s budget"
            rows.append({"strategy": r.label, "blocks": r.blocks, "status": skipped})
        else:
            rows.append(measure(args, r, scratch))
        done = rows[-1]
        print(f"bench_gpu: {r.label} x {r.blocks} blocks: {done['status']}, {fmt(done.get('useful_tflops'), '.1f')} TFLOP/s, "
              f"EPS exposed {fmt(done.get('eps_exposed_share'), '.1%')}, busy {fmt(done.get('eps_busy_share'), '.1%')}, "
              f"device peak {fmt(done.get('device_peak_gib'), '.2f')} GiB ({time.monotonic() - start:.0f} s)", flush=True)
        if args.out:  # after every run: a call cut short still brings back what was measured
            args.out.write_text(json.dumps({**about, **contests(args, rows), "elapsed_s": time.monotonic() - start,
                                            "device_peak_deepest_over_shallowest": flatnesses(rows), "rows": rows}, indent=2))
    shutil.rmtree(scratch, ignore_errors=True)
    ratios = flatnesses(rows)
    print(f"\n{markdown(rows)}\n")
    print(f"bench_gpu: {about['device']}, torch {about['torch']}, {time.monotonic() - start:.0f} s; "
          "device peak, deepest over shallowest: "
          + ", ".join(f"{name} {fmt(ratio, '.2f')}" for name, ratio in ratios.items())
          + "".join(f"; l2l / deepspeed zero3 offload at {blocks} blocks {ratio:.2f}"
                    for blocks, ratio in against_deepspeed(rows).items())
          + (f"; JSON in {args.out}" if args.out else ""))
    return 0

if __name__ == "__main__":
    sys.exit(main())
