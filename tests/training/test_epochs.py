"""Epoch accounting from receipts: the real data-host orders (sample_order), split over trainer ranks
in arrival order, and orders that are broken on purpose."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from training.data_service.epochs import EpochLedger, epoch_report, hash_sum, merge
from training.data_service.server import epoch_share, sample_order


def receipts(samples: int, hosts: int, per_host: int, ranks: int = 2, sharded: bool = False, batch: int = 5) -> list[dict]:
    """Each host's first ``per_host`` samples, in batches dealt round-robin to ``ranks`` ledgers."""
    ledgers = [EpochLedger() for _ in range(ranks)]
    for host in range(hosts):
        share = epoch_share(samples, host, hosts, sharded)
        order = list(itertools.islice(sample_order(samples, seed=3, host_index=host, hosts=hosts, sharded=sharded), per_host))
        for number, begin in enumerate(range(0, per_host, batch)):
            ids = np.array(order[begin : begin + batch], dtype=np.uint64)
            epochs = np.array([position // share for position in range(begin, begin + len(ids))], dtype=np.uint32)
            ledgers[number % ranks].add(f"host{host}" if sharded else "channel", ids, epochs)
    return [ledger.as_dict() for ledger in ledgers]


@pytest.mark.parametrize(("samples", "hosts"), [(96, 2), (97, 3), (10, 1)])
def test_replicated_hosts_epochs_are_whole_and_the_last_one_open(samples: int, hosts: int) -> None:
    per_host = 2 * epoch_share(samples, 0, hosts) + 1  # two epochs of the largest share (host 0's), and a bit
    report = epoch_report(merge(receipts(samples, hosts, per_host)), {"channel": samples})
    assert report["exactly_once"] == ["0", "1"] and report["not_exactly_once"] == [] and report["duplicates"] == 0
    assert 0 < report["open"]["2"] < samples


def test_a_sharded_channel_is_counted_per_data_host() -> None:
    report = epoch_report(merge(receipts(40, 2, 60, sharded=True)), {"host0": 40, "host1": 40})
    assert report["exactly_once"] == ["host0/0", "host1/0"] and report["open"] == {"host0/1": 20, "host1/1": 20}


def test_a_sample_sent_twice_in_an_epoch_is_caught_even_when_the_count_is_right() -> None:
    ledger = EpochLedger()
    ledger.add("channel", np.array([0, 1, 2, 3, 3], dtype=np.uint64), np.zeros(5, dtype=np.uint32))  # 4 twice, 4 never
    ledger.add("channel", np.array([0, 1, 2, 3, 4, 0], dtype=np.uint64), np.array([1] * 5 + [2], dtype=np.uint32))
    ledger.add("channel", np.array([1, 2, 3, 4, 4, 0], dtype=np.uint64), np.full(6, 2, dtype=np.uint32))  # one too many
    report = epoch_report(ledger.as_dict(), {"channel": 5})
    assert report["exactly_once"] == ["1"] and report["not_exactly_once"] == ["0", "2"] and report["duplicates"] == 1 + 2


def test_batches_without_tags_are_not_counted_and_the_sum_is_modulo_two_to_the_64() -> None:
    ledger = EpochLedger()
    ledger.add("channel", np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint32))
    ledger.add("channel", np.array([1, 2], dtype=np.uint64), np.array([0], dtype=np.uint32))  # lengths disagree
    assert ledger.as_dict() == {}
    ids = np.arange(1000, dtype=np.uint64)
    assert hash_sum(ids) == sum(hash_sum(ids[i : i + 1]) for i in range(1000)) % 2**64
