"""The tokenize cache: how long a second identical start takes to prepare its data, against the first.

A ShareGPT parquet file of chat records (100 k by default; made here from a seed, replies and
prompts of varied length, a system turn in every fourth) and a ChatML tokenizer saved beside it
(`data.tokenizer`) are prepared for a Llama-layout model, `data.seq_len=256`, twice per round,
each time in a process of its own as two starts of `relaytrain train` would: the first with an
empty cache directory (a miss: read, render, tokenize, store), the second with the same one (a
hit: fingerprint the file, read the entry). Each reports results.json's `prepare_s`, the time
`data.build_datasets` took. Headline:

- `data_cache_prepare_ratio`: prepare_s of the second start / the first, median over rounds
  (target <= 0.05).

    .venv/bin/python scripts/bench_data_cache.py --json bench_data_cache.json [--rounds 3] [--records 100000]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import OtherLoad, headline

WORDS = ("the a model learns tokens from data while every reply counts and prompts do not matter here so "
         "write short clear answers about numbers colours cities rivers planets and small programs").split()
SEQ_LEN = 256
VOCAB = 2048


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=3, metavar=("DATA", "TOKENIZER", "CACHE_DIR"), help=argparse.SUPPRESS)
    return p.parse_args()


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def make_data(directory: Path, records: int) -> tuple[Path, Path]:
    """The ShareGPT parquet file and the tokenizer directory."""
    import datasets

    from relaytrain.data.tokenizer import train_tokenizer

    rng = random.Random(0)
    rows = []
    for i in range(records):
        turns = [{"from": "system", "value": text(rng, 4, 12)}] if i % 4 == 0 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": text(rng, 5, 40)}, {"from": "gpt", "value": text(rng, 5, 60)}]
        rows.append({"conversations": turns})
    data = directory / "sharegpt.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    corpus = (turn["value"] for row in rows[:2000] for turn in row["conversations"])
    tokenizer = train_tokenizer(corpus, "byte_bpe", VOCAB, SEQ_LEN, chat=True)
    tokenizer.save_pretrained(str(directory / "tokenizer"))
    return data, directory / "tokenizer"


def child(data: str, tokenizer: str, cache_dir: str) -> None:
    """One start's preparation in this process: what results.json's `data` would say."""
    from relaytrain.data import build_datasets
    from relaytrain.run.compose import compose_config

    cfg = compose_config(["model=llama_tiny", f"model.vocab_size={VOCAB}", f"model.max_seq_len={SEQ_LEN}", "data=chat",
                          f"data.path={data}", f"data.tokenizer={tokenizer}", f"data.seq_len={SEQ_LEN}",
                          f"data.cache_dir={cache_dir}"])
    train, _ = build_datasets(cfg)
    print(json.dumps(train.facts))


def one_start(data: Path, tokenizer: Path, cache_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(data), str(tokenizer), str(cache_dir)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp, OtherLoad() as load:
        workdir = Path(tmp)
        data, tokenizer = make_data(workdir, args.records)
        rounds = []
        for r in range(args.rounds):
            cache_dir = workdir / f"cache-{r}"  # empty: the first start of the round misses
            first, second = one_start(data, tokenizer, cache_dir), one_start(data, tokenizer, cache_dir)
            assert (first["cache"], second["cache"]) == ("miss", "hit"), (first["cache"], second["cache"])
            rounds.append({"first": first, "second": second})
    ratios = [r["second"]["prepare_s"] / r["first"]["prepare_s"] for r in rounds]
    results = {
        "command": f"python scripts/bench_data_cache.py --rounds {args.rounds} --records {args.records}",
        "records": args.records, "seq_len": SEQ_LEN, "rounds": rounds, "other_load_cores": load.cores,
        "headlines": {"data_cache_prepare_ratio": headline(ratios, 0.05, lower_is_better=True)},
    }
    h = results["headlines"]["data_cache_prepare_ratio"]
    print(f"data_cache_prepare_ratio: median {h['median']:.4f} (rounds {', '.join(f'{x:.4f}' for x in ratios)})")
    for r in rounds:
        print(f"  miss {r['first']['prepare_s']:.1f} s, hit {r['second']['prepare_s']:.2f} s "
              f"({r['first']['records']} records, {r['first']['tokens']} tokens)")
    print(f"  other processes kept {load.cores:.2f} cores busy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
