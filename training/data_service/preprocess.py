"""Decode and augment images into uint8 tensors: the CPU work a data host takes off the DNN host.

The same functions run in the data service's worker processes and, in a homogeneous job, in the
trainer's own DataLoader workers, so both configurations do identical work per sample. Output is
uint8 (channels, height, width): normalisation to float happens later on the trainer's device, which keeps
the bytes on the wire at one per pixel and channel.

Decoding is most of the cost for photos larger than the output (a 1600 px JPEG takes ~25 ms to decode
in full on one core here). The crop is chosen from the file's header first (its size is all the random
crop needs), then the JPEG is decoded at the largest DCT reduction (1/2, 1/4, 1/8: PIL's draft mode)
that still leaves the crop at least as large as the output, so nothing is upscaled that a full decode
would have kept sharper, and the random parameters are drawn exactly as before.

Only PIL and numpy are imported here (no torch): spawned worker processes start in a fraction of a second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from training.data_service.augmentation import AugmentConfig

# What PIL raises for a file that is not a decodable image (truncated, wrong format, garbage).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class CorruptDatasetError(RuntimeError):
    """So many files failed to decode that a batch could not be filled."""


# JPEG decoders scale by 1/1, 1/2, 1/4 or 1/8 while decoding (the DCT's own reductions).
DRAFT_REDUCTIONS = (8, 4, 2, 1)
REDUCING_GAP = 3.0


def load_and_augment(path: str, rng: np.random.Generator, config: AugmentConfig, draft: bool = True) -> np.ndarray:
    """One training sample: decode, augment, return uint8 (3, size, size). Raises a DECODE_ERRORS error
    for a file that is not a decodable image. ``draft=False`` decodes every file in full (the reference
    the benchmark compares against: bench/preprocess.py)."""
    with Image.open(path) as source:
        width, height = source.size  # from the header: nothing is decoded yet
        box = crop_box(width, height, rng)
        reduction = draft_reduction(box, config.image_size) if draft else 1
        if reduction > 1:  # a no-op for formats without DCT scaling (PNG, ...)
            source.draft("RGB", (math.ceil(width / reduction), math.ceil(height / reduction)))
        image = source.convert("RGB")
    # The crop box in the decoded image's pixels (the decoder rounds reduced sizes up).
    scale_x, scale_y = image.width / width, image.height / height
    left, top, right, bottom = box
    # reducing_gap: a large region is first shrunk by an integer factor (box averaging, cheap), leaving
    # bilinear at most 3× to go: PIL's own advice for results indistinguishable from a direct resize.
    image = image.resize((config.image_size, config.image_size), Image.Resampling.BILINEAR,
                         box=(left * scale_x, top * scale_y, right * scale_x, bottom * scale_y),
                         reducing_gap=REDUCING_GAP if draft else None)
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = colour_jitter(image, rng, strength=0.4)
    if config.augment == "heavy":
        image = image.rotate(float(rng.uniform(-15, 15)), resample=Image.Resampling.BILINEAR)
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.1, 1.5))))
        image = ImageEnhance.Sharpness(image).enhance(float(rng.uniform(0.5, 2.0)))
        image = ImageOps.autocontrast(image, cutoff=1)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Inception-style crop of a width × height image, as torchvision's RandomResizedCrop chooses it: ten
    tries at a random area and aspect ratio, then a centre crop. (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = int(rng.integers(0, width - crop_w + 1))
            top = int(rng.integers(0, height - crop_h + 1))
            return left, top, left + crop_w, top + crop_h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def draft_reduction(box: tuple[int, int, int, int], size: int) -> int:
    """The largest JPEG decode reduction that leaves the crop at least ``size`` on both sides (1 when the
    crop is smaller than the output already: a full decode is then the sharpest there is). Pure."""
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    return next(reduction for reduction in DRAFT_REDUCTIONS if reduction == 1 or min(crop_w, crop_h) / reduction >= size)


def colour_jitter(image: Image.Image, rng: np.random.Generator, strength: float) -> Image.Image:
    """Brightness, contrast and saturation, each by a factor in [1 - strength, 1 + strength], in random
    order."""
    enhancers = [ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color]
    for index in rng.permutation(len(enhancers)):
        image = enhancers[index](image).enhance(float(rng.uniform(1 - strength, 1 + strength)))
    return image


def make_batch(
    samples: Sequence[tuple[str, int]],
    indices: Sequence[int],
    spares: Sequence[int],
    config: AugmentConfig,
    seed: int | Sequence[int],
) -> tuple[np.ndarray, np.ndarray, int]:
    """A full batch of ``len(indices)`` samples. A file that fails to decode is skipped, counted and
    replaced by the next spare; CorruptDatasetError when the spares run out too.

    Returns (images uint8 [N, 3, S, S], labels int64 [N], skipped count).
    """
    rng = np.random.default_rng(seed)
    images = np.empty((len(indices), *config.sample_shape), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    candidates = iter(list(indices) + list(spares))
    skipped = 0
    for slot in range(len(indices)):
        for index in candidates:
            path, label = samples[index]
            try:
                images[slot] = load_and_augment(path, rng, config)
            except DECODE_ERRORS:
                skipped += 1
                continue
            labels[slot] = label
            break
        else:
            raise CorruptDatasetError(
                f"{skipped} of {len(indices) + len(spares)} files tried for one batch could not be decoded "
                f"as images (last: {path}); check the channel's contents"
            )
    return images, labels, skipped
