"""What every benchmark script reports for a comparison: the median of its rounds' ratios
(the headline: robust to one lucky or unlucky round), the best round and the spread; and how
busy other processes kept the machine meanwhile."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

# The decoder of the decoder comparisons (bench_hf_trainer.py against Trainer, bench_l2l.py
# against the recompute baseline), as relaytrain overrides: one definition, so both measure the
# same model. Llama layout, grouped-query attention (8 query heads share 2 key/value heads), SwiGLU.
DECODER = ["model=llama_tiny", "model.num_layers=8", "model.hidden_size=512", "model.num_heads=8",
           "model.num_kv_heads=2", "model.intermediate_size=1376", "model.vocab_size=8192", "model.dropout=0.0"]


def alternating_rounds(contestants, rounds: int, one_run) -> list[dict]:
    """`rounds` rounds of `one_run(name)` for every contestant, the order reversed every other
    round: a machine warming up (or cooling down) favours neither."""
    names = list(contestants)
    return [{name: one_run(name) for name in (names if r % 2 == 0 else names[::-1])} for r in range(rounds)]


def contest_args(doc: str, child: tuple[str, ...], steps: int, untimed: str,
                 comparisons: tuple[str, ...] = (), rounds: int = 3, extra=()) -> argparse.Namespace:
    """The command line of a benchmark of two contestants in rounds: --rounds, --steps (`untimed`
    says which of them the figures leave out), --json, and the hidden --child CHILD... RUN_DIR
    by which the script runs one contestant in a process of its own (`child_run`). A script of
    several `comparisons` (their headlines' names) gets --only NAME,... too, checked against them;
    `extra`: a script's own options, as (flag, argparse keywords) pairs."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps, help=f"steps per run; {untimed} untimed")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=len(child) + 1, metavar=(*child, "RUN_DIR"), help=argparse.SUPPRESS)
    for flag, keywords in extra:
        p.add_argument(flag, **keywords)
    if comparisons:
        p.add_argument("--only", default=",".join(comparisons), help="the comparisons to run, comma-separated")
    args = p.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(comparisons)) if comparisons else []
    if unknown:
        p.error(f"--only: no comparison {', '.join(unknown)}; choose from {', '.join(comparisons)}")
    return args


def llama_checkpoint(directory: Path, sizes: dict) -> Path:
    """A random float32 checkpoint of the Llama layout of `sizes`, written by save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes)).save_pretrained(directory)
    return directory


def chat_llama_checkpoint(directory: Path, sizes: dict) -> Path:
    """A random float32 checkpoint of the Llama layout of `sizes` with the tests' byte-level BPE
    tokenizer and its chat template (the special ids its config names are the tokenizer's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.checkpoints import chat_tokenizer

    torch.manual_seed(0)
    tokenizer = chat_tokenizer()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", **sizes, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def step_timer():
    """A Trainer callback that keeps each optimizer step's wall time (`.times`), for the scripts
    that time Hugging Face's or TRL's trainers."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def child_run(script: str, steps: int, child_args: list[str], workdir: Path, name: str) -> dict:
    """One run of `script` in a process of its own (a clean allocator and thread pool), as
    `script --steps STEPS --child *CHILD_ARGS RUN_DIR`, in a new directory of `workdir` named
    after `name`: the figures it wrote to RUN_DIR/bench.json."""
    run_dir = Path(workdir) / f"{name}-{len(list(Path(workdir).iterdir()))}"
    subprocess.run([sys.executable, script, "--steps", str(steps), "--child", *child_args, str(run_dir)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "bench.json").read_text())


def headline_line(name: str, h: dict) -> str:
    """One headline as the scripts print it: its median and every round's figure."""
    return f"{name}: median {h['median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in h['rounds'])})"


def report(results: dict, json_path: str | None) -> None:
    """A script's end: each headline's line, the other load it ran beside, and `results` written
    to `json_path` where given (`--json`)."""
    for name, h in results["headlines"].items():
        print(headline_line(name, h))
    print(f"  other processes kept {results['other_load_cores']:.2f} cores busy")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")


def headline(per_round: list[float], target: float, lower_is_better: bool = False) -> dict:
    """`per_round`: the comparison's figure in each round (both contestants measured in it).

    `target`: met when the median is at least it, or, `lower_is_better`, below it.
    """
    best = min(per_round) if lower_is_better else max(per_round)
    median = statistics.median(per_round)
    return {
        "median": median,
        "best": best,
        "spread": [min(per_round), max(per_round)],
        "rounds": per_round,
        "target": target,
        "lower_is_better": lower_is_better,
        "met": median < target if lower_is_better else median >= target,
    }


class OtherLoad:
    """Cores other processes kept busy during a block: the machine's busy CPU seconds less this
    process's and its finished children's (the run's workers), over the wall seconds."""

    def __enter__(self) -> OtherLoad:
        self.start, self.busy, self.mine = time.monotonic(), _machine_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        others = (_machine_busy_s() - self.busy) - (_own_cpu_s() - self.mine)
        self.cores = max(0.0, others / (time.monotonic() - self.start))


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _own_cpu_s() -> float:
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in own)


@contextmanager
def contest_dirs() -> Iterator[tuple[Path, Path, OtherLoad]]:
    """A contest's scratch folder (its checkpoints and inputs), the `runs` folder in it that
    `child_run` puts each run's folder in, and the other processes' load measured meanwhile."""
    with tempfile.TemporaryDirectory() as tmp, OtherLoad() as load:
        workdir = Path(tmp)
        runs = workdir / "runs"
        runs.mkdir()
        yield workdir, runs, load
