"""Epoch accounting on the trainers' side: did every sample of an epoch come exactly once?

Each batch says, per slot, which sample's turn it was and in which of its data host's epochs
(Batch.sample_ids, Batch.epochs). A trainer process keeps, per epoch, the number of samples it received
and the sum of a 64-bit hash of their ids (``EpochLedger``): a few integers per epoch, whatever the
dataset's size, so ledgers of every rank are gathered at the end for free. Summed over the ranks, an
epoch whose count equals the samples it should hold and whose hash sum equals that of exactly those
samples delivered each once (two different multisets of the same size collide with probability ~2⁻⁶⁴);
a count above it, or the same count with another sum, did not. An epoch still being read when training
ended is reported as open, with its count.

Sample ids are indices in a data host's listing: the channel's (the same on every host) for a replicated
channel, so its epochs are the channel's; the host's own shard's for a sharded one, so its epochs are
counted per data host. Pure; numpy only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MASK = (1 << 64) - 1


def sample_hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: uint64 arithmetic wraps, as the mixer needs."""
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_sum(ids: np.ndarray) -> int:
    """The sum of the ids' hashes, modulo 2⁶⁴ (numpy's uint64 sum wraps exactly so)."""
    return int(sample_hash(ids).sum(dtype=np.uint64)) & _MASK


@dataclass
class EpochLedger:
    """One trainer process's receipts: {scope: {epoch: [samples, hash sum]}}; the scope is "channel",
    or the data host's address for a sharded channel."""

    epochs: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    # Every data host's stream thread adds to the same epochs (a replicated channel's).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, scope: str, sample_ids: np.ndarray, epochs: np.ndarray) -> None:
        if not len(sample_ids) or len(sample_ids) != len(epochs):
            return  # a host that tags nothing (or garbles it) is not counted
        sums = {int(epoch): (int((epochs == epoch).sum()), hash_sum(sample_ids[epochs == epoch])) for epoch in np.unique(epochs)}
        with self._lock:
            book = self.epochs.setdefault(scope, {})
            for epoch, (count, digest) in sums.items():
                entry = book.setdefault(epoch, [0, 0])
                entry[0] += count
                entry[1] = (entry[1] + digest) & _MASK

    def as_dict(self) -> dict[str, dict[int, list[int]]]:
        with self._lock:
            return {scope: {epoch: list(entry) for epoch, entry in book.items()} for scope, book in self.epochs.items()}


def merge(ledgers: Iterable[Mapping[str, Mapping[int, list[int]]]]) -> dict[str, dict[int, list[int]]]:
    """Every rank's receipts added up."""
    total: dict[str, dict[int, list[int]]] = {}
    for ledger in ledgers:
        for scope, book in ledger.items():
            for epoch, (count, digest) in book.items():
                entry = total.setdefault(scope, {}).setdefault(int(epoch), [0, 0])
                entry[0] += count
                entry[1] = (entry[1] + digest) & _MASK
    return total


def epoch_report(receipts: Mapping[str, Mapping[int, list[int]]], samples: Mapping[str, int]) -> dict[str, Any]:
    """What the summary says about epochs. ``samples``: per scope, the samples one epoch holds.

    ``exactly_once``: epochs in which every sample came once; ``not_exactly_once``: epochs that came
    whole or more but not as exactly those samples; ``open``: epochs still being read (their counts);
    ``duplicates``: samples that came more than once, at least (an epoch with its count but another hash
    sum had one duplicate and one missing sample at least)."""
    exact, broken, still_open = [], [], {}
    duplicates = 0
    for scope in sorted(receipts):
        expected = samples.get(scope)
        whole_sum = hash_sum(np.arange(expected, dtype=np.uint64)) if expected else None
        for epoch, (count, digest) in sorted(receipts[scope].items()):
            name = str(epoch) if scope == "channel" else f"{scope}/{epoch}"
            if expected is None or count < expected:
                still_open[name] = count
            elif count == expected and digest == whole_sum:
                exact.append(name)
            else:
                broken.append(name)
                duplicates += max(count - expected, 1)
    return {"exactly_once": exact, "not_exactly_once": broken, "open": still_open, "duplicates": duplicates,
            "samples_per_epoch": dict(samples)}
