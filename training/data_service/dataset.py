"""An image channel, in one of two layouts, and the text channel's files.

* ImageFolder: one folder per class, JPEG/PNG files inside; a sample is a file.
* Tar shards (WebDataset's layout): ``*.tar`` files anywhere under the channel, each holding samples as
  members that share a key, ``<key>.jpg|jpeg|png`` and ``<key>.cls`` (the class index as text) or
  ``<key>.json`` (``{"label": <class index>}``). A sample is an image member: tar stores members whole
  and uncompressed, so its bytes are read with one seek and one read (``read_sample``), and the shard's
  members are read in order (``shard_stream_order``) when the channel streams from S3 (FastFile).

SageMaker copies a channel to ``/opt/ml/input/data/<channel>`` on the hosts the channel is assigned to.
A channel that is missing or holds no image is refused here, before any process starts, with a message
that says how to fix the job spec. A shard member that cannot be a sample (no label, a label that is not
a class index, cut off by a truncated shard) is left out and counted (``ImageDataset.unusable``); an
image member that does not decode is skipped and counted when it is read, like a damaged file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from training.cluster import base_dir

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
SHARD_SUFFIX = ".tar"
# Samples a shard-streamed epoch holds back to mix (WebDataset examples use 1000-5000): the order mixes
# members across ~this many, and across shards through the shards' own shuffled order.
SHARD_SHUFFLE_BUFFER = 4096
# Where listed shard indexes are cached (node-local; a private folder in the system's temp folder unless
# set), and the version of the listing rules (index_shard): a change makes every older cache a stranger.
SHARD_INDEX_CACHE_ENV = "SHARD_INDEX_CACHE_DIR"
SHARD_INDEX_VERSION = 2
# More classes than this is a label that is no class index (a WordNet offset, a hash), not a model head.
MAX_CLASSES = 100_000


class ChannelError(ValueError):
    """The input channel cannot feed training."""


class MissingChannelError(ChannelError):
    pass


class EmptyChannelError(ChannelError):
    pass


@dataclass(frozen=True)
class TarMember:
    """A file inside a tar shard: ``size`` bytes from ``offset`` of ``shard``."""

    shard: str
    offset: int
    size: int

    def __str__(self) -> str:  # what a skipped sample's log line names
        return f"{self.shard} (the member at byte {self.offset})"


# Where a sample's bytes are: a file's path, or a member of a tar shard.
SampleSource = str | TarMember


@dataclass(frozen=True, eq=False)
class ShardSamples(Sequence[tuple[TarMember, int]]):
    """The samples of a tar channel as columns: a spawned worker gets a copy of the listing, and 1.28M
    samples pickle to ~30 MB of arrays in milliseconds (as 1.28M objects: ~140 MB, seconds per worker)."""

    shards: tuple[str, ...]
    shard: np.ndarray  # int32: index into shards
    offset: np.ndarray  # int64
    size: np.ndarray  # int64
    label: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return TarMember(self.shards[self.shard[index]], int(self.offset[index]), int(self.size[index])), int(self.label[index])


@dataclass(frozen=True)
class ImageDataset:
    root: Path
    classes: tuple[str, ...]
    # (source, class index), in a stable order, so every host lists the same samples in the same order:
    # sorted paths, or shard by shard (sorted shards) in each shard's member order.
    samples: Sequence[tuple[SampleSource, int]]
    # Tar shards only: where each shard's samples end in ``samples``; () for an ImageFolder.
    shard_ends: tuple[int, ...] = ()
    unusable: int = 0  # shard members left out when listing (see the module docstring)
    # What listed the samples when a workload did ("augmented_cnn.list_samples"); "" for a channel scanned here.
    lister: str = ""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def layout(self) -> str:
        return "tar shards" if self.shard_ends else "ImageFolder"

    def described(self) -> str:
        """Where the samples come from, for a log line: the channel's layout, or the workload's listing
        (a CSV of paths, text records: not an ImageFolder, whatever its items are)."""
        if not self.lister:
            return f"in {self.layout}"
        return f"from {self.lister}" + (" over tar shards" if self.shard_ends else "")


def read_sample(source: SampleSource) -> np.ndarray:
    """A sample's encoded bytes, uint8."""
    if isinstance(source, TarMember):
        with open(source.shard, "rb") as handle:
            handle.seek(source.offset)
            data = handle.read(source.size)
        if len(data) != source.size:  # the shard changed or was cut after it was listed
            raise OSError(f"{source}: {len(data)} of {source.size} bytes left in the shard")
        return np.frombuffer(data, dtype=np.uint8)
    return np.fromfile(source, dtype=np.uint8)


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


