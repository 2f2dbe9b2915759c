"""The container's first process: it supervises the launcher it starts, hears its heartbeat over a pipe,
and kills a launcher that stopped beating (LauncherFrozen), so that its host exits: non-zero on a DNN
host, 0 on a data host (its trainers go on with the other data hosts; the reason is logged and left in
the host's output/data). PID 1 reaps every orphan meanwhile, as an init does."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from training.cluster import base_dir
from training.failure import write_failure, write_quietly
from training.hyperparameters import DATA
from training.processes import PAUSED_S, exit_status, kill_trees, process_tree

log = logging.getLogger("training.supervisor")


# The write end of the heartbeat pipe, in the launcher the container's first process supervises.
HEARTBEAT_FD_ENV = "TRAINING_HEARTBEAT_FD"


# "1": supervise the launcher as the container's first process does, though this one is not PID 1 (the
# emulated cluster runs every host so, so that its tests go through the same supervisor).
SUPERVISE_ENV = "TRAINING_SUPERVISE"


# The host's exit status when its first process killed a frozen launcher of a DNN host (or of a host
# whose role it was not told). A data host's is 0 (frozen_exit_status).
LAUNCHER_FROZEN_EXIT = 1


# What /proc/<pid>/stat's state letter means, for the reason a frozen launcher leaves.
PROCESS_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep (I/O)", "R": "running",
                  "S": "sleeping", "Z": "a zombie"}


@dataclass(frozen=True)
class Heartbeat:
    """What the container's first process knows of its launcher's beats, on its monotonic clock. Until the
    first beat (which says the bound and the host) nothing is enforced: a launcher still parsing its
    settings, or one that runs without beats (bound 0), is never blamed."""

    checked_at: float  # the supervisor's last look at its clock
    heard_at: float | None = None
    bound_s: float = 0.0
    host: str = ""
    role: str = ""  # the host's role (DATA, DNN), as the launcher found it; "" when it did not say
    pending: bytes = b""  # a beat's line not whole yet


def heard(beat: Heartbeat, data: bytes, now: float) -> Heartbeat:
    """The heartbeat after reading ``data`` from the pipe (JSON lines: the bound, the host, its role). Pure."""
    *lines, pending = (beat.pending + data).split(b"\n")
    for line in reversed(lines):
        try:
            said = json.loads(line)
            return dataclasses.replace(beat, heard_at=now, bound_s=float(said["bound_s"]), host=str(said["host"]),
                                       role=str(said.get("role", "")), pending=pending)
        except (ValueError, KeyError, TypeError):
            continue  # not a beat: nothing else writes there, but a torn line must not end the supervisor
    return dataclasses.replace(beat, pending=pending)


def heartbeat_lost(beat: Heartbeat, now: float) -> tuple[Heartbeat, str | None]:
    """The heartbeat after a look at the clock at ``now``, and the reason to kill the launcher if it has
    not beaten for longer than its bound. A gap in the supervisor's own looks (it was frozen too: the whole
    instance, or a VM paused) moves the last beat forward by the gap. Pure."""
    gap = now - beat.checked_at
    heard_at = beat.heard_at
    if heard_at is not None and gap > PAUSED_S:
        heard_at += gap
    beat = dataclasses.replace(beat, checked_at=now, heard_at=heard_at)
    if heard_at is None or beat.bound_s <= 0 or now - heard_at <= beat.bound_s:
        return beat, None
    return beat, f"LauncherFrozen: the launcher on {beat.host} sent no heartbeat for {now - heard_at:.0f} s (bound {beat.bound_s:.0f} s)"


def frozen_exit_status(role: str) -> int:
    """The host's exit status once its first process killed its frozen launcher, by the host's role. Pure.

    SageMaker fails the whole job when any container exits non-zero. A data host is one of the trainers'
    sources: they drop a lost one and train on with the others (and when every data host is lost the DNN
    hosts fail by themselves, naming it), so its loss is not the job's failure, and it exits 0. A DNN
    host's trainers are gone with it: the job has failed (non-zero), as it has when the role is unknown."""
    return 0 if role == DATA else LAUNCHER_FROZEN_EXIT


