"""The augmentation as PIL defines it: the executable statement of what preprocess.py must compute.

This is the platform's earlier pipeline, PIL throughout: every file decoded in full (``draft=False``,
as it began), or JPEGs decoded at a DCT reduction with PIL's draft mode (``draft=True``, the step before
OpenCV). It is not on any training path. It stays for two readers:

- tests/training/test_preprocess.py holds each fast operation to its PIL counterpart here (same random
  draws, same parameter ranges, pixels within a small tolerance);
- bench/preprocess.py measures the fast pipeline's images per second per vCPU against both forms, side
  by side in one run.

Both pipelines draw their random parameters in the same order from the same generator, so a sample made
by either from the same seed has the same crop, flip, jitter and heavy parameters.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from training.data_service.augmentation import AugmentConfig
from training.data_service.dataset import SampleSource, read_sample
from training.data_service.preprocess import (
    AUTOCONTRAST_CUTOFF,
    BLUR_RADIUS,
    JITTER_STRENGTH,
    ROTATION_DEGREES,
    SHARPNESS,
    plan_crop,
)


def load_and_augment_pil(path: SampleSource, rng: np.random.Generator, config: AugmentConfig, draft: bool = False) -> np.ndarray:
    """One sample, uint8 (3, size, size), the PIL way: decode (in full, or with ``draft`` at the
    reduction preprocess.draft_reduction picks), then each operation on a PIL image."""
    with Image.open(io.BytesIO(read_sample(path).tobytes())) as source:
        width, height = source.size
        box, reduction = plan_crop(width, height, rng, config.image_size, draft)
        if reduction > 1:
            source.draft("RGB", (math.ceil(width / reduction), math.ceil(height / reduction)))
        image = source.convert("RGB")
    scale_x, scale_y = image.width / width, image.height / height
    image = image.resize((config.image_size, config.image_size), Image.Resampling.BILINEAR,
                         box=(box[0] * scale_x, box[1] * scale_y, box[2] * scale_x, box[3] * scale_y),
                         reducing_gap=3.0 if draft else None)
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = colour_jitter_pil(image, rng, JITTER_STRENGTH)
    if config.augment == "heavy":
        image = image.rotate(float(rng.uniform(-ROTATION_DEGREES, ROTATION_DEGREES)), resample=Image.Resampling.BILINEAR)
        image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(*BLUR_RADIUS))))
        image = ImageEnhance.Sharpness(image).enhance(float(rng.uniform(*SHARPNESS)))
        image = ImageOps.autocontrast(image, cutoff=AUTOCONTRAST_CUTOFF)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def colour_jitter_pil(image: Image.Image, rng: np.random.Generator, strength: float) -> Image.Image:
    """Brightness, contrast and saturation, each by a factor in [1 - strength, 1 + strength], in random
    order."""
    enhancers = [ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color]
    for index in rng.permutation(len(enhancers)):
        image = enhancers[index](image).enhance(float(rng.uniform(1 - strength, 1 + strength)))
    return image
