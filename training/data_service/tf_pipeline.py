"""The TensorFlow variant's input pipeline: JPEG decode and augmentation as a tf.data graph.

The same graph runs in two places, doing identical work per sample:

* on the data hosts, inside tf.data.service workers (training/data_service/tf_service.py registers it
  with the dispatcher under ``DATASET_ID``), when the job has a data group;
* in the trainer's own process otherwise (a homogeneous job).

Only TensorFlow ops are used (no Python functions), so the graph serialises to the tf.data.service
workers. Files are listed relative to the channel folder and read relative to the process's working
directory: every data host runs its workers in its own copy of the channel, wherever that is mounted.
Batches leave as uint8 (batch, size, size, 3): normalisation happens on the trainer, which keeps the
bytes on the wire at one per pixel and channel, as in the PyTorch data service. They are registered
uncompressed (``register``): tf.data.service compresses by default, and undoing that would spend the
DNN host's CPU on every batch, the one thing the data group is there to save.

With several data hosts, the trainers read with dynamic sharding (``read_from_service``): the
dispatcher hands the file list out one file at a time to whichever worker asks next, so each file is
handed out once per epoch across all data hosts (what a slower worker still holds at an epoch's edge
reaches the trainers in the next epoch's window: about once per epoch, not exactly). With ``parallel_epochs`` every worker would run the whole
graph, and N data hosts would send every image N times per epoch.
"""

from __future__ import annotations

import math
import os

import numpy as np
import tensorflow as tf

from training.data_service.augmentation import AugmentConfig
from training.data_service.dataset import ImageDataset, file_samples

# The id the dispatcher host registers the pipeline under and the trainers read it by.
DATASET_ID = "train"
# The tf.data.service job every trainer process shares: each batch goes to exactly one of them.
JOB_NAME = "train"


def element_spec(batch_size: int, image_size: int) -> tuple[tf.TensorSpec, tf.TensorSpec]:
    """What one batch looks like, so a trainer without the channel can read the registered dataset."""
    return (
        tf.TensorSpec((batch_size, image_size, image_size, 3), tf.uint8),
        tf.TensorSpec((batch_size,), tf.int32),
    )


def register(dispatcher: str, dataset: tf.data.Dataset) -> None:
    """Register the pipeline with the dispatcher at host:port under ``DATASET_ID``, uncompressed."""
    tf.data.experimental.service.register_dataset(f"grpc://{dispatcher}", dataset, dataset_id=DATASET_ID, compression=None)


def read_from_service(dispatcher: str, spec: object = None) -> tf.data.Dataset:
    """The registered pipeline as a trainer reads it: one job shared by every trainer process (each batch
    to one of them), the file list sharded dynamically across the data hosts' workers. ``spec``: the
    batches' element spec; None asks the dispatcher for the registered dataset's."""
    return tf.data.experimental.service.from_dataset_id(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
        service=f"grpc://{dispatcher}",
        dataset_id=DATASET_ID,
        element_spec=spec,
        job_name=JOB_NAME,
    ).prefetch(2)


def relative_samples(folder: ImageDataset) -> tuple[list[str], list[int]]:
    """The folder's files relative to its root (and their labels), in the folder's sorted order."""
    paths, labels = file_samples(folder)
    return [os.path.relpath(path, folder.root) for path in paths], labels


# The dispatcher hands files out a split at a time: one file per split would cost a round trip to it
# per file (measured: ~3.6k files/s across all workers, and ~5 s to a worker's first batch for 20k files),
# so a split is a group of up to SPLIT_FILES files, fewer for small channels (at least MIN_SPLITS groups).
SPLIT_FILES = 256
MIN_SPLITS = 64
# The groups are read one after the other (flat_map: with interleave over the group source, dynamic
# sharding was lost here, every worker serving duplicates) into a file-level shuffle buffer that mixes
# ~16 groups, which meet differently every epoch (the groups are reshuffled). The buffer holds files back
# on each worker: at most 1/16 of an epoch, so that an epoch's edge stays sharp.
SHUFFLE_BUFFER = 4096
HELD_BACK_FRACTION = 16


