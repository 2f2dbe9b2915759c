"""Writes a small learnable review dataset for the text example: train/ and validation/ JSONL files whose
label follows from the words (positive and negative words among neutral ones).

    python examples/workloads/text_classifier/make_data.py OUT_DIR [--train 512] [--validation 128]
"""

import argparse
import json
import random
from pathlib import Path

POSITIVE = "good great excellent lovely superb enjoyable delightful wonderful".split()
NEGATIVE = "bad awful terrible boring dreadful poor dull horrible".split()
NEUTRAL = "the a film plot actor scene story it was and with of this that music ending".split()


def review(rng: random.Random, label: int) -> str:
    words = [rng.choice(NEUTRAL) for _ in range(rng.randint(6, 14))]
    for _ in range(rng.randint(1, 3)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
    return " ".join(words)


def write(out: Path, train: int = 512, validation: int = 128, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for split, count in (("train", train), ("validation", validation)):
        (out / split).mkdir(parents=True, exist_ok=True)
        with open(out / split / "reviews.jsonl", "w") as handle:
            for index in range(count):
                label = index % 2
                handle.write(json.dumps({"text": review(rng, label), "label": label}) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--validation", type=int, default=128)
    args = parser.parse_args()
    print(write(args.out, args.train, args.validation))
