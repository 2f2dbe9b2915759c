"""What the data pipeline's augmentation takes: the output size and the recipe. Standard library only,
beside the augmentation itself (preprocess.py for PyTorch, tf_pipeline.py for TensorFlow), so that the
data service depends on nothing above it, and the trainers' settings (training/trainers/config.py), the
platform's spec validation and the Lambdas can import it without PIL or TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass

AUGMENTATIONS = ("standard", "heavy")


@dataclass(frozen=True)
class AugmentConfig:
    image_size: int
    # "standard": random resized crop, flip, colour jitter (ImageNet training recipe).
    # "heavy": standard plus rotation, blur, sharpness and autocontrast (a preprocessing-bound pipeline).
    augment: str = "standard"

    def __post_init__(self) -> None:
        if self.augment not in AUGMENTATIONS:
            raise ValueError(f"augment must be one of {AUGMENTATIONS}, got {self.augment!r}")
        if not 8 <= self.image_size <= 1024:
            raise ValueError(f"image_size must be in 8..1024, got {self.image_size}")

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)
