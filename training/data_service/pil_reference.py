"""The augmentation as PIL defines it: the executable statement of what preprocess.py must compute.

This is the pipeline the platform shipped before it moved to OpenCV (PIL throughout, every file decoded
in full). It is not on any training path. It stays for two readers:

- tests/training/test_preprocess.py holds each fast operation to its PIL counterpart here (same random
  draws, same parameter ranges, pixels within a small tolerance);
- bench/preprocess.py measures the fast pipeline's images per second per vCPU against this one, side by
  side in one run.

Both pipelines draw their random parameters in the same order from the same generator, so a sample made
by either from the same seed has the same crop, flip, jitter and heavy parameters.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from training.data_service.augmentation import AugmentConfig
from training.data_service.preprocess import JITTER_STRENGTH, crop_box


def load_and_augment_pil(path: str, rng: np.random.Generator, config: AugmentConfig) -> np.ndarray:
    """One sample, uint8 (3, size, size), the PIL way: full decode, then each operation on a PIL image."""
    with Image.open(path) as source:
        image = source.convert("RGB")
    box = crop_box(image.width, image.height, rng)
    image = image.resize((config.image_size, config.image_size), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = colour_jitter_pil(image, rng, JITTER_STRENGTH)
    if config.augment == "heavy":
        image = image.rotate(float(rng.uniform(-15, 15)), resample=Image.Resampling.BILINEAR)
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.1, 1.5))))
        image = ImageEnhance.Sharpness(image).enhance(float(rng.uniform(0.5, 2.0)))
        image = ImageOps.autocontrast(image, cutoff=1)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def colour_jitter_pil(image: Image.Image, rng: np.random.Generator, strength: float) -> Image.Image:
    """Brightness, contrast and saturation, each by a factor in [1 - strength, 1 + strength], in random
    order."""
    enhancers = [ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color]
    for index in rng.permutation(len(enhancers)):
        image = enhancers[index](image).enhance(float(rng.uniform(1 - strength, 1 + strength)))
    return image