TEXT_SUFFIXES = (".csv", ".jsonl")


def text_files(root: Path) -> list[Path]:
    """Every .csv/.jsonl file under ``root``, leaving out hidden folders and files (.ipynb_checkpoints/...)."""
    return [path for path in root.rglob("*") if path.suffix.lower() in TEXT_SUFFIXES and path.is_file()
            and not any(part.startswith(".") for part in path.relative_to(root).parts)]


def scan_text_channel(root: Path, channel: str, group: str) -> list[Path]:
    """The text shards of a channel, anywhere under it, in path order: .csv (label, title, content rows)
    and .jsonl ({"label": ..., "title": ..., "content": ...} or {"label": ..., "text": ...} lines).
    Refused when there are none."""
    _require_channel(root, channel, group)
    files = sorted(path for path in text_files(root) if path.stat().st_size > 0)
    if not files:
        raise EmptyChannelError(f"channel {channel!r} at {root} holds no non-empty {' or '.join(TEXT_SUFFIXES)} files")
    return files


def scan_images(root: Path, channel: str, group: str) -> ImageDataset:
    """List the samples of a channel, tar shards if it holds any, else an ImageFolder; ``group`` only
    makes the error messages precise."""
    _require_channel(root, channel, group)
    shards = sorted(path for path in root.rglob(f"*{SHARD_SUFFIX}") if path.is_file())
    if shards:
        return scan_shards(root, shards, channel)
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
    return ImageDataset(root=root, classes=classes, samples=samples)


def scan_image_files(root: Path, channel: str, group: str) -> ImageDataset:
    """scan_images for a reader that opens files by name (TensorFlow's tf.data): tar shards refused."""
    dataset = scan_images(root, channel, group)
    file_samples(dataset, channel)
    return dataset


def file_samples(dataset: ImageDataset, channel: str = "train") -> tuple[list[str], list[int]]:
    """(paths, labels) of an ImageFolder channel; ChannelError for tar shards, which only the PyTorch
    readers (the gRPC data hosts, the homogeneous DataLoader) take."""
    if dataset.shard_ends:
        raise ChannelError(f"channel {channel!r} holds tar shards, which the tensorflow variant cannot read (tf.data opens "
                           "files by name): give it an ImageFolder channel, or use the pytorch variant")
    return [str(source) for source, _ in dataset.samples], [label for _, label in dataset.samples]


class ShardFormatError(ChannelError):
    """A file named .tar that is not an uncompressed tar archive."""


def scan_shards(root: Path, shards: Sequence[Path], channel: str) -> ImageDataset:
    """The samples of every shard, in shard order. Images found loose beside the shards are refused:
    one channel, one layout (which of them would be the dataset?)."""
    loose = next((path for path in root.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()), None)
    if loose is not None:
        raise ChannelError(f"channel {channel!r} at {root} holds tar shards and loose images ({loose.relative_to(root)}): "
                           "keep one layout per channel")
    table, ends, unusable = shard_index(shards)
    if not len(table):
        raise EmptyChannelError(
            f"channel {channel!r} at {root} holds {len(shards)} tar shards but no labelled image in them: expected "
            f"<key>.jpg|jpeg|png members with a <key>.cls or <key>.json label (WebDataset layout)"
        )
    if unusable:
        log.warning("channel %r: %d shard members left out (no label, a bad label, damaged or cut off)", channel, unusable)
    classes = int(table[:, 3].max()) + 1
    if classes > MAX_CLASSES:
        raise ChannelError(f"channel {channel!r}: a label of {classes - 1} would make a {classes}-class model: labels are class "
                           f"indices 0..N-1 (at most {MAX_CLASSES:,} classes), not ids such as WordNet offsets")
    samples = ShardSamples(tuple(map(str, shards)), table[:, 0].astype(np.int32), table[:, 1].copy(), table[:, 2].copy(), table[:, 3].copy())
    return ImageDataset(root=root, classes=tuple(map(str, range(classes))), samples=samples, shard_ends=tuple(ends), unusable=unusable)


