"""An input channel in ImageFolder layout: one folder per class, JPEG/PNG files inside.

SageMaker copies a channel to ``/opt/ml/input/data/<channel>`` on the hosts the channel is assigned to.
A channel that is missing or holds no image is refused here, before any process starts, with a message
that says how to fix the job spec.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from training.cluster import base_dir

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


class ChannelError(ValueError):
    """The input channel cannot feed training."""


class MissingChannelError(ChannelError):
    pass


class EmptyChannelError(ChannelError):
    pass


class CorruptDatasetError(RuntimeError):
    """So many files failed to decode that a batch could not be filled."""


@dataclass(frozen=True)
class ImageFolder:
    root: Path
    classes: tuple[str, ...]
    # (file path, class index), sorted, so every host lists the same samples in the same order.
    samples: tuple[tuple[str, int], ...]

    def __len__(self) -> int:
        return len(self.samples)


def channel_dir(channel: str, environ: Mapping[str, str] = os.environ) -> Path:
    return base_dir(environ) / "input" / "data" / channel


def channel_is_sharded(channel: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether SageMaker gave this host a ShardedByS3Key share of the channel (inputdataconfig.json, which
    it writes on every host; the emulated cluster writes it too), not every object of it."""
    path = base_dir(environ) / "input" / "config" / "inputdataconfig.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    return config.get(channel, {}).get("S3DistributionType") == "ShardedByS3Key"


def _require_channel(root: Path, channel: str, group: str) -> None:
    if not root.is_dir():
        raise MissingChannelError(
            f"channel {channel!r} is not on this host ({root} does not exist): assign it to instance group "
            f"{group!r} in the job spec's inputs (inputs.{channel}.groups)"
        )


def scan_csv_channel(root: Path, channel: str, group: str) -> list[Path]:
    """The .csv files of a text channel (label, title, content rows), refused when there are none."""
    _require_channel(root, channel, group)
    files = sorted(path for path in root.glob("*.csv") if path.is_file() and path.stat().st_size > 0)
    if not files:
        raise EmptyChannelError(f"channel {channel!r} at {root} holds no non-empty .csv files")
    return files


def scan_image_folder(root: Path, channel: str, group: str) -> ImageFolder:
    """List the samples of a channel; ``group`` only makes the error messages precise."""
    _require_channel(root, channel, group)
    classes = tuple(sorted(entry.name for entry in root.iterdir() if entry.is_dir()))
    samples = tuple(
        (str(path), index)
        for index, name in enumerate(classes)
        for path in sorted((root / name).iterdir())
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()
    )
    if not samples:
        raise EmptyChannelError(
            f"channel {channel!r} at {root} holds no images: expected class folders of "
            f"{'/'.join(IMAGE_SUFFIXES)} files (ImageFolder layout), found {len(classes)} folders"
        )
    return ImageFolder(root=root, classes=classes, samples=samples)
