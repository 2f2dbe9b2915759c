"""Where each data host's stream stands, across the jobs of one run: what a checkpoint records as trained,
and where a resumed job's data hosts start, so that a resumed run trains the rest of its interrupted epoch
and nothing of it twice.

A data host's order is endless and depends only on the run's seed and the job's data layout (the number
of data hosts, whether the channel is sharded, the samples each host lists): position p is the
(p mod share)-th sample of the host's epoch p div share (server.sample_order; ``share`` is the samples
one of its epochs holds). Every batch names the positions of its due samples (Batch.positions). A trainer
records the positions of the batches it trained, not merely received: at a stop, the batches prefetched
in its queues were not trained. At each checkpoint the chief folds every rank's into one ``Position`` per
data host (``advance``):

* ``next``: every position below it was trained, except
* ``gaps``: the ranges below ``next`` that were not (batches in flight when the job stopped; a batch lost
  with a broken stream).

A resumed job's trainers send each host its position in their StreamRequest (``to_message``); the host
serves the gaps first, then ``next`` onwards (``serve_positions``). When the layout changed between the
jobs (another number of data hosts, other samples, another seed) the positions mean nothing: the host
starts at the epoch after the last one the first job reached (``resume_plan`` says which, and why).

Pure (numpy and the message classes only); the checkpoint holds ``as_json``'s form.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.data_service import data_service_pb2 as pb

# The most gap ranges a position keeps: each is two varints in the resumed job's StreamRequest, which
# must stay below the servers' 64 KiB request limit (at most 20 bytes a range: 20 KiB). Gaps come from
# the batches each rank held untrained at a stop (a few per rank and host) and from broken streams. Past
# the cap the oldest are given up, and counted (Position.dropped): never silently trained.
MAX_GAP_RANGES = 1000


@dataclass(frozen=True)
class Position:
    """Every position below ``next`` trained, except the [start, end) ranges of ``gaps`` (sorted, disjoint)
    and the ``dropped`` positions of older gaps given up past MAX_GAP_RANGES (never served again)."""

    next: int = 0
    gaps: tuple[tuple[int, int], ...] = ()
    dropped: int = 0

    @property
    def untrained_below_next(self) -> int:
        return sum(end - start for start, end in self.gaps)

    def as_json(self) -> dict[str, Any]:
        return {"next": self.next, "gaps": [list(gap) for gap in self.gaps], "dropped": self.dropped}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Position:
        gaps = tuple((int(start), int(end)) for start, end in value.get("gaps", ()))
        return capped(int(value["next"]), gaps, int(value.get("dropped", 0)))


@dataclass(frozen=True)
class Layout:
    """What makes a position mean the same sample in two jobs: the data hosts (by name), whether each
    serves its own shard, the samples each lists and the seed of the order (not the batch size: a
    position is a sample's)."""

    hosts: tuple[str, ...]
    sharded: bool
    seed: int
    samples: tuple[int, ...]  # per host, in ``hosts``' order
    listings: tuple[str, ...] = ()  # per host, its listing's digest (DatasetInfo.listing_digest)

    def as_json(self) -> dict[str, Any]:
        return {"hosts": list(self.hosts), "sharded": self.sharded, "seed": self.seed, "samples": list(self.samples),
                "listings": list(self.listings)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Layout:
        return cls(tuple(value["hosts"]), bool(value["sharded"]), int(value["seed"]), tuple(int(n) for n in value["samples"]),
                   tuple(value.get("listings", ())))

    def differences(self, other: Layout) -> list[str]:
        """What changed from ``self`` to ``other``, in words (empty: the same layout). Pure."""
        changed = []
        if self.hosts != other.hosts:
            changed.append(f"data hosts {list(self.hosts)} → {list(other.hosts)}")
        if self.sharded != other.sharded:
            changed.append(f"sharded {self.sharded} → {other.sharded}")
        if self.seed != other.seed:
            changed.append(f"seed {self.seed} → {other.seed}")
        if self.samples != other.samples:
            changed.append(f"samples per host {list(self.samples)} → {list(other.samples)}")
        elif self.listings and other.listings and self.listings != other.listings:
            changed.append("the listing (other samples, or another order of them)")
        return changed


def capped(next_: int, gaps: Sequence[tuple[int, int]], dropped: int = 0) -> Position:
    """A Position of at most MAX_GAP_RANGES gaps: the oldest beyond it are given up, and counted. Pure."""
    over = len(gaps) - MAX_GAP_RANGES
    if over > 0:
        dropped += sum(end - start for start, end in gaps[:over])
        gaps = gaps[over:]
    return Position(next_, tuple(gaps), dropped)


def runs(positions: Iterable[int] | np.ndarray) -> list[tuple[int, int]]:
    """The positions as sorted, disjoint [start, end) ranges of consecutive values. Pure."""
    values = np.unique(np.asarray(list(positions) if not isinstance(positions, np.ndarray) else positions, dtype=np.int64))
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(values)]))
    return [(int(values[start]), int(values[end - 1]) + 1) for start, end in zip(starts, ends, strict=True)]


