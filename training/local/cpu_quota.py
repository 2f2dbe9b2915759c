"""Fractions of a core per emulated host, with the kernel's CPU bandwidth controller (cgroups).

CPU affinity gives a host whole cores; a quota gives it, say, 0.25 of one, so that 1, 2 and 4 data hosts
of a known size fit on a 2-core machine and the data-group sizing advisor can be checked against real
runs. Each host gets a cgroup of its own under one group per emulated cluster; the host's first process
enters it before it executes (children inherit it), and the groups are removed when the cluster closes.

cgroup v1 (``/sys/fs/cgroup/cpu``: cpu.cfs_quota_us / cpu.cfs_period_us) and v2 (``cpu.max``) are both
handled; without a writable CPU controller, asking for a quota is an EmulationError that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 100_000
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuQuotaUnavailableError(RuntimeError):
    """This machine gives no writable CPU bandwidth controller."""


@dataclass(frozen=True)
class CpuController:
    root: Path
    version: int

    def limit(self, group: Path, cores: float) -> None:
        quota = max(1000, int(cores * PERIOD_US))
        if self.version == 1:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")


def controller() -> CpuController:
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(V1_ROOT, os.W_OK):
        return CpuController(V1_ROOT, 1)
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2_ROOT, os.W_OK):
        return CpuController(V2_ROOT, 2)
    raise CpuQuotaUnavailableError("CPU quotas need a writable cgroup CPU controller (/sys/fs/cgroup/cpu or cgroup v2 with cpu)")


def available() -> bool:
    try:
        controller()
    except CpuQuotaUnavailableError:
        return False
    return True


class ClusterQuotas:
    """One cgroup per host under ``<root>/<cluster name>``; ``procs_file(host)`` is what a host's first
    process writes its pid into (from preexec, before exec)."""

    def __init__(self, cluster_name: str, quotas: dict[str, float]) -> None:
        self._controller = controller() if quotas else None
        self._quotas = quotas
        self._root = self._controller.root / cluster_name if self._controller else None
        self._groups: dict[str, Path] = {}

    def create(self) -> None:
        if not self._controller or not self._root:
            return
        self._root.mkdir(exist_ok=True)
        if self._controller.version == 2:
            (self._root / "cgroup.subtree_control").write_text("+cpu")
        for host, cores in self._quotas.items():
            group = self._root / host
            group.mkdir(exist_ok=True)
            self._controller.limit(group, cores)
            self._groups[host] = group

    def procs_file(self, host: str) -> Path | None:
        group = self._groups.get(host)
        return group / "cgroup.procs" if group else None

    def remove(self) -> None:
        """Remove the groups (their processes must have ended; a busy group is left for the kernel)."""
        for group in self._groups.values():
            try:
                group.rmdir()
            except OSError:
                pass
        if self._root:
            try:
                self._root.rmdir()
            except OSError:
                pass


def enter(procs_file: Path | None) -> None:
    """Move the calling process into a cgroup (runs in the child between fork and exec)."""
    if procs_file is not None:
        procs_file.write_text(str(os.getpid()))
