"""`make bench`: every benchmark, each in its own process (a clean allocator and thread pool),
then one summary table. Each script also runs alone; see docs/benchmarks.md.

    python scripts/bench.py [--only baseline,l2l,pipeline] [--out bench-results.json]
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
}


def run(name: str, script: Path, workdir: Path) -> list[dict]:
    out = workdir / f"{name}.json"
    start = time.perf_counter()
    subprocess.run([sys.executable, str(script), "--json", str(out)], check=True)
    print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
    result = json.loads(out.read_text())
    return result if isinstance(result, list) else [result]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--out", help="write every result to this JSON file")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.only.split(","):
            results += run(name, BENCHMARKS[name], Path(workdir))
    table = Table(title="relaytrain benchmarks (ratios from one run each)")
    for column in ("benchmark", "ratio", "target"):
        table.add_column(column)
    for r in results:
        ratio = r.get("ratio")
        table.add_row(r.get("benchmark", "?"), "-" if ratio is None else f"{ratio:.3f}", str(r.get("target", "-")))
    Console().print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
