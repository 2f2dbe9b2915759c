"""Channel scanning and the decode/augment code shared by data hosts and DataLoader workers.

The fast pipeline (training/data_service/preprocess.py: OpenCV on uint8 arrays) is held to the PIL
definition of each operation (training/data_service/pil_reference.py): the same random draws, pixels
within a small tolerance."""

from __future__ import annotations

import io
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from training.data_service import preprocess
from training.data_service.augmentation import AugmentConfig
from training.data_service.dataset import EmptyChannelError, MissingChannelError, scan_images
from training.data_service.pil_reference import load_and_augment_pil
from training.data_service.preprocess import DECODE_ERRORS, crop_box, draft_reduction, jpeg_size, load_and_augment
from training.local.images import write_dataset
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.contract import Workload, load_workload, resolve_hyperparameters
from training.workload.samples import AllSkippedError, BatchRecipe, FeatureSpec, make_batch


def test_image_folder_lists_classes_and_samples_in_a_stable_order(images: Path) -> None:
    folder = scan_images(images, "train", "data_group")
    assert folder.classes == ("class_00", "class_01", "class_02", "class_03")
    assert len(folder) == 96
    assert folder.samples == tuple(sorted(folder.samples, key=lambda sample: (sample[1], sample[0])))


def test_missing_channel_says_which_group_needs_it(tmp_path: Path) -> None:
    with pytest.raises(MissingChannelError, match=r"assign it to instance group 'data_group'.*inputs.train.groups"):
        scan_images(tmp_path / "absent", "train", "data_group")


def test_channel_without_images_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("not an image")
    with pytest.raises(EmptyChannelError, match="holds no images"):
        scan_images(tmp_path, "train", "dnn_group")


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
        assert np.abs(drafted.astype(int) - full.astype(int)).mean() < 6  # of 255: stripes near the output's Nyquist


# What the vision workload's batches of 16² crops hold (training/workloads/vision.py).
VISION_16 = (FeatureSpec("image", "uint8", (3, 16, 16)), FeatureSpec("label", "int64", ()))


def vision_recipe(samples: Sequence[Any]) -> tuple[Workload, BatchRecipe]:
    """The vision workload (16² crops) and a data host's recipe for ``samples``."""
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": "16"})
    return vision, BatchRecipe(vision.code_dir, vision.name, None, samples, hyperparameters, 1, VISION_16)


def test_corrupt_files_are_skipped_counted_and_replaced(tmp_path: Path) -> None:
    """In a batch of the vision workload's, made as a data host's worker makes it."""
    root = write_dataset(tmp_path, classes=2, per_class=4, size=40)
    broken = root / "class_00" / "00000.jpg"
    broken.write_bytes(b"\xff\xd8 this is not a jpeg")
    (root / "class_01" / "00000.jpg").write_bytes(broken.read_bytes()[:10])
    vision, recipe = vision_recipe(scan_images(root, "train", "g").samples)
    batch, skipped = make_batch(vision, recipe, [0, 4, 1, 2], spares=[5, 6, 7], epochs=[0] * 4)
    assert skipped == 2
    assert batch["image"].shape == (4, 3, 16, 16) and batch["label"].dtype == np.int64
    # Candidates are taken in order: 0 and 4 are broken, so the batch is samples 1, 2 (class 0), spares 5, 6 (class 1).
    assert batch["label"].tolist() == [0, 0, 1, 1]


def test_a_batch_that_cannot_be_filled_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    for index in range(3):
        (tmp_path / "a" / f"{index}.png").write_bytes(b"garbage")
    vision, recipe = vision_recipe(scan_images(tmp_path, "train", "g").samples)
    with pytest.raises(AllSkippedError, match="skipped 3 of the 3 samples"):
        make_batch(vision, recipe, [0, 1], spares=[2], epochs=[0, 0])


def photo(width: int = 320, height: int = 240, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients with noise: an RGB uint8 image that compresses like a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = [127 + 100 * np.sin(x / rng.uniform(20, 80) + y / rng.uniform(20, 80) + phase) for phase in (0, 2, 4)]
    return np.clip(np.stack(channels, axis=-1) + rng.normal(0, 8, (height, width, 3)), 0, 255).astype(np.uint8)


def mean_abs(a: np.ndarray, b: Image.Image | np.ndarray) -> float:
    return float(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).mean())


