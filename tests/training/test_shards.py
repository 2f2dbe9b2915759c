"""Tar-shard channels (WebDataset layout): listing, reading a member at its offset, what a damaged shard
leaves usable, the streaming order, and the readers that take them (the vision workload's batches, on a
data host or in the homogeneous DataLoader) or refuse them (TensorFlow's)."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from training.data_service.dataset import (
    ChannelError,
    EmptyChannelError,
    ShardFormatError,
    TarMember,
    buffered_shuffle,
    read_sample,
    sample_key,
    scan_image_files,
    scan_images,
    shard_stream_order,
)
from training.data_service.server import sample_order
from training.local.images import add_member, write_shards
from training.trainers.sampling import EndlessSampler
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.contract import load_workload, resolve_hyperparameters
from training.workload.samples import make_batch
from training.workload.serving import recipe_for


def contents(dataset) -> list[tuple[bytes, int]]:
    return sorted((read_sample(source).tobytes(), label) for source, label in dataset.samples)


def test_the_shards_hold_the_image_folders_files_byte_for_byte_with_their_labels(images: Path, image_shards: Path) -> None:
    folder, shards = scan_images(images, "train", "g"), scan_images(image_shards, "train", "g")
    assert (folder.layout, shards.layout) == ("ImageFolder", "tar shards")
    # A data host's log names where its samples came from: the layout it scanned, or the workload's own
    # listing (a CSV of paths is not an ImageFolder, whatever its items are).
    assert (folder.described(), shards.described()) == ("in ImageFolder", "in tar shards")
    listed = dataclasses.replace(folder, lister="tabular.list_samples")
    assert listed.described() == "from tabular.list_samples"
    assert dataclasses.replace(shards, lister="vision.list_samples").described() == "from vision.list_samples over tar shards"
    assert shards.shard_ends == (16, 32, 48, 64, 80, 96) and shards.unusable == 0
    assert len(shards.classes) == len(folder.classes) == 4
    assert contents(shards) == contents(folder)
    assert all(isinstance(source, TarMember) for source, _ in shards.samples)


def test_the_shards_of_an_image_folder_tree_are_its_files(images: Path, tmp_path: Path) -> None:
    from training.local.images import folder_samples

    write_shards(tmp_path, folder_samples(images), per_shard=40)
    shards = scan_images(tmp_path, "train", "g")
    assert shards.shard_ends == (40, 80, 96) and contents(shards) == contents(scan_images(images, "train", "g"))


def test_files_with_dots_in_their_names_keep_their_images_and_shards_go_into_a_new_folder(images: Path, tmp_path: Path) -> None:
    from training.local.images import folder_samples

    source = tmp_path / "src"
    for name in ("cat/cat.0.jpg", "cat/cat.1.jpg", "dog/dog.0.jpg"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(jpeg(images, len(list(source.rglob("*.jpg")))))
    write_shards(tmp_path / "out", folder_samples(source))
    shards = scan_images(tmp_path / "out", "train", "g")
    assert shards.unusable == 0 and contents(shards) == contents(scan_images(source, "train", "g"))
    with pytest.raises(ValueError, match="not empty"):
        write_shards(tmp_path / "out", folder_samples(source))
    with pytest.raises(ValueError, match="holds tar shards already"):
        list(folder_samples(tmp_path / "out"))


def test_keys_group_members_as_webdataset_does() -> None:
    assert sample_key("n01440764/n01440764_10026.JPEG") == ("n01440764/n01440764_10026", "jpeg")
    assert sample_key("a/b.c/x.seg.png") == ("a/b.c/x", "seg.png")  # the key ends at the file name's first dot
    assert sample_key("x.cls") == ("x", "cls")


def shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            add_member(archive, name, data)
    return path


def jpeg(images: Path, index: int = 0) -> bytes:
    return sorted(images.rglob("*.jpg"))[index].read_bytes()


def labelled(dataset) -> list[tuple[bytes, int]]:
    return sorted((read_sample(source).tobytes(), label) for source, label in dataset.samples)


def test_members_that_cannot_be_samples_are_left_out_and_counted(images: Path, tmp_path: Path) -> None:
    shard(tmp_path / "a.tar", [
        ("good.jpg", jpeg(images)), ("good.cls", b"2\n"),
        ("json.jpg", jpeg(images, 1)), ("json.json", b'{"label": 1}'),
        ("both.jpg", jpeg(images, 6)), ("both.cls", b"3"), ("both.json", b'{"filename": "metadata"}'),  # .cls wins
        ("nolabel.jpg", jpeg(images, 2)),
        ("badlabel.jpg", jpeg(images, 3)), ("badlabel.cls", b"cat"),
        ("negative.jpg", jpeg(images, 4)), ("negative.cls", b"-1"),
        ("boollabel.jpg", jpeg(images, 5)), ("boollabel.json", b'{"label": true}'),
        ("good.png", jpeg(images, 7)),  # a second image under one key
        ("mask.seg.png", jpeg(images, 8)), ("mask.cls", b"0"),  # a segmentation mask is not the sample's image
        ("orphan.cls", b"3"),  # a label whose image is gone
        ("extra.jpg", jpeg(images, 9)), ("extra.cls", b"0"), ("extra.seg.png", jpeg(images, 10)),  # a sample with a field
    ])
    dataset = scan_images(tmp_path, "train", "g")
    assert labelled(dataset) == sorted([(jpeg(images), 2), (jpeg(images, 1), 1), (jpeg(images, 6), 3), (jpeg(images, 9), 0)])
    assert dataset.unusable == 7 and dataset.classes == ("0", "1", "2", "3")


def test_links_and_a_damaged_header_cost_only_their_own_members(images: Path, tmp_path: Path) -> None:
    members = [(f"{n}.{kind}", jpeg(images, n) if kind == "jpg" else b"1") for n in range(6) for kind in ("jpg", "cls")]
    path = shard(tmp_path / "a.tar", members)
    with tarfile.open(path, mode="a") as archive:  # a hard link to an image: no bytes of its own
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.LNKTYPE, "0.jpg"
        archive.addfile(link)
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as archive:
        third = next(info for info in archive if info.name == "2.jpg")
    data[third.offset + 148 : third.offset + 156] = b"0000000\x00"  # its checksum no longer matches
    path.write_bytes(bytes(data))
    dataset = scan_images(tmp_path, "train", "g")
    assert labelled(dataset) == sorted((jpeg(images, n), 1) for n in (0, 1, 3, 4, 5))  # the rest of the shard is kept
    assert dataset.unusable == 2  # 2.jpg (its label is left without it), link.jpg


def test_a_class_index_past_any_model_head_is_refused_by_name(images: Path, tmp_path: Path) -> None:
    shard(tmp_path / "a.tar", [("a.jpg", jpeg(images)), ("a.cls", b"1440764")])  # a WordNet offset, not an index
    with pytest.raises(ChannelError, match="labels are class indices"):
        scan_images(tmp_path, "train", "g")


def test_the_listing_pickles_as_columns_for_the_workers(image_shards: Path) -> None:
    import pickle

    dataset = scan_images(image_shards, "train", "g")
    copy = pickle.loads(pickle.dumps(dataset.samples))
    assert [copy[index] for index in range(len(copy))] == [dataset.samples[index] for index in range(len(dataset))]
    assert len(pickle.dumps(dataset.samples)) < 40 * len(dataset) + 2000


def test_a_corrupt_image_member_is_skipped_and_counted_like_a_damaged_file(images: Path, tmp_path: Path) -> None:
    shard(tmp_path / "a.tar", [("ok.jpg", jpeg(images)), ("ok.cls", b"0"), ("bad.jpg", b"\xff\xd8 not a jpeg"), ("bad.cls", b"1")])
    dataset = scan_images(tmp_path, "train", "g")
    bad = next(i for i, (source, _) in enumerate(dataset.samples) if source.size == len(b"\xff\xd8 not a jpeg"))
    good = 1 - bad
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": "16"})
    recipe = recipe_for(vision, dataset, packages_dir=None, hyperparameters=hyperparameters, seed=0)
    batch, skipped = make_batch(vision, recipe, [bad, good], [good, good], [0, 0])  # as a data host's worker makes it
    assert skipped == 1 and batch["label"].tolist() == [0, 0] and batch["image"].shape == (2, 3, 16, 16)


def test_shard_layouts_a_reader_cannot_take_are_refused_by_name(images: Path, tmp_path: Path) -> None:
    compressed = tmp_path / "gz"
    compressed.mkdir()
    shard(tmp_path / "plain.tar", [("a.jpg", jpeg(images)), ("a.cls", b"0")])
    (compressed / "a.tar").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))
    with pytest.raises(ShardFormatError, match="a compressed archive"):
        scan_images(compressed, "train", "g")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "plain.tar", mixed / "a.tar")
    (mixed / "loose").mkdir()
    (mixed / "loose" / "b.jpg").write_bytes(jpeg(images))
    with pytest.raises(ChannelError, match="tar shards and loose images"):
        scan_images(mixed, "train", "g")
    unlabelled = tmp_path / "unlabelled"
    unlabelled.mkdir()
    shard(unlabelled / "a.tar", [("a.jpg", jpeg(images))])
    with pytest.raises(EmptyChannelError, match="no labelled image"):
        scan_images(unlabelled, "train", "g")


def test_tensorflow_readers_refuse_tar_shards_by_name(images: Path, image_shards: Path) -> None:
    from training.data_host import CHANNEL_CHECKS
    from training.variants import VARIANTS

    assert len(scan_image_files(images, "train", "g")) == 96
    with pytest.raises(ChannelError, match="tensorflow variant cannot read"):
        scan_image_files(image_shards, "train", "g")
    assert CHANNEL_CHECKS[VARIANTS["tensorflow"].input_format] is scan_image_files
    assert len(CHANNEL_CHECKS[VARIANTS["pytorch"].input_format](image_shards, "train", "g")) == 96


@pytest.mark.parametrize("ends", [(5,), (3, 10, 11, 30), tuple(range(7, 7 * 40 + 1, 7))])
@pytest.mark.parametrize("buffer", [0, 1, 4, 1000])
def test_a_streamed_epoch_holds_every_sample_once(ends: tuple[int, ...], buffer: int) -> None:
    order = shard_stream_order(ends, np.random.default_rng(3), buffer)
    assert sorted(order) == list(range(ends[-1]))


def test_without_a_buffer_each_shard_is_read_through_in_order() -> None:
    ends = (4, 9, 12)
    order = shard_stream_order(ends, np.random.default_rng(1), buffer=0)
    runs = [list(group) for _, group in itertools.groupby(order, key=lambda index: sum(index >= end for end in ends))]
    assert len(runs) == 3 and all(run == list(range(run[0], run[0] + len(run))) for run in runs)
    assert buffered_shuffle(list(range(10)), np.random.default_rng(0), 3) != list(range(10))


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_data_hosts_of_a_replicated_shard_channel_send_every_sample_once_per_epoch(hosts: int) -> None:
    ends = (10, 25, 33, 50)
    for epoch in range(3):
        sent = Counter()
        for host in range(hosts):
            stream = sample_order(50, seed=7, host_index=host, hosts=hosts, shard_ends=ends)
            per_epoch = [len(range(host, 50, hosts))] * 3
            taken = list(itertools.islice(stream, sum(per_epoch[: epoch + 1])))
            sent.update(taken[sum(per_epoch[:epoch]) :])
        assert sent == Counter(range(50)), epoch


def test_the_dataloader_reads_shards_in_streaming_order_and_every_sample_once_per_epoch() -> None:
    ends = (6, 12, 18, 24)
    shares = [list(itertools.islice(iter(EndlessSampler(24, rank=rank, world_size=2, seed=1, shard_ends=ends)), 12)) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == list(range(24))
    streamed = shard_stream_order(ends, np.random.default_rng([1, 0]))
    assert shares == [streamed[0::2], streamed[1::2]]  # the streaming order, not a permutation of its own
    only = list(itertools.islice(iter(EndlessSampler(24, rank=0, world_size=1, seed=1, shard_ends=ends)), 24))
    assert only == streamed != list(itertools.islice(iter(EndlessSampler(24, rank=0, world_size=1, seed=1)), 24))


def test_sharded_tar_hosts_with_different_classes_agree_on_the_highest_and_folders_must_match() -> None:
    from training.data_service import data_service_pb2 as pb
    from training.trainers.service_summary import shard_classes

    def info(host: str, classes: int | list[str], indices: bool) -> pb.DatasetInfo:
        names = [str(index) for index in range(classes)] if isinstance(classes, int) else classes
        return pb.DatasetInfo(host=host, classes=names, sharded=True, labels_are_indices=indices)

    # Class-sorted shards dealt over two hosts: one holds classes 0-4, the other up to 9.
    assert shard_classes([info("algo-1", 5, True), info("algo-2", 10, True)]) == [str(index) for index in range(10)]
    assert shard_classes([info("algo-1", ["a", "b"], False), info("algo-2", ["a", "b"], False)]) == ["a", "b"]
    with pytest.raises(ChannelError, match="different class folders"):
        shard_classes([info("algo-1", ["a", "b"], False), info("algo-2", ["a"], False)])


def test_a_nodes_later_processes_read_the_shard_index_its_first_one_listed(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.data_service import dataset as dataset_module

    channel = tmp_path / "channel"
    channel.mkdir()
    shard(channel / "a.tar", [("a.jpg", jpeg(images)), ("a.cls", b"1")])
    monkeypatch.setenv(dataset_module.SHARD_INDEX_CACHE_ENV, str(tmp_path / "cache"))
    first = scan_images(channel, "train", "g")
    listed = []
    monkeypatch.setattr(dataset_module, "index_shard", lambda path: listed.append(path) or ([], 0))
    again = scan_images(channel, "train", "g")  # from the cache: nothing listed
    assert listed == [] and labelled(again) == labelled(first) and again.shard_ends == first.shard_ends
    shard(channel / "a.tar", [("a.jpg", jpeg(images, 1)), ("a.cls", b"1"), ("b.jpg", jpeg(images, 2)), ("b.cls", b"0")])
    with pytest.raises(EmptyChannelError):  # a changed shard is listed again (here by the stand-in, which finds nothing)
        scan_images(channel, "train", "g")
    assert listed == [channel / "a.tar"]


def test_a_cache_that_is_cut_foreign_or_unwritable_costs_a_listing_never_a_wrong_sample(images: Path, tmp_path: Path) -> None:
    from training.data_service.dataset import shard_index

    channel = tmp_path / "channel"
    channel.mkdir()
    shards = [shard(channel / "a.tar", [("a.jpg", jpeg(images)), ("a.cls", b"1"), ("b.jpg", jpeg(images, 1)), ("b.cls", b"0")])]
    cache_dir = tmp_path / "cache"
    truth = shard_index(shards, cache_dir)
    (cached,) = cache_dir.glob("*.npz")
    for damage in (b"", b"PK\x03\x04 cut", cached.read_bytes()[:40]):
        cached.write_bytes(damage)
        again = shard_index(shards, cache_dir)
        assert again[0].tolist() == truth[0].tolist() and again[1:] == truth[1:]
    # A readable index that does not fit these shards (a member past the shard's end): listed again.
    np.savez(cached, table=np.array([[0, 10**9, 10, 0]], dtype=np.int64), ends=np.array([1]), unusable=np.array(0))
    assert shard_index(shards, cache_dir)[0].tolist() == truth[0].tolist()
    # No folder can be made for it (here a file stands where it would be; on a host, a read-only /tmp).
    (tmp_path / "a-file").write_text("")
    assert shard_index(shards, tmp_path / "a-file" / "cache")[0].tolist() == truth[0].tolist()
