"""How much of the emulated cluster's CPUs other programs used while we measured: the demo's guard
against a figure taken on a busy machine.

    with OtherLoad(cpus={0, 1}) as load:
        ...                      # run the emulated jobs, pinned to those CPUs
    load.other_cores             # mean CPUs' worth used there by processes outside this one's tree

The emulated cluster shares the machine's cores with whatever else runs; a build, a test suite or a
browser taking a core halves a data host here and turns a saving into a loss. On the CPUs the emulated
hosts run on, the time spent in user and system mode (interrupts, steal and idle left out: no program's)
less this process tree's own is what others took. This tree's own is this process's and every
descendant's, live or reaped: os.times' children fields hold the reaped ones, and each live descendant's
own children fields hold the ones it reaped, so a host's worker that ended is counted, once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil


def busy_seconds(cpus: Iterable[int] | None = None) -> float:
    """CPU seconds spent in user and system mode since boot, on ``cpus`` (default: every CPU)."""
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = range(len(per_cpu)) if cpus is None else [cpu for cpu in cpus if cpu < len(per_cpu)]
    return sum(per_cpu[cpu].user + per_cpu[cpu].nice + per_cpu[cpu].system for cpu in chosen)


def own_seconds() -> float:
    """CPU seconds of this process and all its descendants, live or ended."""
    mine = os.times()
    total = mine.user + mine.system + mine.children_user + mine.children_system
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # ended meanwhile: its time is in its parent's children fields, or ours, once reaped
        total += times.user + times.system + times.children_user + times.children_system
    return total


def other_cores(busy_delta_s: float, own_delta_s: float, wall_s: float) -> float:
    """Mean CPUs' worth others used over ``wall_s``. Pure."""
    if wall_s <= 0:
        return 0.0
    return max(0.0, busy_delta_s - own_delta_s) / wall_s


@dataclass
class OtherLoad:
    """The CPU others used on ``cpus`` (default: every CPU) while the block ran; ``other_cores`` once it ended."""

    cpus: frozenset[int] | None = None
    other_cores: float = 0.0
    _start: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def __enter__(self) -> OtherLoad:
        self._start = (time.monotonic(), busy_seconds(self.cpus), own_seconds())
        return self

    def __exit__(self, *_: object) -> None:
        end = (time.monotonic(), busy_seconds(self.cpus), own_seconds())
        self.other_cores = other_cores(end[1] - self._start[1], end[2] - self._start[2], end[0] - self._start[0])