def group_files(paths: list[str], labels: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The files in a seeded random order, cut into equal groups (the last padded with "" and -1), so
    that a group is a random sample, not a run of one class. Pure."""
    count = len(paths)
    size = max(1, min(SPLIT_FILES, count // MIN_SPLITS))
    order = np.random.default_rng(seed).permutation(count)
    groups = -(-count // size)
    padded_paths = np.full(groups * size, "", dtype=object)
    padded_labels = np.full(groups * size, -1, dtype=np.int32)
    padded_paths[:count] = np.asarray(paths, dtype=object)[order]
    padded_labels[:count] = np.asarray(labels, dtype=np.int32)[order]
    return padded_paths.reshape(groups, size).astype(str), padded_labels.reshape(groups, size)


def file_source(paths: list[str], labels: list[int], seed: int, *, shard: tuple[int, int] = (0, 1), skip: int = 0,
                repeat: bool = True) -> tf.data.Dataset:
    """The channel's files as a workload's build_dataset receives them: elements {"path": string, "label":
    int32}, endless and shuffled (``repeat``), or each file once in order (``repeat=False``, validation).

    The source is a list of file groups (``group_files``): the unit tf.data.service's dynamic sharding
    hands to a worker. ``shard`` (rank, ranks): a homogeneous multi-process job gives each rank its own
    part of the files. ``skip``: files this rank already read (a resumed job), passed over before any is
    read; the order is the same seeded sequence as in the first run, so the resumed run reads on."""
    rank, ranks = shard
    paths, labels = paths[rank::ranks], labels[rank::ranks]
    if not paths:
        raise ValueError("the pipeline needs at least one file")
    if not repeat:
        return tf.data.Dataset.from_tensor_slices({"path": paths, "label": np.asarray(labels, np.int32)})
    group_paths, group_labels = group_files(paths, labels, seed)
    dataset = tf.data.Dataset.from_tensor_slices((group_paths, group_labels))
    dataset = dataset.shuffle(len(group_paths), seed=seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.flat_map(lambda group, group_label: tf.data.Dataset.from_tensor_slices({"path": group, "label": group_label}))
    dataset = dataset.filter(lambda file: tf.strings.length(file["path"]) > 0)  # the last group's padding
    return dataset.shuffle(max(1, min(SHUFFLE_BUFFER, len(paths) // HELD_BACK_FRACTION)), seed=seed).skip(skip)


def batched(elements: tf.data.Dataset, batch_size: int, *, drop_remainder: bool = True, prefetch: bool = True) -> tf.data.Dataset:
    """A workload's elements as the trainers take them: a sample whose preprocessing raised is left out (the
    batch is filled from the next ones, as the PyTorch data service replaces them), full batches.
    ``prefetch=False`` for a dataset registered with tf.data.service: its workers buffer batches of their
    own, and every batch more held on a worker blurs an epoch's edge further (training/data_service/
    tf_service.py)."""
    batches = elements.ignore_errors().batch(batch_size, drop_remainder=drop_remainder)
    return batches.prefetch(tf.data.AUTOTUNE) if prefetch else batches


def augmentation_pipeline(
    paths: list[str],
    labels: list[int],
    batch_size: int,
    augment: AugmentConfig,
    seed: int,
    *,
    shard: tuple[int, int] = (0, 1),
    skip: int = 0,
) -> tf.data.Dataset:
    """The built-in vision workload's batches (training/workloads/keras_vision.py builds the same):
    endless shuffled batches of augmented images from ``file_source``."""
    return batched(augmented(file_source(paths, labels, seed, shard=shard, skip=skip), augment), batch_size)


def augmented(files: tf.data.Dataset, augment: AugmentConfig) -> tf.data.Dataset:
    """(uint8 image, label) per file of ``files`` (file_source's elements)."""
    return files.map(lambda file: (load_and_augment(file["path"], augment), file["label"]), num_parallel_calls=tf.data.AUTOTUNE)


def load_and_augment(path: tf.Tensor, config: AugmentConfig) -> tf.Tensor:
    """One sample: decode, random resized crop, flip, colour jitter (and for "heavy": rotation, blur,
    sharpening, autocontrast); uint8 (size, size, 3)."""
    image = decode_random_crop(tf.io.read_file(path), config.image_size)
    image = tf.image.random_flip_left_right(image)
    image = colour_jitter(image, strength=0.4)
    if config.augment == "heavy":
        image = rotate(image, tf.random.uniform((), -15.0, 15.0) * math.pi / 180)
        image = gaussian_blur(image, sigma=tf.random.uniform((), 0.1, 1.5))
        image = sharpen(image, factor=tf.random.uniform((), 0.5, 2.0))
        image = autocontrast(image)
    image = tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)
    return tf.ensure_shape(image, (config.image_size, config.image_size, 3))  # the static shape trainers expect