def frozen_note_path(host: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a data host whose frozen launcher was killed leaves the reason: beside the job's outputs
    (every host's /opt/ml/output/data goes into the job's output.tar.gz), not in the failure file, which is
    the job's FailureReason when it fails, and a lost data host is not why."""
    return base_dir(environ) / "output" / "data" / f"LauncherFrozen-{host or 'unknown'}.txt"


def start_heartbeat(bound_s: float, host: str, role: str = "", environ: Mapping[str, str] = os.environ) -> bool:
    """Beat to the supervising first process (when there is one, and a bound) from a thread of its own,
    every tenth of the bound: a launcher whose every thread stopped (SIGSTOP, a hang that holds the GIL)
    stops beating. Each beat says the bound, the host and its role (what the supervisor's exit status
    depends on: frozen_exit_status). Returns whether it beats."""
    fd = environ.get(HEARTBEAT_FD_ENV)
    if not fd or bound_s <= 0:
        return False
    line = json.dumps({"bound_s": bound_s, "host": host, "role": role}).encode() + b"\n"
    interval = min(10.0, bound_s / 10)

    def beat() -> None:
        while True:
            try:
                os.write(int(fd), line)
            except BlockingIOError:
                pass  # the pipe is full (the supervisor is not reading): a beat is not worth blocking for
            except OSError:
                return  # the supervisor is gone: no one listens
            time.sleep(interval)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return True


def process_state(pid: int) -> str:
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return PROCESS_STATES.get(letter, letter)


def supervise(command: list[str]) -> int:
    """What the container's first process does when the launcher is it (the image's entrypoint): run the
    launcher as a child, pass SIGTERM and SIGINT on to it, reap every process that ends up orphaned (the
    kernel gives them to PID 1, and no other process would collect them), and exit with the launcher's
    status once it ends.

    It also watches the launcher's heartbeat: a launcher that stopped beating for its bound is frozen, and
    a frozen launcher never exits (on a data host, its DNN hosts' shutdown cannot reach it), so the job
    would stay InProgress and bill every instance until its deadline. Then this kills it and everything
    it started, and exits, which ends the container: on a DNN host with LAUNCHER_FROZEN_EXIT and
    LauncherFrozen as the host's failure; on a data host with 0 (frozen_exit_status), the reason logged as
    an error and left in frozen_note_path. What it cannot see: a frozen first process (the whole instance
    frozen), and a launcher whose main thread is deadlocked while its other threads run."""
    pr_set_child_subreaper = 36  # so that this holds when it is not PID 1 too (the tests)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_child_subreaper, 1)
    pending: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)  # arrived while the launcher was starting: sent once it exists
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    beats, beat_end = os.pipe()
    os.set_blocking(beat_end, False)  # a beat never blocks the launcher (see start_heartbeat)
    environment = {key: value for key, value in os.environ.items() if key != SUPERVISE_ENV} | {HEARTBEAT_FD_ENV: str(beat_end)}
    child = subprocess.Popen(command, env=environment, pass_fds=(beat_end,))
    os.close(beat_end)
    for signum in pending:
        forward(signum, None)
    heartbeat, listening = Heartbeat(checked_at=time.monotonic()), [beats]
    while True:
        readable, _, _ = select.select(listening, [], [], 0.5)
        now = time.monotonic()
        if readable:
            data = os.read(beats, 4096)
            if data:
                heartbeat = heard(heartbeat, data, now)
            else:
                listening = []  # every write end closed: the launcher is ending
        if (status := _reap(child.pid)) is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            return status
        heartbeat, frozen = heartbeat_lost(heartbeat, now)
        if frozen:
            state = process_state(child.pid)
            killed = kill_trees([pid for pid in process_tree(os.getpid()) if pid != os.getpid()])
            reason = f"{frozen}: it was {state}; killed it and the {killed - 1} processes under it"
            status = frozen_exit_status(heartbeat.role)
            if status == 0:
                log.error(
                    "%s. This data host exits 0: the trainers drop it and train on with the other data hosts (the "
                    "DNN hosts fail by themselves, naming it, if every data host is lost)", reason
                )
                write_quietly(frozen_note_path(heartbeat.host), reason + "\n")
            else:
                log.error("%s", reason)
                write_failure(reason)
            _reap_all(deadline=time.monotonic() + 10)  # all killed: collected, so that none outlives this
            return status


def _reap(launcher: int) -> int | None:
    """Collect every child that ended (the launcher, or an orphan given to this process); the launcher's
    exit status once it ended."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == launcher:
            return exit_status(os.waitstatus_to_exitcode(wait_status))


def _reap_all(deadline: float) -> None:
    """Collect every child until none is left, or until ``deadline`` (monotonic): a process in
    uninterruptible sleep dies only when its I/O returns."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