def shard_index(shards: Sequence[Path], cache_dir: Path | None = None) -> tuple[np.ndarray, list[int], int]:
    """(int64 [samples, 4] of shard number, offset, size, label; where each shard's samples end; members
    left out) of the shards, read from a node-local cache when one exists, else listed and cached: on a
    node the launcher's channel check lists the shards (on FastFile, a read per member header) and every
    trainer process after it reads the cache. The cache is named after the listing rules' version and
    each shard's path, size, inode and times, is written aside and renamed, and is checked against the
    shards when read: anything wrong with it costs a listing, never a wrong sample."""
    digest = hashlib.sha256(f"{SHARD_INDEX_VERSION}|{MAX_CLASSES}\n".encode())
    for shard in shards:
        stat = shard.stat()
        digest.update(f"{shard}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}|{stat.st_ctime_ns}\n".encode())
    name = f"shard-index-{digest.hexdigest()[:32]}.npz"
    try:
        # Per user and private: a shared temp folder's other users cannot plant an index.
        folder = cache_dir or Path(os.environ.get(SHARD_INDEX_CACHE_ENV) or Path(tempfile.gettempdir()) / f"shard-index-{os.getuid()}")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache: Path | None = folder / name
    except OSError as error:
        log.warning("no folder for the shard index cache (%s): listing the shards", error)
        cache = None
    if cache is not None:
        cached = _read_index(cache, shards)
        if cached is not None:
            return cached
    columns: list[np.ndarray] = [np.zeros((0, 4), dtype=np.int64)]
    ends: list[int] = []
    unusable = 0
    for number, shard in enumerate(shards):
        members, left_out = index_shard(shard)
        columns.append(np.array([(number, offset, size, label) for offset, size, label in members], dtype=np.int64).reshape(-1, 4))
        unusable += left_out
        ends.append((ends[-1] if ends else 0) + len(members))
    table = np.concatenate(columns)
    if cache is not None:
        _write_index(cache, table, ends, unusable)
    return table, ends, unusable


def _read_index(cache: Path, shards: Sequence[Path]) -> tuple[np.ndarray, list[int], int] | None:
    try:
        with np.load(cache, allow_pickle=False) as saved:
            table, ends, unusable = saved["table"], saved["ends"].tolist(), int(saved["unusable"])
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - an empty, cut or foreign file: list again, and replace it
        log.warning("unreadable shard index cache %s (%s): listing the shards again", cache, error)
        cache.unlink(missing_ok=True)
        return None
    sizes = np.array([shard.stat().st_size for shard in shards], dtype=np.int64)
    sound = (
        table.ndim == 2 and table.shape[1] == 4 and table.dtype == np.int64 and len(ends) == len(shards)
        and (not ends or ends[-1] == len(table)) and ends == sorted(ends)
        and (not len(table) or (table[:, 0].min() >= 0 and table[:, 0].max() < len(shards) and table[:, 1:3].min() >= 0
                                and (table[:, 1] + table[:, 2] <= sizes[table[:, 0]]).all()))
    )
    if not sound:
        log.warning("shard index cache %s does not fit the shards: listing them again", cache)
        cache.unlink(missing_ok=True)
        return None
    return table, ends, unusable


def _write_index(cache: Path, table: np.ndarray, ends: list[int], unusable: int) -> None:
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
    try:  # written aside (never through a planted link) and renamed: a reader never sees half a cache
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            np.savez(handle, table=table, ends=np.array(ends, dtype=np.int64), unusable=np.array(unusable))
        os.replace(partial, cache)
    except OSError as error:  # a read-only temp folder costs the next process a listing, nothing else
        log.warning("could not cache the shard index at %s: %s", cache, error)
        partial.unlink(missing_ok=True)


def sample_key(name: str) -> tuple[str, str]:
    """WebDataset's grouping: a member's key is its path up to the first dot of its file name, the rest
    (lower-cased) its kind. Pure."""
    path = PurePosixPath(name)
    stem, _, kind = path.name.partition(".")
    return str(path.with_name(stem)), kind.lower()


# The magic numbers of the compressions a .tar might hide (gzip, bzip2, xz, zstd).
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
LABEL_KINDS = ("cls", "json")  # .cls first: a .json beside it is often metadata


