"""Images per second per vCPU of the data pipeline: a full decode against a draft decode, side by side.

    python bench/preprocess.py [--rounds 3] [--images 24] [--size 224]

One process, one core (what one data-host vCPU does): ``load_and_augment`` at ``--size``² output, for
``standard`` and ``heavy`` augmentation, from JPEGs of 320, 500, 1600 and 3000 px (written here, as
photos are: 4:3, quality 90). Each round times the full decode and the draft decode (training/data_service/
preprocess.py) back to back on the same files and random streams; the machine is shared and noisy, so
the ratio of each round is taken and the median reported. Both draw the same augmentation parameters
(the crop is chosen from the header): the table's last columns show the crop statistics of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.data_service.augmentation import AugmentConfig  # noqa: E402
from training.data_service.preprocess import crop_box, load_and_augment  # noqa: E402

SOURCES = (320, 500, 1600, 3000)


def write_photos(folder: Path, side: int, count: int, seed: int) -> list[str]:
    """``count`` 4:3 JPEGs ``side`` px wide: smooth gradients with noise, which compress like photos."""
    rng = np.random.default_rng(seed)
    height = side * 3 // 4
    y, x = np.mgrid[0:height, 0:side].astype(np.float32)
    paths = []
    for index in range(count):
        phase = rng.uniform(0, 6.28, size=3)
        channels = [127 + 100 * np.sin(x / rng.uniform(20, 200) + y / rng.uniform(20, 200) + p) for p in phase]
        pixels = np.stack(channels, axis=-1) + rng.normal(0, 12, size=(height, side, 3))
        path = folder / f"{side}-{index}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)
        paths.append(str(path))
    return paths


def images_per_s(paths: list[str], config: AugmentConfig, draft: bool, seed: int) -> float:
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for path in paths:
        load_and_augment(path, rng, config, draft=draft)
    return len(paths) / (time.perf_counter() - started)


def crop_stats(side: int, draws: int = 20000) -> tuple[float, float]:
    """Mean crop area fraction and aspect ratio the random crop draws for this source size."""
    rng = np.random.default_rng(0)
    height = side * 3 // 4
    boxes = [crop_box(side, height, rng) for _ in range(draws)]
    areas = [(r - left) * (b - t) / (side * height) for left, t, r, b in boxes]
    aspects = [(r - left) / (b - t) for left, t, r, b in boxes]
    return float(np.mean(areas)), float(np.mean(aspects))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=24, help="files per source size")
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="preprocess-"))
    photos = {side: write_photos(folder, side, args.images, seed=side) for side in SOURCES}
    print(f"one core, {args.size}² output, {args.images} JPEGs per source size, {args.rounds} rounds (median of per-round ratios)\n")
    print("| augment | source px | full decode img/s | draft decode img/s | speed-up | mean crop area (both) | mean aspect (both) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for augment in ("standard", "heavy"):
        config = AugmentConfig(args.size, augment)
        for side in SOURCES:
            full, drafted = [], []
            for round_ in range(args.rounds):
                full.append(images_per_s(photos[side], config, draft=False, seed=round_))
                drafted.append(images_per_s(photos[side], config, draft=True, seed=round_))
            ratio = statistics.median(d / f for d, f in zip(drafted, full, strict=True))
            area, aspect = crop_stats(side)
            print(f"| {augment} | {side} | {statistics.median(full):.0f} | {statistics.median(drafted):.0f} | {ratio:.2f}× | "
                  f"{area:.3f} | {aspect:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
