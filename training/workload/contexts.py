"""The context objects a workload's hooks receive, and the readers they may call.

Each hook gets one ``ctx`` with what it may need and nothing it must construct itself:

* ``ChannelContext`` (list_samples): the channel's name and folder on this host, whether it is the
  training channel (and the training channel's name), the hyperparameters, ``ctx.readers`` (ImageFolder, WebDataset tar shards, CSV,
  JSONL), and ``ctx.channel_path(name)`` for any other channel routed to this host's group;
* ``SampleContext`` (preprocess): ``ctx.rng``, a NumPy generator the platform seeds from (seed, epoch,
  sample), so the same sample of the same epoch draws the same augmentation on a data host and in a
  homogeneous job's DataLoader worker; ``ctx.training`` (False for validation samples); ``ctx.Skip``,
  the exception to raise for a sample that should be left out (counted, replaced, never fatal);
* ``TrainContext`` (build_model, build_optimizer, train_step, eval_step, device_transform): the device,
  rank and world size, the step, the training channel's classes and sample count, the precision, and
  ``ctx.state``: a dict the platform checkpoints with the model and restores on resume (for what a
  step keeps between steps: an EMA's count, a curriculum's stage), and ``ctx.channel_path(name)``
  (pretrained weights or a vocabulary routed as a channel).

Standard library and NumPy only: a data host builds these without the trainer's framework.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.workload.contract import WorkloadError


class SkipSample(Exception):  # noqa: N818 — read as an instruction in user code: raise ctx.Skip("why")
    """Raised by ``preprocess`` for a sample to leave out (undecodable, empty): counted and replaced."""


class ChannelNotRoutedError(WorkloadError):
    """A workload asked for a channel that the job does not route to this host's group."""


class Samples(list):
    """A channel's samples, in a stable order, with the class names when the reader knows them (an
    ImageFolder's folders): the label map saved beside the model, and ``ctx.classes`` on every host.
    ``shard_ends``: the samples are tar shards' members, shard by shard, and shard i's end at
    ``shard_ends[i]``; an epoch then reads the shards through in a shuffled order (each shard's bytes
    in one sequential read, as WebDataset streams them), mixed by a shuffle buffer, instead of a
    permutation of every sample."""

    def __init__(self, items: Iterable[Any] = (), classes: Iterable[str] = (), shard_ends: Iterable[int] = ()) -> None:
        super().__init__(items)
        self.classes = tuple(classes)
        self.shard_ends = tuple(shard_ends)


class ShardListing(Sequence):
    """The members of a channel's tar shards as columns (training/data_service/dataset.ShardSamples),
    with Samples' ``classes`` and ``shard_ends``: every worker process gets a copy of the listing, and
    1.28M samples pickle in milliseconds this way (as 1.28M tuples: seconds, and ~140 MB, per worker)."""

    def __init__(self, members: Sequence[Any], classes: Iterable[str], shard_ends: Iterable[int]) -> None:
        self.members, self.classes, self.shard_ends = members, tuple(classes), tuple(shard_ends)

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: Any) -> Any:
        return self.members[index]


