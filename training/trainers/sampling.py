"""Which examples each trainer process reads, for the trainers that read their own input (the homogeneous
PyTorch job and the Trainium text job): an endless, resumable shard per rank, and evaluation shards with
no padded duplicates.

``EndlessSampler`` differs from torch's DistributedSampler in three ways that matter here:

* it never ends: epochs advance inside it, so a DataLoader built on it is iterated once and its workers
  never drain and restart at an epoch boundary (a stall of a second or more per epoch on a fast GPU);
* it starts at any position (``start``: samples this rank already consumed), so a resumed job carries on
  where its checkpoint was taken instead of replaying the first batches of its first epoch;
* every epoch's order is a pure function of (seed, epoch), the same on every rank, each rank taking every
  ``world_size``-th index of it: the ranks' shards are disjoint in every epoch. Over tar shards the order
  is the streaming one (shards shuffled, each read through a shuffle buffer: shard_stream_order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from training.data_service.dataset import channel_epoch_order


class ShardTooSmallError(ValueError):
    """Fewer examples than trainer processes: some rank would have none."""


def epoch_order(size: int, seed: int, epoch: int, *, shuffle: bool = True, shard_ends: Sequence[int] = (), legacy: bool = False) -> list[int]:
    """The order of every example in ``epoch``, the same on every rank. Pure. ``legacy``: the order of
    releases before the data hosts drew the same one (a run resumed from their checkpoint keeps it)."""
    if not shuffle:
        return list(range(size))
    if legacy and not shard_ends:
        return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return channel_epoch_order(size, seed, epoch, shard_ends)  # the data hosts' too: one seed, one order


def rank_share(order: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s part of one epoch's order: every world_size-th index, the tail that would make the
    shares unequal left out (it is a different tail each shuffled epoch). Pure."""
    usable = len(order) - len(order) % world_size
    return order[rank:usable:world_size]


class EndlessSampler(Sampler[int]):
    def __init__(
        self, size: int, *, rank: int, world_size: int, seed: int, start: int = 0, shuffle: bool = True, shard_ends: Sequence[int] = ()
    ) -> None:
        if size // world_size == 0:
            raise ShardTooSmallError(f"{size} examples cannot give each of {world_size} trainer processes one")
        self.size, self.rank, self.world_size, self.seed, self.start, self.shuffle = size, rank, world_size, seed, start, shuffle
        self.shard_ends = tuple(shard_ends)

    @property
    def per_epoch(self) -> int:
        """Examples this rank reads per epoch."""
        return self.size // self.world_size

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, offset in it) after ``consumed`` samples of this rank."""
        return divmod(consumed, self.per_epoch)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = self.position(self.start)
        while True:
            order = epoch_order(self.size, self.seed, epoch, shuffle=self.shuffle, shard_ends=self.shard_ends)
            yield from rank_share(order, self.rank, self.world_size)[offset:]
            epoch, offset = epoch + 1, 0


@dataclass(frozen=True)
class EvalBatch:
    indices: list[int]  # always batch_size long: shapes stay constant (one compiled graph on XLA)
    valid: int  # how many of them count; the rest repeat index 0 to fill the batch


def eval_batches(size: int, *, rank: int, world_size: int, batch_size: int) -> list[EvalBatch]:
    """This rank's evaluation batches: every example exactly once across the ranks (indices rank,
    rank + world_size, ...), the last batch filled with padding that is not counted. Pure."""
    mine = list(range(rank, size, world_size))
    batches = []
    for begin in range(0, len(mine), batch_size):
        chunk = mine[begin : begin + batch_size]
        batches.append(EvalBatch(chunk + [0] * (batch_size - len(chunk)), len(chunk)))
    return batches
