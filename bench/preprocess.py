"""Images per second per vCPU of the data pipeline: the PIL pipeline against the fast one, side by side.

    python bench/preprocess.py [--rounds 3] [--images 24] [--size 224]

One process, one core (what one data-host vCPU does), ``--size``² output, ``standard`` and ``heavy``
augmentation, from JPEGs of 320, 500, 1600 and 3000 px (written here as photos are: 4:3, quality 90,
≈0.38 bytes per pixel). Each round times, back to back on the same files and the same random streams:

- PIL full: the platform's first pipeline (training/data_service/pil_reference.py: every file decoded
  in full, every operation in PIL);
- PIL draft: the same with JPEGs decoded at a DCT reduction by PIL's draft mode (its second);
- fast: training/data_service/preprocess.py (crop chosen from the header, reduced libjpeg-turbo decode,
  OpenCV operations on uint8 arrays).

The machine is shared and noisy, so each round's ratio is taken and the median reported. The last
columns show that both make the same sample: every file's random draws are the same in both (the
generators end in the same state), the mean pixel difference between their outputs, and the crop
statistics the draws give.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.data_service.augmentation import AugmentConfig  # noqa: E402
from training.data_service.pil_reference import load_and_augment_pil  # noqa: E402
from training.data_service.preprocess import crop_box, load_and_augment  # noqa: E402

SOURCES = (320, 500, 1600, 3000)
Pipeline = Callable[[str, np.random.Generator, AugmentConfig], np.ndarray]


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


def images_per_s(paths: list[str], config: AugmentConfig, pipeline: Pipeline, seed: int) -> float:
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for path in paths:
        pipeline(path, rng, config)
    return len(paths) / (time.perf_counter() - started)


def agreement(paths: list[str], config: AugmentConfig) -> tuple[int, float]:
    """How many files drew the same parameters in the fast and the PIL (full decode) pipelines, and the
    mean |difference| of the two outputs (of 255)."""
    same, differences = 0, []
    for index, path in enumerate(paths):
        fast_rng, pil_rng = np.random.default_rng(index), np.random.default_rng(index)
        fast, pil = load_and_augment(path, fast_rng, config), load_and_augment_pil(path, pil_rng, config)
        same += fast_rng.bit_generator.state == pil_rng.bit_generator.state
        differences.append(float(np.abs(fast.astype(np.int16) - pil.astype(np.int16)).mean()))
    return same, statistics.mean(differences)


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
    print("| augment | source px | PIL full img/s | PIL draft img/s | fast img/s | fast / PIL full | fast / PIL draft "
          "| same draws | mean abs diff (of 255) | mean crop area | mean aspect |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pipelines = {"full": load_and_augment_pil, "draft": functools.partial(load_and_augment_pil, draft=True), "fast": load_and_augment}
    for augment in ("standard", "heavy"):
        config = AugmentConfig(args.size, augment)
        for side in SOURCES:
            rates: dict[str, list[float]] = {name: [] for name in pipelines}
            for round_ in range(args.rounds):
                for name, pipeline in pipelines.items():
                    rates[name].append(images_per_s(photos[side], config, pipeline, seed=round_))
            over_full = statistics.median(f / p for f, p in zip(rates["fast"], rates["full"], strict=True))
            over_draft = statistics.median(f / p for f, p in zip(rates["fast"], rates["draft"], strict=True))
            same, difference = agreement(photos[side], config)
            area, aspect = crop_stats(side)
            print(f"| {augment} | {side} | {statistics.median(rates['full']):.0f} | {statistics.median(rates['draft']):.0f} | "
                  f"{statistics.median(rates['fast']):.0f} | {over_full:.2f}× | {over_draft:.2f}× | "
                  f"{same}/{len(photos[side])} | {difference:.2f} | {area:.3f} | {aspect:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