OPERATIONS = [  # (ours, PIL's, mean |difference| allowed, of 255): rounding, or a different edge/kernel
    ("brightness 1.3", lambda a: preprocess.brightness(a, 1.3), lambda i: ImageEnhance.Brightness(i).enhance(1.3), 0.6),
    ("brightness 0.6", lambda a: preprocess.brightness(a, 0.6), lambda i: ImageEnhance.Brightness(i).enhance(0.6), 0.6),
    ("contrast 1.4", lambda a: preprocess.contrast(a, 1.4), lambda i: ImageEnhance.Contrast(i).enhance(1.4), 0.6),
    ("contrast 0.6", lambda a: preprocess.contrast(a, 0.6), lambda i: ImageEnhance.Contrast(i).enhance(0.6), 0.6),
    ("saturation 1.4", lambda a: preprocess.saturation(a, 1.4), lambda i: ImageEnhance.Color(i).enhance(1.4), 0.6),
    ("saturation 0.6", lambda a: preprocess.saturation(a, 0.6), lambda i: ImageEnhance.Color(i).enhance(0.6), 0.6),
    ("rotate 12", lambda a: preprocess.rotate(a, 12), lambda i: i.rotate(12, resample=Image.Resampling.BILINEAR), 1.5),
    ("rotate -15", lambda a: preprocess.rotate(a, -15), lambda i: i.rotate(-15, resample=Image.Resampling.BILINEAR), 1.5),
    # PIL rounds between its three box passes: on noise that is most of the difference.
    ("blur 0.3", lambda a: preprocess.gaussian_blur(a, 0.3), lambda i: i.filter(ImageFilter.GaussianBlur(0.3)), 1.0),
    ("blur 0.45", lambda a: preprocess.gaussian_blur(a, 0.45), lambda i: i.filter(ImageFilter.GaussianBlur(0.45)), 1.0),
    ("blur 0.6", lambda a: preprocess.gaussian_blur(a, 0.6), lambda i: i.filter(ImageFilter.GaussianBlur(0.6)), 1.0),
    ("blur 1.5", lambda a: preprocess.gaussian_blur(a, 1.5), lambda i: i.filter(ImageFilter.GaussianBlur(1.5)), 1.0),
    ("sharpness 2.0", lambda a: preprocess.sharpness(a, 2.0), lambda i: ImageEnhance.Sharpness(i).enhance(2.0), 0.6),
    ("sharpness 0.5", lambda a: preprocess.sharpness(a, 0.5), lambda i: ImageEnhance.Sharpness(i).enhance(0.5), 0.6),
    ("autocontrast 1%", lambda a: preprocess.autocontrast(a, 1), lambda i: ImageOps.autocontrast(i, cutoff=1), 0.0),
]


@pytest.mark.parametrize(("ours", "pils", "tolerance"), [op[1:] for op in OPERATIONS], ids=[op[0] for op in OPERATIONS])
def test_each_operation_computes_what_pil_computes(ours, pils, tolerance: float) -> None:
    image = photo(224, 224)
    image[:, 112:] = np.random.default_rng(1).integers(0, 256, (224, 112, 3))  # and noise: every frequency
    result = ours(image)
    assert result.dtype == np.uint8 and result.shape == image.shape
    assert mean_abs(result, pils(Image.fromarray(image))) <= tolerance
    assert mean_abs(result, image) > 0.5  # it did something (a wrong direction or a no-op fails above)


def test_a_rotation_turns_the_way_pils_does() -> None:
    image = photo(224, 224)
    assert mean_abs(preprocess.rotate(image, 12), Image.fromarray(image).rotate(-12, resample=Image.Resampling.BILINEAR)) > 10


@pytest.mark.parametrize("value", [0, 77, 255])
def test_autocontrast_leaves_a_flat_channel_alone_as_pil_does(value: int) -> None:
    image = np.full((32, 32, 3), value, dtype=np.uint8)
    image[0, 0] = 255 - value  # one outlier, inside the 1% cut
    assert np.array_equal(preprocess.autocontrast(image, 1), np.asarray(ImageOps.autocontrast(Image.fromarray(image), cutoff=1)))


@pytest.mark.parametrize("augment", ["standard", "heavy"])
@pytest.mark.parametrize("suffix", [".jpg", ".png"])  # OpenCV's path, and PIL's for other formats
def test_a_sample_draws_what_the_pil_pipeline_draws_and_looks_the_same(tmp_path: Path, augment: str, suffix: str) -> None:
    config = AugmentConfig(96, augment)
    brighter = []
    for seed in range(6):
        path = tmp_path / f"{seed}{suffix}"
        Image.fromarray(photo(400, 300, seed)).save(path, quality=95)
        fast_rng, pil_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        fast, pil = load_and_augment(str(path), fast_rng, config), load_and_augment_pil(str(path), pil_rng, config)
        assert fast_rng.bit_generator.state == pil_rng.bit_generator.state  # the same draws, in the same order
        assert fast.shape == pil.shape == (3, 96, 96) and fast.dtype == np.uint8 and fast.flags.c_contiguous
        assert mean_abs(fast, pil) < 2, f"seed {seed}"  # of 255; ~0.5 standard, ~0.8 heavy on average
        brighter.append(float(fast.astype(np.int16).mean() - pil.astype(np.int16).mean()))
    assert abs(statistics.fmean(brighter)) < 0.5  # neither is brighter on the whole: the blends truncate as PIL's do


