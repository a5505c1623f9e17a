"""`make bench`: every benchmark, each in its own process (a clean allocator and thread pool),
then one summary table. Each script also runs alone; see docs/benchmarks.md.

    python scripts/bench.py [--only baseline,l2l,pipeline,l2l_scaling] [--out bench-results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "baseline": HERE / "bench_baseline.py",
    "l2l": HERE / "bench_l2l.py",
    "pipeline": HERE / "bench_pipeline.py",
    "l2l_scaling": HERE / "bench_l2l_scaling.py",
}
# Each script writes its own JSON; these pick out its headline ratios: (what, ratio, target).
HEADLINES = {
    "baseline": lambda r: [("baseline / plain PyTorch loop", r["ratio"], r["target"])],
    "l2l": lambda r: [("l2l / baseline with recompute", r["throughput_ratio"], 0.95)],
    "pipeline": lambda r: [
        ("pipe_flush / torch Schedule1F1B", r["flush_vs_torch_1f1b"]["ratio"], r["flush_vs_torch_1f1b"]["target"]),
        ("pipe_2bw / pipe_flush at m = d", r["2bw_vs_flush_at_m_eq_d"]["ratio"], r["2bw_vs_flush_at_m_eq_d"]["target"]),
    ],
    "l2l_scaling": lambda r: [("l2l, 2 replicas / (2 x one worker)", r["scaling_sharded"], r["target"])],
}


def run(name: str, script: Path, workdir: Path) -> dict:
    out = workdir / f"{name}.json"
    start = time.perf_counter()
    subprocess.run([sys.executable, str(script), "--json", str(out)], check=True)
    print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--out", help="write every result to this JSON file")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.only.split(","):
            results[name] = run(name, BENCHMARKS[name], Path(workdir))
    table = Table(title="relaytrain benchmarks (ratios from one run each)")
    for column in ("benchmark", "ratio", "target", "met"):
        table.add_column(column)
    for name, result in results.items():
        for what, ratio, target in HEADLINES[name](result):
            table.add_row(what, f"{ratio:.3f}", f">= {target}", "yes" if ratio >= target else "no")
    Console().print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