def index_shard(path: Path) -> tuple[list[tuple[int, int, int]], int]:
    """(offset, size, label) of each sample of one shard, and the members that could not be samples, from
    its headers and its small label members. A damaged header is stepped over to the next good one."""
    with path.open("rb") as handle:
        magic = handle.read(6)
    if magic.startswith(_COMPRESSED):
        raise ShardFormatError(f"{path}: a compressed archive; write shards as plain .tar (a member is read at its offset, "
                               "and JPEG and PNG do not compress further)")
    images: dict[str, tuple[int, int]] = {}
    labels: dict[str, dict[str, int | None]] = {}
    size = path.stat().st_size
    lost = 0
    try:
        # ignore_zeros: read past a damaged header (and zero blocks) to the next good one, as GNU tar's -i.
        archive = tarfile.open(path, mode="r:", ignore_zeros=True)
    except tarfile.ReadError as error:
        raise ShardFormatError(f"{path}: not a tar archive ({error})") from None
    with archive:
        for info in archive:
            key, kind = sample_key(info.name)
            if not info.isfile() or info.issparse():  # links, sparse files: no bytes of their own at an offset
                lost += f".{kind}" in IMAGE_SUFFIXES
                continue
            if info.offset_data + info.size > size:  # the shard ends inside this member
                lost += 1
                break
            if f".{kind}" in IMAGE_SUFFIXES:
                lost += key in images  # a second image under one key
                images.setdefault(key, (info.offset_data, info.size))
            elif kind in LABEL_KINDS:
                labels.setdefault(key, {})[kind] = parse_label(kind, archive.extractfile(info).read())  # type: ignore[union-attr]
    # A label whose image is gone (its header damaged) is a lost sample; other kinds (seg.png, txt) are
    # fields a sample may carry, and are not.
    lost += sum(1 for key, found in labels.items() if key not in images and any(value is not None for value in found.values()))
    samples = []
    for key, (offset, length) in images.items():
        found = labels.get(key, {})
        label = next((found[kind] for kind in LABEL_KINDS if found.get(kind) is not None), None)
        if label is None:
            lost += 1
        else:
            samples.append((offset, length, label))
    return samples, lost


def parse_label(kind: str, data: bytes) -> int | None:
    """A class index from a .cls member (the index as text) or a .json one ({"label": index}); None for
    anything else. Pure."""
    try:
        value = json.loads(data)["label"] if kind == "json" else int(data.decode().strip())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def listing_digest(folder: ImageDataset) -> str:
    """A digest of a listing's samples in order (their text with the channel's folder left out, so two
    jobs that mount the channel at other paths agree) and its shards' ends. Pure."""
    root = str(folder.root)
    digest = hashlib.sha256(repr(folder.shard_ends).encode())
    for sample in folder.samples:
        digest.update(repr(sample).replace(root, "").encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


def channel_epoch_order(size: int, seed: int, epoch: int, shard_ends: Sequence[int] = ()) -> list[int]:
    """The order of a channel's ``size`` samples in ``epoch``: a permutation, or over tar shards the
    streaming order (shard_stream_order), drawn from (seed, epoch) alone. Every reader of a whole channel
    draws it so: the homogeneous trainer's ranks (training/trainers/sampling.py) and the data hosts of a
    replicated channel, so a heterogeneous run trains the batches a homogeneous run of the seed trains. Pure."""
    rng = np.random.default_rng([seed, epoch])
    return shard_stream_order(shard_ends, rng) if shard_ends else rng.permutation(size).tolist()


def shard_stream_order(shard_ends: Sequence[int], rng: np.random.Generator, buffer: int = SHARD_SHUFFLE_BUFFER) -> list[int]:
    """One epoch's order over tar shards as a streaming reader makes it: the shards in a shuffled order,
    each read from start to end, through a shuffle buffer of ``buffer`` samples. Every sample once. Pure
    given ``rng``."""
    starts = (0, *shard_ends[:-1])
    stream = [index for shard in rng.permutation(len(shard_ends)) for index in range(starts[shard], shard_ends[shard])]
    return buffered_shuffle(stream, rng, buffer)


def buffered_shuffle(stream: Sequence[int], rng: np.random.Generator, buffer: int) -> list[int]:
    """Hold ``buffer`` items; each next item takes the place of a random held one, which goes out. Pure
    given ``rng``. No buffer: the stream as it comes."""
    if buffer < 1:
        return list(stream)
    held = list(stream[:buffer])
    out = []
    # The slots drawn at once: one generator call per item would cost more than the rest of the loop.
    for item, slot in zip(stream[buffer:], rng.integers(buffer, size=max(0, len(stream) - buffer)).tolist(), strict=True):
        out.append(held[slot])
        held[slot] = item
    rng.shuffle(held)
    return out + held
