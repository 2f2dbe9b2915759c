"""Epoch accounting on the trainers' side: did every sample of a data host's epoch reach training exactly
once?

Each batch says which sample is in each slot and whose turn in which of its data host's epochs it was, and
which due samples did not decode (Batch.sample_ids, Batch.epochs; a spare that filled a slot is outside
every epoch). A trainer process counts a batch when it hands it to training (not when it arrives: the
batches prefetched when training ends were never trained), and keeps per data host and epoch the number of
turns and the sum of a 64-bit hash of their sample ids (``EpochLedger``): a few integers per epoch,
whatever the dataset's size, so every rank's ledger is gathered at the end for nothing. Summed over the
ranks, an epoch whose count equals the samples it holds (a sharded channel: each host's own shard, whose ids
are its own; a replicated one: the channel, whose epoch the hosts split)
and whose hash sum equals that of exactly those samples had each once (splitmix64 is a bijection: one sample twice and one missing
never collide; other differences collide with probability ~2⁻⁶⁴); more turns, or the same count with another
sum, did not. An epoch with fewer turns is ``incomplete``: one being read when training ended, or one whose
batches went with a stream that broke (the server does not send a batch twice; a lost host is in the
summary's lost_data_hosts).

The epochs are the data hosts' epochs of this job: a resumed job's hosts start a new order. Pure; numpy only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MASK = (1 << 64) - 1
# The epoch of a spare: a sample drawn to fill the slot of one that did not decode, outside every epoch.
SPARE_EPOCH = 2**32 - 1


def sample_hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id (uint64 arithmetic wraps, as the mixer needs)."""
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_sum(ids: np.ndarray) -> int:
    """The sum of the ids' hashes, modulo 2⁶⁴ (numpy's uint64 sum wraps exactly so)."""
    return int(sample_hash(ids).sum(dtype=np.uint64)) & _MASK


def _credit(book: dict[int, list[int]], epoch: int, count: int, digest: int) -> None:
    """Add ``count`` turns with hash sum ``digest`` to ``book``'s epoch (receipts add up, sums modulo 2⁶⁴)."""
    entry = book.setdefault(int(epoch), [0, 0])
    entry[0] += count
    entry[1] = (entry[1] + digest) & _MASK


@dataclass
class EpochLedger:
    """One trainer process's receipts, per data host (its address) and epoch: [turns, hash sum]."""

    epochs: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    spares: int = 0  # samples trained outside any epoch (filling a slot after a decode error)
    untagged_batches: int = 0  # from a data host that sends no tags: not counted
    # Every data host's stream adds here (the trainer's thread, but kept safe for any caller).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, scope: str, sample_ids: np.ndarray, epochs: np.ndarray) -> None:
        with self._lock:
            if not len(sample_ids) or len(sample_ids) != len(epochs):
                self.untagged_batches += 1
                return
            spare = epochs == SPARE_EPOCH
            self.spares += int(spare.sum())
            sample_ids, epochs = sample_ids[~spare], epochs[~spare]
            book = self.epochs.setdefault(scope, {})
            for epoch in np.unique(epochs).tolist():
                chosen = epochs == epoch
                _credit(book, epoch, int(chosen.sum()), hash_sum(sample_ids[chosen]))

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"epochs": {scope: {epoch: list(entry) for epoch, entry in book.items()} for scope, book in self.epochs.items()},
                    "spares": self.spares, "untagged_batches": self.untagged_batches}


def last_epochs(receipts: Mapping[str, Any]) -> dict[str, int]:
    """The highest epoch of each data host with receipts (EpochLedger.as_dict, or merge's). Pure."""
    return {scope: max(int(epoch) for epoch in book) for scope, book in receipts.get("epochs", {}).items() if book}


def merge(ledgers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's receipts (EpochLedger.as_dict) added up."""
    total: dict[str, Any] = {"epochs": {}, "spares": 0, "untagged_batches": 0}
    for ledger in ledgers:
        total["spares"] += ledger.get("spares", 0)
        total["untagged_batches"] += ledger.get("untagged_batches", 0)
        for scope, book in ledger.get("epochs", {}).items():
            for epoch, (count, digest) in book.items():
                _credit(total["epochs"].setdefault(scope, {}), epoch, count, digest)
    return total


def epoch_report(receipts: Mapping[str, Any], samples: Mapping[str, int], per_host: bool) -> dict[str, Any]:
    """What the summary says about epochs (see the module docstring). ``per_host``: each host serves its
    own shard (ids are its own), ``samples`` gives each host's shard size; else the hosts split each of the
    channel's epochs, which is checked whole: the hosts' receipts of epoch e together against the
    channel's samples (``samples`` is {"channel": n})."""
    books: Mapping[str, Mapping[int, list[int]]] = receipts.get("epochs", {})
    expected = dict(samples)
    if not per_host:
        channel: dict[int, list[int]] = {}
        for book in books.values():
            for epoch, (count, digest) in book.items():
                _credit(channel, epoch, count, digest)
        books = {"channel": channel}
    exact, broken, incomplete = [], [], {}
    duplicates = 0
    for scope in sorted(books):
        whole = expected.get(scope)
        whole_sum = hash_sum(np.arange(whole, dtype=np.uint64)) if whole else None
        for epoch, (count, digest) in sorted(books[scope].items()):
            name = f"{scope}/{epoch}" if per_host else str(epoch)
            if whole is None or count < whole:
                incomplete[name] = count
            elif count == whole and digest == whole_sum:
                exact.append(name)
            else:
                broken.append(name)
                duplicates += max(count - whole, 1)
    return {"scope": "data host" if per_host else "channel", "exactly_once": exact, "not_exactly_once": broken,
            "incomplete": incomplete, "duplicates": duplicates, "samples_per_epoch": expected,
            "spares": receipts.get("spares", 0), "untagged_batches": receipts.get("untagged_batches", 0)}
