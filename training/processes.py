"""Processes on a host, as every role of the launcher handles them: exit statuses, the trees of processes
a role started and their killing, the host's GPUs, and the gap that says a watcher itself did not run."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

log = logging.getLogger("training.processes")


# Exit code for a job that is wrong before anything ran (bad config, bad input), as argparse uses.
CONFIG_ERROR_EXIT = 2


def gpu_count() -> int:
    """GPUs on this host, without importing a framework into the launcher."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False)
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def exit_status(returncode: int) -> int:
    """A child killed by signal N reports -N; a shell reports 128 + N. Never 0 for a killed child."""
    return 128 - returncode if returncode < 0 else returncode


# A gap longer than this between two looks of a watcher at its clock: the watcher itself did not run (its
# host was frozen and continued, its VM paused), and the silence it would see in that gap is not the
# watched processes'. Far above the watchers' own periods (0.1 s and 0.5 s), far below every bound.
PAUSED_S = 5.0


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant, parents first, from /proc (session boundaries do not stop it:
    torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of /proc/<pid>/stat is the parent pid; the command name before it may hold spaces.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
        children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop(0)
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree


def kill_trees(roots: list[int]) -> int:
    """SIGKILL every process of the trees under ``roots``; returns how many. They are stopped first, then
    listed again: a process that forks while we kill its parent would leave a child that no list saw
    (SIGKILL ends a stopped process as well)."""
    for pid in dict.fromkeys(pid for root in roots for pid in process_tree(root)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    pids = list(dict.fromkeys(pid for root in roots for pid in process_tree(root)))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)
