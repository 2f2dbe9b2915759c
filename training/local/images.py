"""Writes a small ImageFolder dataset of real JPEG files for the demo, the benchmarks and the tests.

Each class has its own hue and stripe orientation under random noise, so a model can learn the classes
and the decoder does real work (JPEG at the given resolution, not a 1-pixel stand-in).

    python -m training.local.images OUT_DIR [--classes 4] [--per-class 64] [--size 160]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def write_dataset(root: Path, classes: int = 4, per_class: int = 64, size: int = 160, seed: int = 0) -> Path:
    """Create (or reuse, when already complete) ``root/<class>/<n>.jpg``; return root."""
    rng = np.random.default_rng(seed)
    for label in range(classes):
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            path = folder / f"{index:05d}.jpg"
            if path.exists():
                continue
            Image.fromarray(class_image(label, classes, size, rng)).save(path, quality=90)
    return root


def class_image(label: int, classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    hue = np.array([np.cos(2 * np.pi * label / classes), np.sin(2 * np.pi * label / classes), 0.5]) * 80 + 120
    angle = np.pi * label / classes
    y, x = np.mgrid[0:size, 0:size]
    stripes = np.sin((x * np.cos(angle) + y * np.sin(angle)) * 0.25 + rng.uniform(0, 2 * np.pi))
    image = hue[None, None, :] + 50 * stripes[..., None] + rng.normal(0, 25, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=64)
    parser.add_argument("--size", type=int, default=160)
    args = parser.parse_args()
    root = write_dataset(args.out_dir, args.classes, args.per_class, args.size)
    print(f"wrote {args.classes * args.per_class} JPEG files under {root}")


if __name__ == "__main__":
    main()