class Readers:
    """The platform's readers, for ``list_samples`` to call (``ctx.readers.image_folder(ctx.path)``).
    ``classes``: the training channel's, while another channel is listed (ChannelContext.classes), which
    image_folder's labels then index by default."""

    def __init__(self, classes: Sequence[str] = ()) -> None:
        self.classes = tuple(classes)

    def image_folder(self, path: Path, classes: Sequence[str] | None = None) -> Samples:
        """(source, class index) for every image of an ImageFolder (``<class>/<file>``) or of WebDataset
        tar shards (``*.tar`` with ``<key>.jpg`` + ``<key>.cls``); read a source with ``read_bytes`` or
        ``decode_image``. Tar sources are (shard, offset, size) records: a listing of millions pickles
        fast.

        ``classes`` (by default, while an evaluation channel is listed, the training channel's): the labels
        are indices into these, by folder name, so that a held-out folder holding some of the classes
        scores against the classes the model learnt; a class folder (or a shard label) they do not have is
        refused (ChannelError), by name. ``classes=()``: the folder's own."""
        from training.data_service.dataset import scan_images

        folder = scan_images(Path(path), Path(path).name, "this host")
        samples, names = folder.samples, folder.classes
        classes = self.classes if classes is None else tuple(classes)
        if classes:
            samples, names = _relabelled(folder.samples, folder.classes, tuple(classes), Path(path), tar=bool(folder.shard_ends))
        if folder.shard_ends:  # tar shards: streamed shard by shard (see Samples)
            return ShardListing(samples, names, folder.shard_ends)  # type: ignore[return-value]
        return Samples(samples, names)

    webdataset = image_folder

    @staticmethod
    def read_bytes(source: Any) -> np.ndarray:
        """A sample's encoded bytes (uint8): a file's, or a tar member's."""
        from training.data_service.dataset import read_sample

        return read_sample(source)

    @staticmethod
    def decode_image(source: Any) -> np.ndarray:
        """An image source decoded to RGB uint8 [height, width, 3]; raises SkipSample when it is no image."""
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(Readers.read_bytes(source).tobytes())) as image:
                return np.asarray(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise SkipSample(f"{source}: not a decodable image ({error})") from None

    @staticmethod
    def jsonl(path: Path) -> Samples:
        """Every line of every ``*.jsonl`` file under ``path`` (sorted by name), as dicts."""
        rows = Samples()
        for file in _files(path, ".jsonl"):
            with open(file, encoding="utf-8") as handle:
                rows.extend(json.loads(line) for line in handle if line.strip())
        return rows

    @staticmethod
    def csv(path: Path) -> Samples:
        """Every row of every ``*.csv`` file under ``path`` (sorted by name), as dicts by its header."""
        rows = Samples()
        for file in _files(path, ".csv"):
            with open(file, encoding="utf-8", newline="") as handle:
                rows.extend(csv.DictReader(handle))
        return rows


def _relabelled(samples: Sequence[Any], found: tuple[str, ...], classes: tuple[str, ...], path: Path, *, tar: bool) -> tuple[Sequence[Any], tuple[str, ...]]:
    """An image listing's (samples, classes) with its labels as indices into ``classes``. Pure.

    An ImageFolder's labels index its own sorted folders, so they are mapped by name; a tar shard's
    labels are class indices written in the data, which mean the same in every channel, so they are
    only checked to be within ``classes``."""
    from training.data_service.dataset import ChannelError

    if tar:
        if len(found) > len(classes):
            raise ChannelError(f"{path} holds shard labels up to {len(found) - 1}, but the training channel has {len(classes)} classes")
        return samples, classes
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ChannelError(f"class folders {unknown} are not among the training channel's classes "
                           f"(it has {len(classes)}: {list(classes)[:8]}{' …' if len(classes) > 8 else ''}): the model cannot predict them")
    index = {name: classes.index(name) for name in found}
    return tuple((source, index[found[label]]) for source, label in samples), classes


def _files(path: Path, suffix: str) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(file for file in path.rglob(f"*{suffix}") if file.is_file())


READERS = Readers()


@dataclass(frozen=True)
class ChannelContext:
    channel: str
    path: Path
    training: bool
    hyperparameters: Mapping[str, Any]
    # Every channel routed to this host's group: name → folder.
    channels: Mapping[str, Path] = field(default_factory=dict)
    # The job's training channel (an evaluation channel's labels may need its classes).
    training_channel: str = "train"
    # While listing another channel than the training one (an evaluation channel): the training channel's
    # classes, which its labels must index (ctx.readers.image_folder maps an ImageFolder's onto them). Empty
    # while listing the training channel, or where the training channel's listing has no classes.
    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.classes and self.readers is READERS:
            object.__setattr__(self, "readers", Readers(self.classes))
    readers: Readers = READERS

    def channel_path(self, name: str) -> Path:
        return routed_channel(self.channels, name)


def routed_channel(channels: Mapping[str, Path], name: str) -> Path:
    """The folder of channel ``name`` among those routed to this host's group, or ChannelNotRoutedError
    listing the ones it has."""
    try:
        return channels[name]
    except KeyError:
        raise ChannelNotRoutedError(f"the workload asks for channel {name!r}, which this job does not route to this host's group; "
                                    f"it has {sorted(channels)}: add it to the spec's inputs for this group") from None


@dataclass
class SampleContext:
    rng: np.random.Generator
    training: bool
    hyperparameters: Mapping[str, Any]
    epoch: int = 0
    index: int = 0
    Skip: type[SkipSample] = SkipSample
    readers: Readers = READERS


@dataclass
class TrainContext:
    hyperparameters: Mapping[str, Any]
    device: Any  # a torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    step: int = 0  # the step being taken (1-based, counted across restarts); 0 while building
    steps: int = 0  # the run's total
    classes: tuple[str, ...] = ()
    num_samples: int = 0  # of the training channel (one data host's share, when each serves a shard)
    precision: str = "fp32"
    is_xla: bool = False
    training: bool = True  # False while validating (device_transform runs on validation batches too)
    # The workload's own state, checkpointed with the model and restored on resume (torch.save-able:
    # tensors, numbers, strings, lists and dicts of them).
    state: dict[str, Any] = field(default_factory=dict)
    # Every channel routed to this host's group: name → folder (pretrained weights, a vocabulary).
    channels: Mapping[str, Path] = field(default_factory=dict)

    def channel_path(self, name: str) -> Path:
        return routed_channel(self.channels, name)
