"""Epoch accounting from receipts: the data host's own tagging (BatchProducer's tasks, slot_tags, the
vision workload's producer) split over trainer ranks, and receipts broken on purpose."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from training.data_service.dataset import ImageDataset
from training.data_service.epochs import SPARE_EPOCH, EpochLedger, epoch_report, hash_sum, merge
from training.data_service.positions import Position
from training.data_service.server import epoch_share, slot_tags
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.samples import BatchRecipe
from training.workload.serving import WorkloadBatchProducer


def host_tasks(samples: int, host: int, hosts: int, batch: int, sharded: bool = False):
    """The (indices, epochs) of a data host's batches, as its producer makes them (a fresh job's)."""
    listing = ImageDataset(Path("."), ("a",), tuple((f"{index}.jpg", 0) for index in range(samples)))
    recipe = BatchRecipe(BUILTIN_WORKLOADS_DIR, "vision", None, listing.samples, {}, 3, ())  # for workers that never start
    producer = WorkloadBatchProducer(listing, recipe, batch_size=batch, workers=1, seed=3, host_index=host, hosts=hosts, sharded=sharded)
    producer._pool.shutdown()  # never started: only its tasks are read
    for indices, _spares, _seed, epochs, _positions in producer._tasks(Position()):
        yield indices, epochs


def receipts(samples: int, hosts: int, batches: int, ranks: int = 2, sharded: bool = False, batch: int = 5) -> dict:
    """Each host's first ``batches`` batches, dealt round-robin to ``ranks`` ledgers, merged."""
    ledgers = [EpochLedger() for _ in range(ranks)]
    for host in range(hosts):
        for number, (indices, epochs) in enumerate(itertools.islice(host_tasks(samples, host, hosts, batch, sharded), batches)):
            ledgers[number % ranks].add(f"host{host}", np.array(indices, dtype=np.uint64), np.array(epochs, dtype=np.uint32))
    return merge(ledger.as_dict() for ledger in ledgers)


@pytest.mark.parametrize(("samples", "hosts"), [(96, 2), (97, 3), (10, 1)])
def test_a_replicated_channels_epochs_are_whole_across_its_hosts_and_the_last_one_incomplete(samples: int, hosts: int) -> None:
    shares = {f"host{host}": epoch_share(samples, host, hosts) for host in range(hosts)}
    batches = -(-2 * max(shares.values()) // 5) + 1  # two epochs of the largest share, and a batch more
    report = epoch_report(receipts(samples, hosts, batches), {"channel": samples}, per_host=False)
    assert report["exactly_once"][:2] == ["0", "1"] and report["samples_per_epoch"] == {"channel": samples}
    assert report["not_exactly_once"] == [] and report["duplicates"] == 0 and report["incomplete"]
    # Each host's part alone is no epoch of the channel: checked per host, none is whole.
    assert epoch_report(receipts(samples, hosts, batches), shares, per_host=True)["exactly_once"] == ([] if hosts > 1 else ["host0/0", "host0/1"])


def test_a_sharded_hosts_epochs_are_its_own_shard() -> None:
    report = epoch_report(receipts(40, 2, 12, sharded=True), {"host0": 40, "host1": 40}, per_host=True)
    assert report["exactly_once"] == ["host0/0", "host1/0"] and report["incomplete"] == {"host0/1": 20, "host1/1": 20}


def test_a_sample_sent_twice_in_an_epoch_is_caught_even_when_the_count_is_right() -> None:
    ledger = EpochLedger()
    ledger.add("h", np.array([0, 1, 2, 3, 3], dtype=np.uint64), np.zeros(5, dtype=np.uint32))  # 3 twice, 4 never
    ledger.add("h", np.array([0, 1, 2, 3, 4, 0], dtype=np.uint64), np.array([1] * 5 + [2], dtype=np.uint32))
    ledger.add("h", np.array([1, 2, 3, 4, 4, 0], dtype=np.uint64), np.full(6, 2, dtype=np.uint32))  # one too many
    report = epoch_report(ledger.as_dict(), {"h": 5}, per_host=True)
    assert report["exactly_once"] == ["h/1"] and report["not_exactly_once"] == ["h/0", "h/2"] and report["duplicates"] == 1 + 2


def test_spares_are_outside_every_epoch_and_a_failed_samples_turn_still_counts() -> None:
    # Slot 1's sample (index 11) did not decode: the next due one (12) moved up and a spare (90) filled
    # the last slot; 11's turn is listed after the slots.
    ids, epochs = slot_tags([10, 11, 12], [90, 91, 92], [4, 4, 5], slots=[0, 2, 3], failed=[1])
    assert ids == [10, 12, 90, 11] and epochs == [4, 5, SPARE_EPOCH, 4]
    ledger = EpochLedger()
    ledger.add("h", np.array(ids, dtype=np.uint64), np.array(epochs, dtype=np.uint32))
    assert ledger.as_dict() == {"epochs": {"h": {4: [2, hash_sum(np.array([10, 11], dtype=np.uint64))], 5: [1, hash_sum(np.array([12], dtype=np.uint64))]}},
                                "spares": 1, "untagged_batches": 0}


def test_batches_without_tags_are_counted_apart_and_the_sum_is_modulo_two_to_the_64() -> None:
    ledger = EpochLedger()
    ledger.add("h", np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint32))
    ledger.add("h", np.array([1, 2], dtype=np.uint64), np.array([0], dtype=np.uint32))  # lengths disagree
    assert ledger.as_dict() == {"epochs": {}, "spares": 0, "untagged_batches": 2}
    ids = np.arange(1000, dtype=np.uint64)
    assert hash_sum(ids) == sum(hash_sum(ids[i : i + 1]) for i in range(1000)) % 2**64


def test_a_data_hosts_worker_tags_what_it_put_in_each_slot_after_a_decode_error(images: Path, tmp_path: Path) -> None:
    """The vision workload's worker, as a data host's worker process runs it (here in this process)."""
    from training.data_service import codec
    from training.data_service.dataset import scan_images
    from training.workload import serving
    from training.workload.contract import load_workload, resolve_hyperparameters

    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not a jpeg")
    folder = scan_images(images, "train", "g")
    listing = ImageDataset(folder.root, folder.classes, (*folder.samples[:8], (str(broken), 0)))
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": "16"})
    serving._init_workload_worker(serving.recipe_for(vision, listing, packages_dir=None, hyperparameters=hyperparameters, seed=1))
    payload, skipped = serving._make_workload_batch([0, 8, 2], [5, 6, 7], [1, 2], [3, 3, 4], [30, 31, 40])
    batch = codec.decode_batch(payload)
    assert skipped == 1 and batch.features["image"].shape == (3, 3, 16, 16) and batch.skipped_samples == 1
    assert batch.sample_ids.tolist() == [0, 2, 5, 8] and batch.epochs.tolist() == [3, 4, SPARE_EPOCH, 3]
    assert batch.positions.tolist() == [30, 31, 40]  # the due samples' places in the host's order, the skipped one's too
