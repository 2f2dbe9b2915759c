"""How much of the machine other programs used while we measured: the demo's and the benches' guard
against a figure taken on a busy machine.

    with OtherLoad() as load:
        ...                      # run the emulated jobs
    load.other_cores             # mean CPUs' worth used by processes outside this one's tree

The emulated cluster shares the machine's cores with whatever else runs; a build, a test suite or a
browser taking a core halves a data host here and turns a saving into a loss. The machine's busy CPU
time (psutil.cpu_times, idle and I/O wait left out) less this process tree's own (this process, its
live descendants, and the reaped ones counted in os.times) is what others took.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil

SAMPLE_S = 0.5


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (every core)."""
    times = psutil.cpu_times()
    return sum(value for name, value in times._asdict().items() if name not in ("idle", "iowait", "guest", "guest_nice"))


def own_seconds(root: psutil.Process, live: dict[int, float]) -> float:
    """CPU seconds of this process, its reaped descendants, and its live ones (``live``: each pid's last
    reading, updated here, kept for a descendant that ended before it was reaped)."""
    for process in root.children(recursive=True):
        try:
            times = process.cpu_times()
            live[process.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    mine = os.times()
    reaped = mine.children_user + mine.children_system
    current = {child.pid for child in root.children(recursive=True)}
    for pid in [pid for pid in live if pid not in current]:
        del live[pid]  # reaped (or gone): its time is in ``reaped`` now
    return mine.user + mine.system + reaped + sum(live.values())


def other_cores(busy_delta_s: float, own_delta_s: float, wall_s: float) -> float:
    """Mean CPUs' worth others used over ``wall_s``. Pure."""
    if wall_s <= 0:
        return 0.0
    return max(0.0, busy_delta_s - own_delta_s) / wall_s


@dataclass
class OtherLoad:
    """Samples, in a thread, the CPU others use while the block runs; ``other_cores`` and ``peak_cores``
    once it has ended."""

    sample_s: float = SAMPLE_S
    other_cores: float = 0.0
    peak_cores: float = 0.0

    def __enter__(self) -> OtherLoad:
        self._stop = threading.Event()
        self._root = psutil.Process()
        self._live: dict[int, float] = {}
        self._start = (time.monotonic(), busy_seconds(), own_seconds(self._root, self._live))
        self._thread = threading.Thread(target=self._watch, name="other-load", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        last = self._start
        while not self._stop.wait(self.sample_s):
            now = (time.monotonic(), busy_seconds(), own_seconds(self._root, self._live))
            self.peak_cores = max(self.peak_cores, other_cores(now[1] - last[1], now[2] - last[2], now[0] - last[0]))
            last = now

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        end = (time.monotonic(), busy_seconds(), own_seconds(self._root, self._live))
        self.other_cores = other_cores(end[1] - self._start[1], end[2] - self._start[2], end[0] - self._start[0])
