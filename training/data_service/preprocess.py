"""Decode and augment images into uint8 tensors: the CPU work a data host takes off the DNN host.

The same functions run in the data service's worker processes and, in a homogeneous job, in the
trainer's own DataLoader workers, so both configurations do identical work per sample. Output is
uint8 (channels, height, width): normalisation to float happens later on the trainer's device, which keeps
the bytes on the wire at one per pixel and channel.

Where the time goes, and what is done about it (bench/preprocess.py measures each against PIL):

- Decoding is most of the cost for photos larger than the output (a 1600 px JPEG takes ~10 ms to decode
  in full on one core here). The crop is chosen from the file's header first (its size is all the random
  crop needs), then the JPEG is decoded at the largest DCT reduction (1/2, 1/4, 1/8) that still leaves
  the crop at least as large as the output, so nothing is upscaled that a full decode would have kept
  sharper. What remains is the entropy decoding of the whole file, which no reduction skips.
- Every operation after the decode works on uint8 arrays with OpenCV, several times PIL's speed for the
  same operation: the affine warp of the rotation and the Gaussian blur most of all. Brightness,
  contrast and saturation are one saturating multiply-add each, autocontrast one table lookup. There is
  no float image anywhere.
- Each operation keeps PIL's definition (training/data_service/pil_reference.py states it as code; the
  tests hold each operation to it), and the random parameters are drawn in the same order from the same
  generator as there.

Only OpenCV, PIL (for the header, and for files OpenCV's path does not take) and numpy are imported
here, no torch: spawned worker processes start in a fraction of a second.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import NamedTuple

import cv2
import numpy as np
from PIL import Image

from training.data_service.augmentation import AugmentConfig
from training.data_service.dataset import SampleSource, read_sample

# One worker process per vCPU does the parallelism: OpenCV's own thread pool would only oversubscribe
# the cores (and its threads do not survive a fork).
cv2.setNumThreads(1)

# What decoding raises for a file that is not a decodable image (truncated, wrong format, garbage).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)

# The augmentation's parameter ranges (the same in pil_reference.py and the TensorFlow pipeline).
JITTER_STRENGTH = 0.4  # brightness, contrast, saturation factors in [0.6, 1.4]
ROTATION_DEGREES = 15.0
EVAL_CROP = 0.875  # of the shorter side: the validation centre crop (ImageNet's 224 of 256)
BLUR_RADIUS = (0.1, 1.5)  # the Gaussian's standard deviation, pixels
SHARPNESS = (0.5, 2.0)
AUTOCONTRAST_CUTOFF = 1  # percent of pixels clipped at each end of each channel's histogram

# JPEG decoders scale by 1/1, 1/2, 1/4 or 1/8 while decoding (the DCT's own reductions).
DRAFT_REDUCTIONS = (8, 4, 2, 1)
_OPENCV_READ = {
    reduction: flag | cv2.IMREAD_IGNORE_ORIENTATION  # like PIL: the EXIF orientation is not applied
    for reduction, flag in ((1, cv2.IMREAD_COLOR), (2, cv2.IMREAD_REDUCED_COLOR_2),
                            (4, cv2.IMREAD_REDUCED_COLOR_4), (8, cv2.IMREAD_REDUCED_COLOR_8))
}
# PIL's SMOOTH filter: what ImageEnhance.Sharpness blends against.
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13


def load_and_augment(path: SampleSource, rng: np.random.Generator, config: AugmentConfig, draft: bool = True) -> np.ndarray:
    """One training sample: decode, augment, return uint8 (3, size, size). Raises a DECODE_ERRORS error
    for a file that is not a decodable image. ``draft=False`` decodes every file in full (to show that the
    reduced decode keeps the image: tests/training/test_preprocess.py)."""
    image = decode_crop(path, rng, config.image_size, draft)
    if rng.random() < 0.5:
        image = cv2.flip(image, 1)
    image = colour_jitter(image, rng, JITTER_STRENGTH)
    if config.augment == "heavy":
        image = rotate(image, float(rng.uniform(-ROTATION_DEGREES, ROTATION_DEGREES)))
        image = gaussian_blur(image, float(rng.uniform(*BLUR_RADIUS)))
        image = sharpness(image, float(rng.uniform(*SHARPNESS)))
        image = autocontrast(image, AUTOCONTRAST_CUTOFF)
    return np.stack(cv2.split(image))  # (height, width, 3) → (3, height, width), one copy


def load_for_eval(path: SampleSource, size: int, draft: bool = True) -> np.ndarray:
    """One validation sample, the same every time: the centre crop holding EVAL_CROP of the shorter side,
    resized to size × size (torchvision's Resize(size / 0.875) + CenterCrop(size)), as uint8 (3, size,
    size). Raises a DECODE_ERRORS error for a file that is not a decodable image."""
    image = decode_crop(path, np.random.default_rng(0), size, draft, box_of=centre_box)
    return np.stack(cv2.split(image))


class Decoded(NamedTuple):
    """An image decoded for one crop: the pixels at 1/``reduction`` of the full size (full-size pixel x
    lies at x / reduction in them), and the crop ``box`` in full-size pixels."""

    pixels: np.ndarray  # uint8 (height, width, 3)
    bgr: bool  # OpenCV's channel order (else RGB)
    box: tuple[int, int, int, int]
    reduction: int


def decode_crop(path: SampleSource, rng: np.random.Generator, size: int, draft: bool = True, box_of: BoxChooser | None = None) -> np.ndarray:
    """The random crop of the image at ``path`` (or the one ``box_of`` chooses), resized to size × size:
    RGB uint8 (size, size, 3)."""
    decoded = decode_for_crop(path, rng, size, draft, box_of)
    resized = resize_box(decoded.pixels, decoded.box, decoded.reduction, size)
    # OpenCV decodes to BGR: the channels are swapped after the resize, on the fewest pixels.
    return cv2.cvtColor(resized, cv2.COLOR_BGR2RGB) if decoded.bgr else resized


def decode_for_crop(path: SampleSource, rng: np.random.Generator, size: int, draft: bool = True, box_of: BoxChooser | None = None) -> Decoded:
    """Draw the crop from the header, then decode at the largest reduction that leaves it ≥ ``size``."""
    data = read_sample(path)
    header = jpeg_size(data)
    if header is None:  # another format, or a JPEG OpenCV's path does not take: PIL decodes it
        return decode_for_crop_pil(data, rng, size, draft, box_of)
    width, height = header
    if Image.MAX_IMAGE_PIXELS and width * height > 2 * Image.MAX_IMAGE_PIXELS:  # PIL's own refusal
        raise Image.DecompressionBombError(f"{path}: {width}×{height} pixels is over twice Image.MAX_IMAGE_PIXELS")
    box, reduction = plan_crop(width, height, rng, size, draft, box_of)  # from the header: nothing is decoded yet
    try:
        bgr = cv2.imdecode(data, _OPENCV_READ[reduction])
    except cv2.error as error:
        raise ValueError(f"{path}: {error}") from None
    if bgr is None:
        raise ValueError(f"{path}: not a decodable JPEG")
    return Decoded(bgr, True, box, reduction)


def decode_for_crop_pil(data: np.ndarray, rng: np.random.Generator, size: int, draft: bool, box_of: BoxChooser | None = None) -> Decoded:
    """decode_for_crop for what OpenCV's path does not take: PIL reads the header, decodes (a JPEG at a
    DCT reduction, as OpenCV would) and refuses what is not a whole image."""
    with Image.open(io.BytesIO(data)) as source:
        width, height = source.size
        box, reduction = plan_crop(width, height, rng, size, draft, box_of)
        if reduction > 1:  # a no-op for formats without DCT scaling (PNG, ...)
            # PIL takes the largest scale with width // (requested width) at least it: floor, not ceil.
            source.draft("RGB", (width // reduction, height // reduction))
        pixels = np.asarray(source.convert("RGB"))
    return Decoded(pixels, False, box, decoded_reduction(width, pixels.shape[1]))


def decoded_reduction(width: int, decoded_width: int) -> int:
    """The DCT reduction a decoder used: libjpeg's reduced width is ceil(width / r). Pure."""
    return next((r for r in (8, 4, 2) if decoded_width == -(-width // r) and decoded_width != width), 1)


def jpeg_size(data: np.ndarray) -> tuple[int, int] | None:
    """(width, height) of a JPEG that OpenCV decodes as PIL would: grey or YCbCr (not CMYK), whole (it
    ends with the end-of-image marker: libjpeg fills a truncated file's missing rows with grey and says
    nothing, where PIL refuses the file). None for anything else. Reads the markers up to the frame
    header, as PIL's JPEG plugin does, without PIL's per-file cost. Pure."""
    view = memoryview(data).cast("B")
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8 or view[-2] != 0xFF or view[-1] != 0xD9:
        return None
    position, fill = 2, 0
    while position + 9 < len(view):
        if view[position] != 0xFF:
            return None
        marker = view[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            fill += 1
            if fill > _MAX_FILL:
                return None
            position += 1
            continue
        fill = 0
        if marker in _STANDALONE_MARKERS:  # no length follows
            position += 2
            continue
        if marker in _FRAME_MARKERS:
            height = view[position + 5] << 8 | view[position + 6]
            width = view[position + 7] << 8 | view[position + 8]
            return (width, height) if view[position + 9] in (1, 3) and width and height else None
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None
        position += 2 + (view[position + 2] << 8 | view[position + 3])
    return None


# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic), not DHT (C4),
# JPG (C8) or DAC (CC); markers that stand alone (TEM, RST0-7, SOI); a cap on fill bytes, which a file
# may hold any number of but no real encoder writes many of.
_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD9)})
_MAX_FILL = 64


def resize_box(pixels: np.ndarray, box: tuple[int, int, int, int], reduction: int, size: int) -> np.ndarray:
    """The region ``box`` (in full-size pixels) of ``pixels`` (the image decoded at 1/``reduction``)
    resized to size × size, as PIL's antialiased bilinear resize does it: the low-pass filter reads past
    the box's edges where the image goes on, and a box that falls between the decoded pixels is sampled
    where it lies (half a pixel off moves fine detail visibly)."""
    left, top, right, bottom = (edge / reduction for edge in box)
    shrink = min(right - left, bottom - top) / size
    if shrink >= 4:  # box-average by a whole factor first, so that the blur below stays narrow
        factor = int(shrink // 2)
        x0, y0 = max(0, math.floor(left) - factor), max(0, math.floor(top) - factor)
        x1 = x0 + (min(pixels.shape[1], math.ceil(right) + factor) - x0) // factor * factor
        y1 = y0 + (min(pixels.shape[0], math.ceil(bottom) + factor) - y0) // factor * factor
        pixels = cv2.resize(pixels[y0:y1, x0:x1], ((x1 - x0) // factor, (y1 - y0) // factor), interpolation=cv2.INTER_AREA)
        left, right, top, bottom = (left - x0) / factor, (right - x0) / factor, (top - y0) / factor, (bottom - y0) / factor
    shrink_x, shrink_y = (right - left) / size, (bottom - top) / size
    kernel_x, kernel_y = antialias_kernel(shrink_x), antialias_kernel(shrink_y)
    # The pixels the output reads: the box, and the blur's and the interpolation's reach around it.
    reach_x, reach_y = len(kernel_x) // 2 + 1, len(kernel_y) // 2 + 1
    x0, y0 = max(0, math.floor(left) - reach_x), max(0, math.floor(top) - reach_y)
    x1, y1 = min(pixels.shape[1], math.ceil(right) + reach_x), min(pixels.shape[0], math.ceil(bottom) + reach_y)
    region = pixels[y0:y1, x0:x1]
    if len(kernel_x) > 1 or len(kernel_y) > 1:
        region = cv2.sepFilter2D(region, -1, kernel_x, kernel_y, borderType=cv2.BORDER_REPLICATE)
    if shrink_x >= 1 and shrink_y >= 1 and all(float(edge).is_integer() for edge in (left, top, right, bottom)):
        # Whole pixels, shrinking: the plain resize reads nothing outside the box, and costs less.
        return cv2.resize(region[int(top) - y0:int(bottom) - y0, int(left) - x0:int(right) - x0], (size, size),
                          interpolation=cv2.INTER_LINEAR)
    # Output pixel centre x + 0.5 lies at left + (x + 0.5) × shrink in the source (centre convention).
    matrix = np.array([[shrink_x, 0.0, left - x0 + 0.5 * shrink_x - 0.5], [0.0, shrink_y, top - y0 + 0.5 * shrink_y - 0.5]])
    return cv2.warpAffine(region, matrix, (size, size), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_REPLICATE)


def antialias_sigma(shrink: float) -> float:
    """The Gaussian to apply before OpenCV's bilinear resize shrinks by ``shrink`` so that the two
    together low-pass as PIL's bilinear resize does. PIL widens its triangle filter to ``shrink``
    pixels (variance shrink²/6); bilinear sampling is itself a one-pixel triangle (variance 1/6); the
    Gaussian supplies the difference. Bilinear alone would alias (stripes at the output's Nyquist
    frequency came out 12-18 levels off PIL's, of 255; with this, under 1), and OpenCV's area averaging
    costs three times as much and is 2-5 levels off. 0 when nothing shrinks. Pure."""
    return math.sqrt((shrink * shrink - 1) / 6) if shrink > 1 else 0.0


def antialias_kernel(shrink: float) -> np.ndarray:
    """The low-pass kernel of antialias_sigma: only its variance matters here, so up to σ = 0.7 (a
    shrink of up to 2×, the common case after a reduced decode) three taps [a, 1 - 2a, a], a = σ²/2, which
    have it exactly, at less than half the cost of PIL's seven. Pure."""
    sigma = antialias_sigma(shrink)
    if 0 < sigma <= 0.7:
        a = sigma * sigma / 2
        return np.array([a, 1 - 2 * a, a], dtype=np.float32)
    return gaussian_kernel(sigma)


def gaussian_kernel(sigma: float, passes: int = 3) -> np.ndarray:
    """PIL's Gaussian as one 1-D kernel: ImageFilter.GaussianBlur runs ``passes`` box blurs of a
    fractional radius chosen so that together they have variance σ² (Gwosdek et al., "Theoretical
    foundations of Gaussian convolution by extended box filtering", as Pillow's BoxBlur.c computes it).
    OpenCV's sampled Gaussian has a different shape and, below σ ≈ 0.7, far less variance (0.008 for
    σ² = 0.09). Pure."""
    if sigma <= 0:
        return np.ones(1, dtype=np.float32)
    variance = sigma * sigma / passes
    whole = math.floor((math.sqrt(12 * variance + 1) - 1) / 2)
    fraction = (2 * whole + 1) * (whole * (whole + 1) - 3 * variance) / (6 * (variance - (whole + 1) ** 2))
    box = np.array([fraction, *([1.0] * (2 * whole + 1)), fraction]) / (2 * whole + 1 + 2 * fraction)
    kernel = box
    for _ in range(passes - 1):
        kernel = np.convolve(kernel, box)
    return kernel.astype(np.float32)


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


def centre_box(width: int, height: int, _rng: np.random.Generator | None = None) -> tuple[int, int, int, int]:
    """The validation crop: a centred square of EVAL_CROP of the shorter side. Pure."""
    side = max(1, round(min(width, height) * EVAL_CROP))
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


# (width, height, rng) → the crop box (left, top, right, bottom) in full-size pixels.
BoxChooser = Callable[[int, int, np.random.Generator], tuple[int, int, int, int]]


def plan_crop(width: int, height: int, rng: np.random.Generator, size: int, draft: bool = True,
              box_of: BoxChooser | None = None) -> tuple[tuple[int, int, int, int], int]:
    """The random crop of a width × height image (or ``box_of``'s) and the decode reduction for it (1
    without ``draft``)."""
    box = (box_of or crop_box)(width, height, rng)
    return box, draft_reduction(box, size) if draft else 1


def draft_reduction(box: tuple[int, int, int, int], size: int) -> int:
    """The largest JPEG decode reduction that leaves the crop at least ``size`` on both sides (1 when the
    crop is smaller than the output already: a full decode is then the sharpest there is). Pure."""
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    return next(reduction for reduction in DRAFT_REDUCTIONS if reduction == 1 or min(crop_w, crop_h) / reduction >= size)


# Each operation below takes and returns RGB uint8 (height, width, 3) and computes what the PIL
# operation named in its docstring computes (pil_reference.py), to within rounding.

def colour_jitter(image: np.ndarray, rng: np.random.Generator, strength: float) -> np.ndarray:
    """Brightness, contrast and saturation, each by a factor in [1 - strength, 1 + strength], in random
    order (as ImageEnhance's Brightness, Contrast and Color)."""
    for index in rng.permutation(3):
        image = _JITTERS[index](image, float(rng.uniform(1 - strength, 1 + strength)))
    return image


def brightness(image: np.ndarray, factor: float) -> np.ndarray:
    """ImageEnhance.Brightness: a blend towards black."""
    return cv2.convertScaleAbs(image, alpha=factor, beta=_TRUNCATE)


def contrast(image: np.ndarray, factor: float) -> np.ndarray:
    """ImageEnhance.Contrast: a blend towards the grey of the image's mean luminance (ITU-R 601 weights,
    as PIL's "L")."""
    red, green, blue, _ = cv2.mean(image)
    mean = int(0.299 * red + 0.587 * green + 0.114 * blue + 0.5)
    return cv2.addWeighted(image, factor, image, 0.0, (1.0 - factor) * mean + _TRUNCATE)


def saturation(image: np.ndarray, factor: float) -> np.ndarray:
    """ImageEnhance.Color: a blend towards the image's own luminance."""
    grey = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
    return cv2.addWeighted(image, factor, grey, 1.0 - factor, _TRUNCATE)


# PIL's blends truncate; OpenCV's saturating arithmetic rounds (to even on a tie). Less than half a level
# before rounding truncates but for values within 0.001 of the next integer, and keeps the output from
# sitting half a level above PIL's on average.
_TRUNCATE = -0.499

_JITTERS = (brightness, contrast, saturation)  # the order pil_reference.colour_jitter_pil draws from


def rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Image.rotate(degrees, BILINEAR): counter-clockwise about the centre, same size. As in PIL, a pixel
    whose source point falls outside the image is black and one inside is interpolated from the image
    alone (its edge extended), so the corners' edge is sharp: OpenCV's constant border would blend the
    edge with black, and the extra dark pixels would move autocontrast's 1% cut."""
    height, width = image.shape[:2]
    matrix = cv2.getRotationMatrix2D(((width - 1) / 2, (height - 1) / 2), degrees, 1.0)
    rotated = cv2.warpAffine(image, matrix, (width, height), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    # Nearest-neighbour rounding keeps exactly the source points within PIL's bounds [0, size).
    inside = cv2.warpAffine(np.full((height, width), 255, dtype=np.uint8), matrix, (width, height), flags=cv2.INTER_NEAREST,
                            borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return cv2.bitwise_and(rotated, rotated, mask=inside)


def gaussian_blur(image: np.ndarray, radius: float) -> np.ndarray:
    """ImageFilter.GaussianBlur(radius): radius is the Gaussian's standard deviation; edges extended."""
    kernel = gaussian_kernel(radius)
    return cv2.sepFilter2D(image, -1, kernel, kernel, borderType=cv2.BORDER_REPLICATE)


def sharpness(image: np.ndarray, factor: float) -> np.ndarray:
    """ImageEnhance.Sharpness: a blend away from (factor > 1) or towards the SMOOTH-filtered image, whose
    one-pixel border PIL leaves as it was."""
    smooth = cv2.filter2D(image, -1, _SMOOTH, borderType=cv2.BORDER_REPLICATE)
    smooth[0], smooth[-1], smooth[:, 0], smooth[:, -1] = image[0], image[-1], image[:, 0], image[:, -1]
    return cv2.addWeighted(image, factor, smooth, 1.0 - factor, _TRUNCATE)


def autocontrast(image: np.ndarray, cutoff: float) -> np.ndarray:
    """ImageOps.autocontrast(cutoff): each channel stretched linearly so that, after ``cutoff`` percent of
    its pixels are clipped at each end, it spans 0..255; one lookup for all three channels."""
    tables = [_autocontrast_table(cv2.calcHist([image], [channel], None, [256], [0, 256]).ravel(), cutoff)
              for channel in range(image.shape[2])]
    return cv2.LUT(image, np.stack(tables, axis=-1).reshape(256, 1, image.shape[2]))


def _autocontrast_table(histogram: np.ndarray, cutoff: float) -> np.ndarray:
    """One channel's table, as PIL computes it: the lowest and highest values left once int(n × cutoff
    // 100) pixels are removed from each end; the identity when nothing is left between them. Pure."""
    counts = histogram.astype(np.int64)
    cut = int(counts.sum() * cutoff // 100)
    low = int(np.argmax(np.cumsum(counts) > cut))
    high = 255 - int(np.argmax(np.cumsum(counts[::-1]) > cut))
    if high <= low:
        return np.arange(256, dtype=np.uint8)
    scale = 255.0 / (high - low)
    return np.clip(np.trunc(np.arange(256) * scale - low * scale), 0, 255).astype(np.uint8)
