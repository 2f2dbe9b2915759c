"""Fault injection into emulated clusters: signal a host's whole tree, its launcher, its torchrun or one of
its trainers (optionally when a given log line appears), stop and continue a host, freeze a host's
launcher (and all it started) under its first process, take a port.

    cluster, watcher = start(spec, tmp_path, images)
    faults = Faults(cluster, watcher)
    at = faults.when("algo-3", r"^step=5/", lambda: faults.signal_trainer("algo-3", signal.SIGKILL, local_rank=1))
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from training.local.cluster import EmulatedCluster, LineWatcher, process_tree

LAUNCHER = "training.launcher"
TORCHRUN = "training.torchrun"
TRAINERS = ("training.trainers.pytorch_runtime", "training.trainers.keras_runtime")


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def send(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Faults:
    def __init__(self, cluster: EmulatedCluster, watcher: LineWatcher) -> None:
        self.cluster = cluster
        self.watcher = watcher

    def when(self, host: str, pattern: str, action: Callable[[], None], timeout: float = 120.0) -> float:
        """Run ``action`` once ``host`` printed a line matching ``pattern``; returns when it ran (monotonic)."""
        self.watcher.wait_for(host, pattern, timeout)
        action()
        return time.monotonic()

    def pids(self, host: str, needle: str) -> list[int]:
        """The host's processes whose command line holds ``needle``."""
        return [pid for pid in self.cluster.host_pids(host) if needle in command_line(pid)]

    def signal_host(self, host: str, sig: signal.Signals) -> None:
        """Every process of the host: SIGKILL is an instance failure, SIGSTOP a hung instance."""
        self.cluster.kill(host, sig)

    def signal_launcher(self, host: str, sig: signal.Signals) -> None:
        """The host's first process (the container's PID 1, which passes SIGTERM and SIGINT on)."""
        self.cluster.kill_launcher(host, sig)

    def freeze_launcher(self, host: str) -> None:
        """SIGSTOP every process of the host but its first: a hung launcher and everything it started (a
        deadlock, a process stuck in the kernel), the container's PID 1 still running. ``signal_host`` with
        SIGSTOP freezes the first process too: a hung instance."""
        first = self.cluster.pid(host)
        send([pid for pid in self.cluster.host_pids(host) if pid != first], signal.SIGSTOP)

    def signal_torchrun(self, host: str, sig: signal.Signals) -> None:
        pids = self.pids(host, TORCHRUN)
        assert pids, f"{host} runs no torchrun"
        send(pids, sig)

    def trainer_pid(self, host: str, local_rank: int = 0) -> int:
        for pid in self.cluster.host_pids(host):
            if any(trainer in command_line(pid) for trainer in TRAINERS):
                env = environment(pid)
                if int(env.get("LOCAL_RANK", env.get("HOROVOD_LOCAL_RANK", 0))) == local_rank:
                    return pid
        raise AssertionError(f"{host} runs no trainer of local rank {local_rank}")

    def signal_trainer(self, host: str, sig: signal.Signals, local_rank: int = 0) -> None:
        send([self.trainer_pid(host, local_rank)], sig)

    def trainer_children(self, host: str, local_rank: int) -> list[int]:
        """A trainer's child processes (its DataLoader workers)."""
        trainer = self.trainer_pid(host, local_rank)
        return [pid for pid in process_tree(trainer) if pid != trainer]


@contextlib.contextmanager
def taken_port(address: str, port: int) -> Iterator[socket.socket]:
    """Another process's listening socket on ``address:port`` (no SO_REUSEPORT: nobody may share it)."""
    squatter = socket.socket()
    squatter.bind((address, port))
    squatter.listen()
    try:
        yield squatter
    finally:
        squatter.close()