def crop_box(shape: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Inception-style crop of an image of ``shape`` (height, width, channels): area 8–100 %, aspect
    3/4–4/3, ten tries, else the whole image. (begin, size), as tf.slice takes them."""
    begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, crop_size


def decode_random_crop(data: tf.Tensor, size: int) -> tf.Tensor:
    """The random resized crop of an encoded image, size × size, float32. A JPEG's crop is chosen from
    its header (extract_jpeg_shape) and only that window is decoded (decode_and_crop_jpeg, TensorFlow's
    own ImageNet recipe): the rows and blocks outside it are skipped. Other formats decode in full."""

    def jpeg() -> tf.Tensor:
        begin, crop_size = crop_box(tf.io.extract_jpeg_shape(data))
        window = tf.stack([begin[0], begin[1], crop_size[0], crop_size[1]])
        return tf.image.decode_and_crop_jpeg(data, window, channels=3)

    def other() -> tf.Tensor:
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        begin, crop_size = crop_box(tf.shape(image))
        return tf.slice(image, begin, crop_size)

    crop = tf.cond(tf.io.is_jpeg(data), jpeg, other)
    return tf.image.resize(crop, (size, size), method="bilinear", antialias=True)


def colour_jitter(image: tf.Tensor, strength: float) -> tf.Tensor:
    """Brightness, contrast and saturation each scaled by a random factor in [1 − s, 1 + s]."""
    image = image * tf.random.uniform((), 1 - strength, 1 + strength)
    image = tf.image.adjust_contrast(image, tf.random.uniform((), 1 - strength, 1 + strength))
    image = tf.image.adjust_saturation(image, tf.random.uniform((), 1 - strength, 1 + strength))
    return tf.clip_by_value(image, 0.0, 255.0)


def rotate(image: tf.Tensor, angle: tf.Tensor) -> tf.Tensor:
    """Rotate about the centre by ``angle`` radians, bilinear, black corners."""
    height = tf.cast(tf.shape(image)[0], tf.float32)
    width = tf.cast(tf.shape(image)[1], tf.float32)
    cos, sin = tf.cos(angle), tf.sin(angle)
    # The projective transform maps output to input coordinates: rotate by -angle about the centre.
    x_offset = ((width - 1) - (cos * (width - 1) - sin * (height - 1))) / 2
    y_offset = ((height - 1) - (sin * (width - 1) + cos * (height - 1))) / 2
    transform = tf.stack([cos, -sin, x_offset, sin, cos, y_offset, 0.0, 0.0])[tf.newaxis]
    rotated = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[tf.newaxis],
        transforms=transform,
        output_shape=tf.shape(image)[:2],
        fill_value=0.0,
        interpolation="BILINEAR",
        fill_mode="CONSTANT",
    )
    return rotated[0]


def gaussian_blur(image: tf.Tensor, sigma: tf.Tensor, radius: int = 3) -> tf.Tensor:
    """Separable Gaussian blur with a (2·radius + 1)-tap kernel."""
    offsets = tf.range(-radius, radius + 1, dtype=tf.float32)
    kernel = tf.exp(-(offsets**2) / (2 * sigma**2))
    kernel = kernel / tf.reduce_sum(kernel)
    channels = tf.shape(image)[-1]
    horizontal = tf.tile(tf.reshape(kernel, (1, -1, 1, 1)), (1, 1, channels, 1))
    vertical = tf.tile(tf.reshape(kernel, (-1, 1, 1, 1)), (1, 1, channels, 1))
    batch = image[tf.newaxis]
    batch = tf.nn.depthwise_conv2d(batch, horizontal, strides=(1, 1, 1, 1), padding="SAME")
    batch = tf.nn.depthwise_conv2d(batch, vertical, strides=(1, 1, 1, 1), padding="SAME")
    return batch[0]


def sharpen(image: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """PIL's ImageEnhance.Sharpness: blend with a smoothed copy; factor 1 is the original."""
    smooth = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13
    kernel = tf.tile(tf.reshape(smooth, (3, 3, 1, 1)), (1, 1, tf.shape(image)[-1], 1))
    blurred = tf.nn.depthwise_conv2d(image[tf.newaxis], kernel, strides=(1, 1, 1, 1), padding="SAME")[0]
    return tf.clip_by_value(blurred + factor * (image - blurred), 0.0, 255.0)


def autocontrast(image: tf.Tensor) -> tf.Tensor:
    """Stretch each channel to the full 0–255 range; a flat channel is left as it is."""
    low = tf.reduce_min(image, axis=(0, 1), keepdims=True)
    high = tf.reduce_max(image, axis=(0, 1), keepdims=True)
    span = high - low
    stretched = (image - low) * 255.0 / tf.maximum(span, 1e-3)
    return tf.where(span > 0, stretched, image)