def test_the_random_crop_draws_torchvisions_distribution() -> None:
    """RandomResizedCrop's definition: area uniform in 8-100% of the image, log aspect uniform in
    [log 3/4, log 4/3], position uniform; a draw that does not fit is tried again (ten times)."""
    rng = np.random.default_rng(0)
    boxes = np.array([crop_box(500, 500, rng) for _ in range(20000)])
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    areas, log_aspects = widths * heights / 500**2, np.log(widths / heights)
    assert areas.min() >= 0.075 and areas.max() <= 1.0
    assert np.log(3 / 4) - 0.02 <= log_aspects.min() and log_aspects.max() <= np.log(4 / 3) + 0.02
    assert abs(log_aspects.mean()) < 0.01  # a square image: wide and tall crops fit alike
    # Large areas at the extreme aspects do not fit and are drawn again: the mean is below 0.54.
    assert 0.40 < areas.mean() < 0.50
    centres = (boxes[:, 0] + boxes[:, 2]) / 2 / 500
    assert abs(centres.mean() - 0.5) < 0.01


def jpeg(image: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", **options)
    return buffer.getvalue()


@pytest.mark.parametrize("options", [{}, {"progressive": True}, {"quality": 40, "subsampling": 0}],
                         ids=["baseline", "progressive", "4:4:4"])
def test_the_jpeg_header_gives_the_size_pil_reads(options: dict) -> None:
    data = jpeg(photo(333, 211), **options)
    assert jpeg_size(np.frombuffer(data, dtype=np.uint8)) == (333, 211)


def test_the_jpeg_header_is_read_past_exif_and_fill_bytes() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated
    data = jpeg(photo(120, 90), exif=exif.tobytes())
    assert jpeg_size(np.frombuffer(data, dtype=np.uint8)) == (120, 90)
    filled = data[:2] + b"\xff\xff\xff" + data[2:]  # fill bytes before a marker are allowed
    assert jpeg_size(np.frombuffer(filled, dtype=np.uint8)) == (120, 90)


@pytest.mark.parametrize("case", ["truncated", "data after the end", "cmyk", "png", "empty", "garbage"])
def test_files_opencvs_path_does_not_take_go_to_pil(case: str) -> None:
    data = jpeg(photo(64, 48))
    blobs = {
        "truncated": data[: len(data) // 2],
        "data after the end": data + b"appended video",
        "cmyk": _cmyk_jpeg(),
        "png": _png(),
        "empty": b"",
        "garbage": b"\xff\xd8 not a jpeg at all \xff\xd9",
    }
    assert jpeg_size(np.frombuffer(blobs[case], dtype=np.uint8)) is None


def _cmyk_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("CMYK", (16, 16), (10, 20, 30, 40)).save(buffer, "JPEG")
    return buffer.getvalue()


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(photo(16, 16)).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_truncated_jpeg_is_refused_as_pil_refuses_it_and_trailing_data_is_not(tmp_path: Path) -> None:
    """libjpeg would decode half a file and fill the rest with grey, silently: such a file must count as
    corrupt, as it did with PIL. A photo with data after its end (a phone's motion photo) is whole."""
    data = jpeg(photo(200, 150))
    truncated, trailing = tmp_path / "truncated.jpg", tmp_path / "trailing.jpg"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    trailing.write_bytes(data + b"\x00" * 64 + b"ftypmp42 a video")
    with pytest.raises(DECODE_ERRORS):
        load_and_augment(str(truncated), np.random.default_rng(0), AugmentConfig(32))
    sample = load_and_augment(str(trailing), np.random.default_rng(0), AugmentConfig(32))
    assert sample.shape == (3, 32, 32) and sample.std() > 0


def test_a_jpeg_with_a_header_and_no_image_is_a_decode_error(tmp_path: Path) -> None:
    """The header parses (so OpenCV's path takes the file), the scan is missing: refused like PIL refuses
    it. (Damaged bytes inside a whole scan are decoded with libjpeg's damage, as TensorFlow and
    torchvision.io decode them; PIL refuses some of those: README, "The data pipeline".)"""
    data = jpeg(photo(64, 48))
    path = tmp_path / "no-scan.jpg"
    path.write_bytes(data[: data.index(b"\xff\xda")] + b"\xff\xd9")
    assert jpeg_size(np.fromfile(path, dtype=np.uint8)) == (64, 48)
    for pipeline in (load_and_augment, load_and_augment_pil):
        with pytest.raises(DECODE_ERRORS):
            pipeline(str(path), np.random.default_rng(0), AugmentConfig(32))


def test_the_exif_orientation_is_ignored_as_pil_ignores_it(tmp_path: Path) -> None:
    """PIL (and so the reference pipeline, and torchvision's ImageFolder) does not apply a JPEG's EXIF
    orientation; OpenCV would by default, which would turn a portrait photo's crop into another one."""
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    path.write_bytes(jpeg(photo(320, 200), exif=exif.tobytes(), quality=95))
    fast = load_and_augment(str(path), np.random.default_rng(1), AugmentConfig(64))
    pil = load_and_augment_pil(str(path), np.random.default_rng(1), AugmentConfig(64))
    assert mean_abs(fast, pil) < 4


def test_a_grey_jpeg_gives_three_equal_channels(tmp_path: Path) -> None:
    path = tmp_path / "grey.jpg"
    Image.fromarray(photo(120, 90)[..., 0]).save(path, quality=95)
    sample = load_and_augment(str(path), np.random.default_rng(0), AugmentConfig(32))  # no colour jitter changes grey
    assert sample.shape == (3, 32, 32)
    assert np.abs(sample[0].astype(int) - sample[1]).max() <= 1 and np.abs(sample[1].astype(int) - sample[2]).max() <= 1


def test_an_image_over_pils_pixel_limit_is_refused_before_it_is_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.jpg"
    path.write_bytes(jpeg(photo(100, 100)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # 100 × 100 is over twice this
    with pytest.raises(Image.DecompressionBombError):
        load_and_augment(str(path), np.random.default_rng(0), AugmentConfig(32))


def test_the_launcher_imports_no_opencv() -> None:
    """Every image runs the launcher, which imports the data server; OpenCV is imported by the PyTorch
    data pipeline's workers alone, so an image without it still starts."""
    code = "import sys, training.launcher; assert 'cv2' not in sys.modules, 'the launcher imported cv2'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".jpg+trailing"])  # OpenCV's path; PIL's, with and without DCT scaling
def test_the_decode_leaves_every_crop_at_least_the_output_and_maps_it_exactly(tmp_path: Path, suffix: str) -> None:
    """What the decoder returns for real files: never fewer pixels across the crop than the output has
    (before any resize), and the reduction it reports is the one the pixels have (the crop's place in
    them is its full-size place divided by it)."""
    rng = np.random.default_rng(0)
    for index, (width, height) in enumerate([(1600, 1200), (721, 477), (3000, 2000), (500, 375), (130, 90)]):
        path = tmp_path / f"{index}{suffix.split('+')[0]}"
        Image.fromarray(photo(width, height, index)).save(path, quality=90)
        if suffix.endswith("trailing"):
            path.write_bytes(path.read_bytes() + b"appended")
        for size in (32, 64, 224):
            for _ in range(8):
                decoded = preprocess.decode_for_crop(str(path), rng, size)
                left, top, right, bottom = decoded.box
                r = decoded.reduction
                assert decoded.pixels.shape[:2] == (-(-height // r), -(-width // r))
                if r > 1:
                    assert min(right - left, bottom - top) / r >= size
                    assert suffix != ".png"  # PNG has no DCT to scale with
                elif suffix != ".png":  # a full decode only when no reduction would do
                    assert min(right - left, bottom - top) < 2 * size


def test_a_crop_is_read_from_the_decoded_pixels_at_its_exact_place() -> None:
    """A bar at full-size x = 704 of a 721 px image lies at 88.0 in the image decoded at 1/8 (libjpeg's
    pixel i covers full pixels 8i..8i+7), not at 704 × 91/721 = 88.85: the resize must sample there."""
    reduced = np.zeros((10, 91, 3), dtype=np.uint8)
    reduced[:, 88] = 255
    out = preprocess.resize_box(reduced, (8 * 80, 0, 8 * 91, 80), 8, 11)  # the crop x 640..728 → 11 px
    assert int(np.argmax(out[5, :, 0])) == 8  # 88 - 80


def test_the_jpeg_header_reader_skips_standalone_markers_and_gives_up_on_endless_fill() -> None:
    data = jpeg(photo(120, 90))
    with_restart = data[:2] + b"\xff\xd0" + data[2:]  # a marker without a length before the frame header
    assert jpeg_size(np.frombuffer(with_restart, dtype=np.uint8)) == (120, 90)
    filled = data[:2] + b"\xff" * 100_000 + data[2:]
    assert jpeg_size(np.frombuffer(filled, dtype=np.uint8)) is None  # left to PIL
