"""training/data_service/tf_pipeline.py: the augmentation graph the data hosts register with
tf.data.service and homogeneous trainers run themselves, on real JPEG files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from training.data_service.dataset import scan_images
from training.data_service.tf_pipeline import (
    augmentation_pipeline,
    autocontrast,
    element_spec,
    relative_samples,
    rotate,
)
from training.trainers.config import AugmentConfig


@pytest.mark.parametrize("augment", ["standard", "heavy"])
def test_batches_are_uint8_crops_of_the_configured_size_with_their_labels(images: Path, augment: str) -> None:
    folder = scan_images(images, "train", "data")
    paths, labels = relative_samples(folder)
    assert not any(os.path.isabs(path) for path in paths) and len(paths) == len(folder)
    cwd = os.getcwd()
    os.chdir(images)  # the data host runs the pipeline in its channel folder
    try:
        dataset = augmentation_pipeline(paths, labels, batch_size=8, augment=AugmentConfig(48, augment), seed=1)
        batches = list(dataset.take(3))
    finally:
        os.chdir(cwd)
    assert dataset.element_spec == element_spec(8, 48)
    for batch_images, batch_labels in batches:
        assert batch_images.shape == (8, 48, 48, 3) and batch_images.dtype == tf.uint8
        assert set(batch_labels.numpy()) <= set(range(len(folder.classes)))
        assert batch_images.numpy().std() > 5  # real picture content, not a constant fill


def test_corrupt_files_are_skipped_and_the_batch_is_still_full(tmp_path: Path, images: Path) -> None:
    folder = scan_images(images, "train", "data")
    good = [path for path, _ in folder.samples][:6]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    dataset = augmentation_pipeline([str(broken), *good], [0] * 7, batch_size=4, augment=AugmentConfig(32), seed=0)
    batch_images, _ = next(iter(dataset))
    assert batch_images.shape == (4, 32, 32, 3)


def test_the_same_seed_gives_the_same_order_and_augmentation() -> None:
    tf.random.set_seed(3)
    image = tf.cast(tf.reshape(tf.range(16 * 16 * 3) % 256, (16, 16, 3)), tf.float32)
    assert np.allclose(rotate(image, tf.constant(0.0)).numpy(), image.numpy(), atol=1e-3)  # no rotation: unchanged
    rotated = rotate(image, tf.constant(np.pi))  # half a turn: the image upside down and mirrored
    assert np.allclose(rotated.numpy(), image.numpy()[::-1, ::-1], atol=1e-2)
    flat = tf.fill((4, 4, 3), 7.0)
    assert np.array_equal(autocontrast(flat).numpy(), flat.numpy())  # a flat channel is left alone
    stretched = autocontrast(tf.constant([[[10.0], [20.0]]]))
    assert np.allclose(stretched.numpy().ravel(), [0.0, 255.0])


def test_a_jpeg_crop_decodes_only_its_window_and_equals_the_full_decode_cropped(tmp_path: Path) -> None:
    """decode_and_crop_jpeg of the window the header gave is the pixels of the whole file decoded and
    sliced (to the chroma upsampling at the window's edges); a PNG takes the full decode; both come out
    size × size float32."""
    from PIL import Image

    from training.data_service.tf_pipeline import decode_random_crop

    rng = np.random.default_rng(0)
    pixels = np.clip(rng.normal(128, 40, size=(300, 400, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.jpg", quality=90)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    jpeg = tf.io.read_file(str(tmp_path / "a.jpg"))
    assert tf.io.extract_jpeg_shape(jpeg).numpy().tolist() == [300, 400, 3]
    window = tf.constant([30, 50, 120, 200])
    whole = tf.io.decode_jpeg(jpeg, channels=3)
    cropped = tf.image.decode_and_crop_jpeg(jpeg, window, channels=3).numpy().astype(int)
    difference = np.abs(cropped - whole[30:150, 50:250].numpy().astype(int))
    assert cropped.shape == (120, 200, 3) and difference.mean() < 0.5 and np.median(difference) == 0
    for name in ("a.jpg", "a.png"):
        crop = decode_random_crop(tf.io.read_file(str(tmp_path / name)), 64)
        assert crop.shape == (64, 64, 3) and crop.dtype == tf.float32 and float(tf.math.reduce_std(crop)) > 5
