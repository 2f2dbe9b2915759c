"""Channel scanning and the decode/augment code shared by data hosts and DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from training.data_service.dataset import EmptyChannelError, MissingChannelError, scan_image_folder
from training.data_service.preprocess import CorruptDatasetError, crop_box, draft_reduction, load_and_augment, make_batch
from training.local.images import write_dataset
from training.trainers.config import AugmentConfig


def test_image_folder_lists_classes_and_samples_in_a_stable_order(images: Path) -> None:
    folder = scan_image_folder(images, "train", "data_group")
    assert folder.classes == ("class_00", "class_01", "class_02", "class_03")
    assert len(folder) == 96
    assert folder.samples == tuple(sorted(folder.samples, key=lambda sample: (sample[1], sample[0])))


def test_missing_channel_says_which_group_needs_it(tmp_path: Path) -> None:
    with pytest.raises(MissingChannelError, match=r"assign it to instance group 'data_group'.*inputs.train.groups"):
        scan_image_folder(tmp_path / "absent", "train", "data_group")


def test_channel_without_images_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("not an image")
    with pytest.raises(EmptyChannelError, match="holds no images"):
        scan_image_folder(tmp_path, "train", "dnn_group")


@pytest.mark.parametrize("augment", ["standard", "heavy"])
def test_samples_are_uint8_chw_of_the_configured_size(images: Path, augment: str) -> None:
    sample = load_and_augment(str(next(images.glob("class_00/*.jpg"))), np.random.default_rng(0), AugmentConfig(48, augment))
    assert sample.dtype == np.uint8 and sample.shape == (3, 48, 48)
    assert sample.flags.c_contiguous and sample.std() > 0


def test_augmentation_is_random_but_reproducible(images: Path) -> None:
    path = str(next(images.glob("class_01/*.jpg")))
    config = AugmentConfig(32)
    first, again = (load_and_augment(path, np.random.default_rng(7), config) for _ in range(2))
    other = load_and_augment(path, np.random.default_rng(8), config)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_random_resized_crop_falls_back_to_a_centre_crop_for_extreme_images() -> None:
    assert crop_box(400, 2, np.random.default_rng(0)) == (199, 0, 201, 2)


def test_a_draft_decode_never_leaves_the_crop_smaller_than_the_output() -> None:
    """The reduction is the largest that keeps both sides of the crop ≥ the output; a crop smaller than
    the output is decoded in full (nothing is upscaled that a full decode would have kept sharper)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        width, height = (int(n) for n in rng.integers(16, 4000, size=2))
        box = crop_box(width, height, rng)
        size = int(rng.choice([32, 224, 384]))
        reduction = draft_reduction(box, size)
        crop_w, crop_h = box[2] - box[0], box[3] - box[1]
        if reduction > 1:
            assert min(crop_w, crop_h) / reduction >= size
        if reduction < 8 and min(crop_w, crop_h) / (reduction * 2) >= size:
            raise AssertionError(f"{box} for {size}: a larger reduction than {reduction} would do")
    assert draft_reduction((0, 0, 1600, 1200), 224) == 4 and draft_reduction((0, 0, 200, 300), 224) == 1


@pytest.mark.parametrize("augment", ["standard", "heavy"])
def test_a_draft_decode_draws_the_same_parameters_and_keeps_the_image(tmp_path: Path, augment: str) -> None:
    """Same random stream, same crop (chosen from the header); the output differs from a full decode only
    by the decoder's reduced resolution: close, not equal."""
    root = write_dataset(tmp_path, classes=1, per_class=3, size=1600)
    config = AugmentConfig(64, augment)
    for path in sorted(root.glob("class_00/*.jpg")):
        full_rng, draft_rng = np.random.default_rng(3), np.random.default_rng(3)
        full = load_and_augment(str(path), full_rng, config, draft=False)
        drafted = load_and_augment(str(path), draft_rng, config, draft=True)
        assert full_rng.random() == draft_rng.random()  # both consumed the same draws
        assert drafted.shape == full.shape == (3, 64, 64) and drafted.dtype == np.uint8
        assert np.abs(drafted.astype(int) - full.astype(int)).mean() < 12  # of 255


def test_corrupt_files_are_skipped_counted_and_replaced(tmp_path: Path) -> None:
    root = write_dataset(tmp_path, classes=2, per_class=4, size=40)
    broken = root / "class_00" / "00000.jpg"
    broken.write_bytes(b"\xff\xd8 this is not a jpeg")
    (root / "class_01" / "00000.jpg").write_bytes(broken.read_bytes()[:10])
    folder = scan_image_folder(root, "train", "g")
    images, labels, skipped = make_batch(folder.samples, [0, 4, 1, 2], spares=[5, 6, 7], config=AugmentConfig(16), seed=1)
    assert skipped == 2
    assert images.shape == (4, 3, 16, 16) and labels.dtype == np.int64
    # Candidates are taken in order: 0 and 4 are broken, so the batch is samples 1, 2 (class 0), spares 5, 6 (class 1).
    assert labels.tolist() == [0, 0, 1, 1]


def test_a_batch_that_cannot_be_filled_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    for index in range(3):
        (tmp_path / "a" / f"{index}.png").write_bytes(b"garbage")
    folder = scan_image_folder(tmp_path, "train", "g")
    with pytest.raises(CorruptDatasetError, match="3 of 3 files"):
        make_batch(folder.samples, [0, 1], spares=[2], config=AugmentConfig(16), seed=0)
