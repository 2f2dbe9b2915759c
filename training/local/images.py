"""Writes a small image dataset of real JPEG files for the demo, the benchmarks and the tests, as an
ImageFolder tree or as tar shards (WebDataset layout), and turns an ImageFolder tree into tar shards.

Each class has its own hue and stripe orientation under random noise, so a model can learn the classes
and the decoder does real work (JPEG at the given resolution, not a 1-pixel stand-in). The shards hold
byte for byte the files the ImageFolder tree would, so the two layouts train on the same images.

    python -m training.local.images OUT_DIR [--classes 4] [--per-class 64] [--size 160]
    python -m training.local.images OUT_DIR --tar [--per-shard 1000]       # shards of the same images
    python -m training.local.images OUT_DIR --tar --from IMAGE_FOLDER       # shards of your own images
"""

from __future__ import annotations

import argparse
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from training.data_service.dataset import SHARD_SUFFIX, ChannelError, scan_images

# Tar samples are (key, image suffix without the dot, encoded bytes or the file holding them, class index).
Sample = tuple[str, str, bytes | Path, int]


def write_dataset(root: Path, classes: int = 4, per_class: int = 64, size: int = 160, seed: int = 0) -> Path:
    """Create (or reuse, when already complete) ``root/<class>/<n>.jpg``; return root."""
    for key, _suffix, data, _label in generated_samples(classes, per_class, size, seed, skip=lambda key: (root / f"{key}.jpg").exists()):
        path = root / f"{key}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for label in range(classes):  # a class whose files all exist still needs its folder listed
        (root / class_name(label)).mkdir(parents=True, exist_ok=True)
    return root


def class_name(label: int) -> str:
    return f"class_{label:02d}"


def generated_samples(classes: int, per_class: int, size: int, seed: int, skip=lambda key: False) -> Iterator[Sample]:
    """The dataset's JPEGs in class order, encoded as write_dataset saves them (the same bytes)."""
    rng = np.random.default_rng(seed)
    for label in range(classes):
        for index in range(per_class):
            key = f"{class_name(label)}/{index:05d}"
            if skip(key):
                continue
            buffer = io.BytesIO()
            Image.fromarray(class_image(label, classes, size, rng)).save(buffer, format="JPEG", quality=90)
            yield key, "jpg", buffer.getvalue(), label


def class_image(label: int, classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    hue = np.array([np.cos(2 * np.pi * label / classes), np.sin(2 * np.pi * label / classes), 0.5]) * 80 + 120
    angle = np.pi * label / classes
    y, x = np.mgrid[0:size, 0:size]
    stripes = np.sin((x * np.cos(angle) + y * np.sin(angle)) * 0.25 + rng.uniform(0, 2 * np.pi))
    image = hue[None, None, :] + 50 * stripes[..., None] + rng.normal(0, 25, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def folder_samples(root: Path) -> Iterator[Sample]:
    """An ImageFolder tree's files as tar samples (read when their shard is written): key
    ``<class>/<file stem>`` with the stem's dots made underscores (WebDataset's key ends at the first
    dot: ``cat.0.jpg`` would lose its image), label its class index."""
    dataset = scan_images(root, "images", "local")
    if dataset.shard_ends:
        raise ValueError(f"{root} holds tar shards already; --from takes an ImageFolder tree")
    for source, label in dataset.samples:
        path = Path(str(source))
        relative = path.relative_to(root)
        key = "/".join((*relative.parent.parts, relative.stem.replace(".", "_")))
        yield key, path.suffix.lstrip(".").lower(), path, label


def write_shards(out: Path, samples: Iterator[Sample], per_shard: int = 1000, seed: int = 0) -> list[Path]:
    """Write ``samples`` as ``out/shard-NNNNNN.tar``, ``per_shard`` samples each (``<key>.jpg`` then
    ``<key>.cls``), shuffled first: a streaming reader takes a shard's members in order, so each shard
    should hold a mix of the classes. Files are read one shard at a time. ``out`` must be new or empty
    (a shard channel holds one layout); each shard is written under a temporary name and then renamed.
    Returns the shards, in order."""
    if per_shard < 1:
        raise ValueError(f"per_shard must be at least 1, got {per_shard}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: write shards into a new folder")
    items = list(samples)
    keys = [key for key, *_ in items]
    if len(set(keys)) != len(keys):
        raise ValueError("two samples share a key (files that differ only after their first dot): rename them")
    np.random.default_rng(seed).shuffle(items)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for number, begin in enumerate(range(0, len(items), per_shard)):
        path = out / f"shard-{number:06d}{SHARD_SUFFIX}"
        partial = path.with_name(path.name + ".partial")
        # PAX: names of any length (USTAR stops at 100 + 155 characters).
        with tarfile.open(partial, mode="w", format=tarfile.PAX_FORMAT) as archive:
            for key, suffix, data, label in items[begin : begin + per_shard]:
                add_member(archive, f"{key}.{suffix}", data.read_bytes() if isinstance(data, Path) else data)
                add_member(archive, f"{key}.cls", str(label).encode())
        partial.replace(path)
        written.append(path)
    return written


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    archive.addfile(info, io.BytesIO(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=64)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0, help="another seed, other images: a held-out set (e.g. --seed 1)")
    parser.add_argument("--tar", action="store_true", help="write tar shards (WebDataset layout) instead of class folders")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per tar shard")
    parser.add_argument("--from", dest="source", type=Path, help="with --tar: shard this ImageFolder tree instead of generated images")
    args = parser.parse_args()
    if args.source is not None and not args.tar:
        parser.error("--from needs --tar")
    if args.source is not None and not args.source.is_dir():
        parser.error(f"--from {args.source}: no such folder")
    if args.per_shard < 1:
        parser.error(f"--per-shard must be at least 1, got {args.per_shard}")
    if args.tar:
        samples = folder_samples(args.source) if args.source else generated_samples(args.classes, args.per_class, args.size, seed=args.seed)
        try:
            shards = write_shards(args.out_dir, samples, args.per_shard)
        except (ValueError, ChannelError) as error:
            parser.error(str(error))
        print(f"wrote {len(shards)} tar shards under {args.out_dir}")
        return
    root = write_dataset(args.out_dir, args.classes, args.per_class, args.size, seed=args.seed)
    print(f"wrote {args.classes * args.per_class} JPEG files under {root}")


if __name__ == "__main__":
    main()