def subtract(ranges: Iterable[tuple[int, int]], removed: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` without ``removed`` (both sorted and disjoint), as sorted disjoint ranges. Pure."""
    cuts = list(removed)
    result: list[tuple[int, int]] = []
    index = 0
    for start, end in ranges:
        while index < len(cuts) and cuts[index][1] <= start:
            index += 1
        cursor, probe = start, index
        while probe < len(cuts) and cuts[probe][0] < end:
            cut_start, cut_end = cuts[probe]
            if cut_start > cursor:
                result.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
            probe += 1
        if cursor < end:
            result.append((cursor, end))
    return result


def union(ranges: Iterable[np.ndarray | Sequence[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The union of any [start, end) ranges (arrays of shape (n, 2), in any order, overlapping or not),
    as sorted disjoint ranges, adjacent ones joined. Vectorised: every rank's ranges of a long run. Pure."""
    parts = [np.asarray(part, dtype=np.int64).reshape(-1, 2) for part in ranges]
    every = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    every = every[every[:, 1] > every[:, 0]]
    if not len(every):
        return []
    every = every[np.argsort(every[:, 0], kind="stable")]
    starts, ends = every[:, 0], np.maximum.accumulate(every[:, 1])
    begins = np.concatenate(([True], starts[1:] > ends[:-1]))  # a new range where nothing before reaches it
    first = np.flatnonzero(begins)
    last = np.concatenate((first[1:] - 1, [len(every) - 1]))
    return [(int(starts[a]), int(ends[b])) for a, b in zip(first, last, strict=True)]


def advance(position: Position, trained: np.ndarray | Iterable[int] | Sequence[np.ndarray]) -> Position:
    """``position`` with the ``trained`` positions added: positions (any order), or a list of arrays of
    [start, end) ranges (``ranges_of``'s: what the ranks recorded). Pure."""
    if isinstance(trained, list) and trained and isinstance(trained[0], np.ndarray) and trained[0].ndim == 2:
        trained_runs = union(trained)
    else:
        trained_runs = runs(trained if isinstance(trained, np.ndarray) else list(trained))
    if not trained_runs:
        return position
    next_ = max(position.next, trained_runs[-1][1])
    pending = list(position.gaps) + ([(position.next, next_)] if next_ > position.next else [])
    return capped(next_, subtract(pending, trained_runs), position.dropped)


def ranges_of(positions: np.ndarray) -> np.ndarray:
    """A batch's positions as an (n, 2) array of [start, end) ranges (one, for a batch of consecutive
    positions: what a trainer records per batch). Pure."""
    return np.asarray(runs(positions), dtype=np.int64).reshape(-1, 2)


def serve_positions(position: Position) -> Iterator[int]:
    """The positions a host serves from ``position``: the gaps, then ``next`` onwards, endlessly. Pure."""
    for start, end in position.gaps:
        yield from range(start, end)
    yield from itertools.count(position.next)


@dataclass(frozen=True)
class ResumePlan:
    """Where each data host of a resumed job starts: its exact position (``positions``), or, when the data
    layout changed, the start of ``start_epoch`` on every host, with ``why``."""

    positions: dict[str, Position] = field(default_factory=dict)
    start_epoch: int = 0
    why: str = ""

    @property
    def exact(self) -> bool:
        return not self.why

    def message(self, host: str) -> pb.DataPosition:
        """The StreamRequest's resume field for ``host`` (a host of a job that started afresh: position 0)."""
        if not self.exact:
            return pb.DataPosition(start_epoch=self.start_epoch)
        return to_message(self.positions.get(host, Position()))

    def summary(self) -> dict[str, Any]:
        if self.exact:
            summary: dict[str, Any] = {"resumed": "exactly", "untrained_positions_served_first": {
                host: position.untrained_below_next for host, position in sorted(self.positions.items())}}
            dropped = {host: position.dropped for host, position in sorted(self.positions.items()) if position.dropped}
            return summary | ({"untrained_positions_given_up": dropped} if dropped else {})
        return {"resumed": f"at data-host epoch {self.start_epoch}", "why": self.why}


def resume_plan(saved: Mapping[str, Any], layout: Layout, last_epochs: Mapping[str, int]) -> ResumePlan:
    """Where a resumed job's hosts start, from a checkpoint's ``saved`` input state ({"layout", "positions"})
    and this job's ``layout``. ``last_epochs``: the highest epoch each host reached in the first job (from
    its epoch ledger), for a changed layout. Pure."""
    before = Layout.from_json(saved["layout"])
    changed = before.differences(layout)
    if changed:
        start = max(last_epochs.values(), default=-1) + 1
        return ResumePlan(start_epoch=start, why="the data layout changed since the checkpoint (" + "; ".join(changed) + "): "
                          f"the rest of the interrupted epoch is not served, the data hosts start at epoch {start}")
    return ResumePlan(positions={host: Position.from_json(value) for host, value in saved["positions"].items()})


def to_message(position: Position) -> pb.DataPosition:
    return pb.DataPosition(next=position.next, gaps=[bound for gap in position.gaps for bound in gap])


def from_message(message: pb.DataPosition, share: int) -> Position:
    """The position a StreamRequest's resume field asks for, on a host whose epochs hold ``share`` samples.
    Raises ValueError for an odd number of gap bounds, or gaps that are not sorted, disjoint and below next."""
    if message.start_epoch:
        return Position(next=message.start_epoch * share)
    bounds = list(message.gaps)
    if len(bounds) % 2:
        raise ValueError(f"{len(bounds)} gap bounds: gaps come as [start, end) pairs")
    gaps = tuple(zip(bounds[::2], bounds[1::2], strict=True))
    previous = 0
    for start, end in gaps:
        if not previous <= start < end <= message.next:
            raise ValueError(f"gap [{start}, {end}) is not sorted, disjoint, non-empty and below next ({message.next})")
        previous = end
    return Position(int(message.next), tuple((int(start), int(end)) for start, end in gaps))
