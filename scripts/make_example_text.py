"""Write a small text corpus and a labelled sentiment task as JSONL, for the README's
pretrain -> fine-tune -> evaluate walk-through (and its test).

    python scripts/make_example_text.py DIR [--seed 0]

DIR/corpus.jsonl   {"text": ...}                 unlabelled sentences, for masked-LM pretraining
DIR/train.jsonl    {"text": ..., "label": 0|1}   sentences with a sentiment (1 positive)
DIR/dev.jsonl      the same, held out

Each sentence mixes neutral words with a few words of its sentiment, so the task is
learnable, and a model pretrained on the corpus has seen every word before fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

POSITIVE = "good great fine lovely superb pleasant bright happy warm brilliant".split()
NEGATIVE = "bad awful poor dreadful bleak gloomy sad cold dull terrible".split()
NEUTRAL = ("the a this that movie film story plot actor scene music day city book song evening "
           "was is felt seemed looked sounded quite rather very really somewhat and but so then "
           "we they i you it during after before through with").split()


def sentence(rng: random.Random, label: int) -> str:
    words = rng.choices(NEUTRAL, k=rng.randint(6, 12)) + rng.choices(POSITIVE if label else NEGATIVE, k=rng.randint(2, 3))
    rng.shuffle(words)
    return " ".join(words)


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.directory.mkdir(parents=True, exist_ok=True)
    write(args.directory / "corpus.jsonl", [{"text": sentence(rng, rng.randint(0, 1))} for _ in range(2000)])
    for name, count in (("train", 800), ("dev", 201)):
        labels = [rng.randint(0, 1) for _ in range(count)]
        write(args.directory / f"{name}.jsonl", [{"text": sentence(rng, y), "label": y} for y in labels])
    print(f"wrote corpus.jsonl, train.jsonl and dev.jsonl in {args.directory}")


if __name__ == "__main__":
    main()
