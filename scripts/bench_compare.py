"""`make bench-compare BASE=<commit> [ONLY=data_parallel,axonn] [ROUNDS=2]`: the same benchmarks
from two versions of relaytrain on this machine, alternating, and each headline's ratio HEAD/BASE.

    python scripts/bench_compare.py --base 2788acc [--only data_parallel,axonn] [--rounds 2] [--out cmp.json]

BASE is checked out in a temporary git worktree; HEAD is this checkout as it stands, uncommitted
changes included (so a change can be measured before it is committed). Each side is built into a
directory of its own (`pip install --no-deps --target`: a wheel, configs included) and run with
that directory first on PYTHONPATH, with its own `scripts/bench.py` and benchmark scripts, so each
side measures itself with its own code. Rounds alternate the order (BASE first, then HEAD first,
...) so that a drift of the machine's speed during the comparison falls on both sides alike.

Every headline of `scripts/bench.py` (the median over a script's own rounds) is read from each
side's JSON; the ratio HEAD/BASE is taken within a round and reported as the median over rounds
with its spread. For a figure where lower is better (`offload_exposed_*`, the planner's error),
a ratio under 1 is the better one; the `better` column says which way each one went. Benchmarks
are honest only on an idle machine: run this when nothing else is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
# Differences smaller than this share are within what rounds of the same commit vary by here.
NOISE = 0.03


def git(*args: str, cwd: Path = CHECKOUT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def build(source: Path, target: Path) -> None:
    """relaytrain from `source` (a checkout) as a plain install in `target`, importable from there."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                    "--target", str(target), str(source)], check=True)


def run_side(tree: Path, site: Path, only: str, out: Path) -> dict:
    """One round of `tree`'s scripts/bench.py, importing relaytrain from `site`: its headlines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(tree / "scripts" / "bench.py"), "--only", only, "--out", str(out)],
                   cwd=tree, env=env, check=True)
    return figures(json.loads(out.read_text()))


def figures(results: dict) -> dict[str, tuple[float, bool]]:
    """Each headline's median, and whether lower is better; the single figures (l2l scaling, the
    planner's worst error) too, where a script reports them."""
    found = {key: (h["median"], bool(h.get("lower_is_better"))) for key, h in results.get("headlines", {}).items()}
    if "scaling_sharded" in results.get("l2l_scaling", {}):
        found.setdefault("l2l_replicas_scaling", (results["l2l_scaling"]["scaling_sharded"], False))
    if "worst_error" in results.get("planner", {}):
        found.setdefault("plan_worst_error", (results["planner"]["worst_error"], True))
    return found


def available(tree: Path) -> set[str]:
    """The benchmark names a side's scripts/bench.py knows (its BENCHMARKS)."""
    code = "import runpy, sys; print(','.join(runpy.run_path(sys.argv[1])['BENCHMARKS']))"
    listed = subprocess.run([sys.executable, "-c", code, str(tree / "scripts" / "bench.py")], check=True,
                            capture_output=True, text=True).stdout.strip()
    return set(listed.split(","))


def compare(rounds: list[dict[str, dict]]) -> list[dict]:
    """Per headline both sides reported: the median of each side over rounds and the ratio
    HEAD/BASE taken within each round (median, spread)."""
    keys = sorted(set.intersection(*(set(r["base"]) & set(r["head"]) for r in rounds)))
    rows = []
    for key in keys:
        ratios = [r["head"][key][0] / r["base"][key][0] for r in rounds if r["base"][key][0]]
        lower = rounds[0]["head"][key][1]
        ratio = statistics.median(ratios) if ratios else float("nan")
        better = "same" if abs(ratio - 1) <= NOISE else ("head" if (ratio < 1) == lower else "base")
        rows.append({"headline": key, "base": statistics.median(r["base"][key][0] for r in rounds),
                     "head": statistics.median(r["head"][key][0] for r in rounds), "ratio": ratio,
                     "spread": [min(ratios), max(ratios)] if ratios else None, "lower_is_better": lower,
                     "better": better})
    return rows


def table(rows: list[dict], base: str) -> Table:
    out = Table(title=f"HEAD / {base}: each headline's ratio within a round, median over rounds")
    for column in ("headline", "base", "head", "ratio", "spread", "better"):
        out.add_column(column)
    for r in rows:
        spread = "-" if r["spread"] is None else f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f}"
        arrow = " (lower is better)" if r["lower_is_better"] else ""
        out.add_row(r["headline"] + arrow, f"{r['base']:.4g}", f"{r['head']:.4g}", f"{r['ratio']:.3f}", spread,
                    r["better"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--only", default="", help="benchmarks of scripts/bench.py, comma-separated (default: all "
                        "that both sides have)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating the order")
    parser.add_argument("--out", help="write the rounds and the comparison to this JSON file")
    args = parser.parse_args()
    base = git("rev-parse", "--short", args.base)
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as work:
        work = Path(work)
        tree = work / "base"
        git("worktree", "add", "--detach", str(tree), base)
        try:
            rows, rounds = measure(tree, work, args)
        finally:
            git("worktree", "remove", "--force", str(tree))
    Console().print(table(rows, base))
    if args.out:
        Path(args.out).write_text(json.dumps({"base": base, "rounds": rounds, "comparison": rows}, indent=2) + "\n")


def measure(base_tree: Path, work: Path, args) -> tuple[list[dict], list[dict]]:
    sides = {"base": base_tree, "head": CHECKOUT}
    common = available(base_tree) & available(CHECKOUT)
    wanted = [name for name in args.only.split(",") if name] or sorted(common)
    missing = [name for name in wanted if name not in common]
    if missing:
        sys.exit(f"bench-compare: {', '.join(missing)} is not a benchmark of both sides; both have {', '.join(sorted(common))}")
    for side, tree in sides.items():
        print(f"[building {side} from {tree}]", flush=True)
        build(tree, work / f"site-{side}")
    rounds = []
    for number in range(args.rounds):
        order = ["base", "head"] if number % 2 == 0 else ["head", "base"]
        found = {}
        for side in order:
            print(f"[round {number + 1}/{args.rounds}: {side}]", flush=True)
            found[side] = run_side(sides[side], work / f"site-{side}", ",".join(wanted),
                                   work / f"{side}-{number}.json")
        rounds.append(found)
    return compare(rounds), rounds


if __name__ == "__main__":
    main()
