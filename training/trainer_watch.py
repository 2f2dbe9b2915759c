"""A DNN host's watch over its trainer processes: the progress marks they write (training/trainers/loop.py),
the rules that turn them into a stall, a finished run or a saved one, and ``wait_for_trainers``, which
passes a stop on, stops the others when one fails, and decides the host's exit status and reason.

Nothing frozen keeps the job billed: a DNN host whose trainers make no progress for
``trainer_stall_timeout_s`` fails with TrainerStalled (the marks they write after every step, every
evaluation batch and around every save, timed on the monotonic clock; marks already in the folder when
they start are not theirs); a failure the launcher decides kills the trainers' whole tree at once (an
abort saves nothing, and a stopped process ignores SIGINT); a finished run whose processes do not exit
within ``trainer_exit_timeout_s`` is killed and the host exits 0 (the work is saved), and so does a host
whose trainer crashed after every local rank's done mark (a teardown crash: TrainerCrashedAfterSaving,
a warning). SIGTERM (StopTrainingJob, a spot interruption) is passed to the trainers, which save a
checkpoint and the model at the next step boundary; SageMaker sends SIGKILL 120 s later, so they get
STOP_GRACE_S.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.failure import write_failure
from training.processes import PAUSED_S, exit_status, kill_trees
from training.trainers.loop import DONE_MARK

log = logging.getLogger("training.trainer_watch")


@dataclass(frozen=True)
class TrainersOutcome:
    status: int  # this host's exit status
    returncode: int  # the return code of the process that decided it
    abort_reason: str | None = None  # why the launcher stopped the trainers itself


def failure_to_write(outcome: TrainersOutcome, *, stopped: bool, written: str, rank_failure: str | None, host: str) -> str | None:
    """The failure reason this host leaves, or None to keep what the trainers wrote. Pure.

    Stopping the trainers (SIGTERM) makes them save and write "TrainingStopped"; when the launcher stopped
    them for a reason of its own, that reason is the cause, not their stop. A rank killed by a signal
    writes nothing, and what its peers wrote on the way down is not the cause either."""
    if outcome.status == 0:
        return None
    if outcome.abort_reason:
        return outcome.abort_reason
    if stopped:
        return None if written else "stopped by SIGTERM (StopTrainingJob or a spot interruption) before the trainers reached a step boundary"
    if rank_failure and "killed by" in rank_failure:
        return f"{rank_failure} on {host}"
    if outcome.returncode < 0:  # one process of several (Horovod) killed by a signal: the cause, whatever its peers wrote
        return f"{trainer_failure(outcome.returncode, None)} on {host}"
    return None if written else f"{trainer_failure(outcome.returncode, rank_failure)} on {host}"


def trainer_failure(returncode: int, rank_failure: str | None) -> str:
    """The reason a host's trainer failed: which rank died of which signal when torchrun says so. Pure."""
    if rank_failure:
        return rank_failure
    if returncode < 0:
        return f"the trainer was killed by {signal.Signals(-returncode).name}"
    return f"the trainer exited with status {exit_status(returncode)}"


@dataclass(frozen=True)
class Progress:
    """What a DNN launcher has seen of its trainers' step marks (training/trainers/loop.py writes them).

    Every time is the launcher's monotonic clock, never a mark's mtime: the wall clock may be stepped (NTP,
    an operator), and an hour back would hide a stall for that hour. A mark counts as news when anything
    about it changed (its mtime, its text), timed when the launcher saw the change. A mark that was in the
    folder before the trainers started (``stale``: another run's, a graph extraction's ``done``), and has
    not changed since, is not theirs and counts for nothing."""

    since: float  # when a mark last changed (the trainers' start while none has)
    seen_at: float  # the last look
    marks: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # mark → (mtime_ns, text) at the last look
    step: int = 0  # the newest step a mark reported
    done_at: float | None = None  # when a mark first said that the run finished, saved
    done: int = 0  # how many marks say so now (one per rank of this host, each past the final barrier)
    stale: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # marks there before the trainers started


def parse_mark(text: str) -> tuple[int, bool]:
    """(step, finished) from a mark's text: "12", "done 12", or a phase with no step of its own and a count
    ("evaluate 3 12", "checkpoint 1 12": the step is the last word); a mark read while it was being
    rewritten reads as step 0. Pure."""
    words = text.split()
    finished = bool(words) and words[0] == DONE_MARK
    number = words[-1] if words else ""
    return (int(number) if number.isdigit() else 0), finished


def observe(progress: Progress, marks: Mapping[str, tuple[int, str]], now: float) -> Progress:
    """The progress after a look at the marks at ``now`` (monotonic). Pure."""
    since, done_at = progress.since, progress.done_at
    gap = now - progress.seen_at
    if gap > PAUSED_S:  # the launcher did not run in the gap: no one's silence counts for it
        since += gap
        done_at = None if done_at is None else done_at + gap
    marks = {name: mark for name, mark in marks.items() if progress.stale.get(name) != mark}
    if marks != progress.marks:
        since = now
    parsed = [parse_mark(text) for _, text in marks.values()]
    step = max([progress.step, *(number for number, _ in parsed)])
    done = sum(finished for _, finished in parsed)
    if done_at is None and done:
        done_at = now
    return Progress(since=since, seen_at=now, marks=types.MappingProxyType(marks), step=step, done_at=done_at, done=done,
                    stale=progress.stale)


def trainer_stalled(progress: Progress, now: float, *, host: str, bound_s: float, first_step_bound_s: float) -> str | None:
    """Why the host must fail, if its trainers made no progress for longer than the bound (before their
    first mark: ``first_step_bound_s``). A bound of 0 turns the rule off. Pure.

    Progress is any change of any of this host's marks (training/trainers/loop.py): every training step,
    every batch of an evaluation (periodic or final, ``TrainingLoop.mark_progress``), and the start and end
    of each checkpoint write, of the summary's part that the variant computes, and of the model's save. What
    writes no mark: one batch, one evaluation batch or one save that alone takes longer than the bound, and
    a rank that waits in a collective for a peer on another host (the chief's checkpoint write holds the
    other hosts' ranks in the barrier after it): the bound must exceed the longest of those."""
    if progress.done_at is not None:
        return None  # finished: whether they exit is trainers_lingering's
    silent = now - progress.since
    first = not progress.marks
    bound = first_step_bound_s if first else bound_s
    if bound <= 0 or silent <= bound:
        return None
    if first:
        return f"TrainerStalled: no training step on {host} {silent:.0f} s after the trainers started (bound {bound:.0f} s)"
    return (
        f"TrainerStalled: no training step on {host} for {silent:.0f} s (last step {progress.step}; bound {bound:.0f} s): "
        "a frozen or deadlocked rank holds every rank in its next collective"
    )


def trainers_lingering(progress: Progress, now: float, bound_s: float) -> bool:
    """Whether the trainers finished (every rank passed the final barrier: the work is saved) longer than
    ``bound_s`` ago and yet run on. Pure."""
    return progress.done_at is not None and bound_s > 0 and now - progress.done_at > bound_s


def every_rank_done(progress: Progress, local_ranks: int) -> bool:
    """Whether every one of this host's ``local_ranks`` ranks wrote its done mark (past the final barrier:
    the model and the summary are saved). Pure."""
    return progress.done >= max(1, local_ranks)


def read_marks(progress_dir: Path) -> dict[str, tuple[int, str]]:
    """Every mark in the folder: (mtime_ns, text)."""
    marks = {}
    for entry in progress_dir.iterdir() if progress_dir.exists() else []:
        try:
            marks[entry.name] = (entry.stat().st_mtime_ns, entry.read_text())
        except OSError:
            continue  # being replaced while we looked
    return marks


class TrainerWatch:
    """The edge of the progress rules: looks at the marks, on the monotonic clock, and applies the rules to
    what it saw (wait_for_trainers calls ``abort``, ``finished`` and ``saved``). Create it just before the
    trainers start: the marks already in the folder then are not theirs."""

    def __init__(
        self,
        progress_dir: Path,
        *,
        host: str,
        stall_timeout_s: float,
        first_step_timeout_s: float,
        exit_timeout_s: float,
        local_ranks: int = 1,
        data_watch: Callable[[Progress, float], str | None] | None = None,
    ) -> None:
        self.progress_dir, self.host, self.local_ranks, self.data_watch = progress_dir, host, local_ranks, data_watch
        self.stall_timeout_s, self.first_step_timeout_s, self.exit_timeout_s = stall_timeout_s, first_step_timeout_s, exit_timeout_s
        now = time.monotonic()
        self.progress = Progress(since=now, seen_at=now, stale=types.MappingProxyType(read_marks(progress_dir)))
        if self.progress.stale:
            log.warning("progress marks left before the trainers started (%s): not theirs, ignored", ", ".join(sorted(self.progress.stale)))

    def look(self) -> Progress:
        self.progress = observe(self.progress, read_marks(self.progress_dir), time.monotonic())
        return self.progress

    def abort(self) -> str | None:
        """Why the trainers must be killed now: the data hosts' verdict, or a stall."""
        progress, now = self.look(), time.monotonic()
        return (self.data_watch(progress, now) if self.data_watch else None) or trainer_stalled(
            progress, now, host=self.host, bound_s=self.stall_timeout_s, first_step_bound_s=self.first_step_timeout_s
        )

    def finished(self) -> bool:
        """Whether the run finished and its processes linger (``abort`` looked at the marks a moment ago)."""
        return trainers_lingering(self.progress, time.monotonic(), self.exit_timeout_s)

    def saved(self) -> bool:
        """Whether every local rank is past the final barrier (a fresh look: asked when a trainer ended)."""
        return every_rank_done(self.look(), self.local_ranks)


# SIGTERM to the launcher: how long its trainers get to reach a step boundary and save before SIGKILL
# (SageMaker sends SIGKILL 120 s after its SIGTERM). A failed peer or a watchdog: PEER_GRACE_S; for
# torchrun, longer than the 30 s it gives its own ranks, so that it is never killed with ranks running.
STOP_GRACE_S = 100.0


PEER_GRACE_S = 10.0


TORCHRUN_PEER_GRACE_S = 40.0


def read_rank_failure(path: Path) -> str | None:
    """Which rank failed first and how, from training/torchrun.py's record (None when it wrote none)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return describe_rank_failure(record)


def describe_rank_failure(record: Mapping[str, Any]) -> str:
    """One line from a rank failure record (rank, local_rank, exitcode, signal). Pure."""
    where = f"rank {record['rank']} (local rank {record['local_rank']})"
    if record.get("signal"):
        hint = " (the kernel's OOM killer sends it when the host runs out of memory)" if record["signal"] == "SIGKILL" else ""
        return f"{where} was killed by {record['signal']}{hint}"
    return f"{where} exited with status {record['exitcode']}"


def wait_for_trainers(
    processes: list[subprocess.Popen],
    stop: threading.Event,
    abort: Callable[[], str | None] | None = None,
    stop_grace_s: float = STOP_GRACE_S,
    peer_grace_s: float = PEER_GRACE_S,
    finished: Callable[[], bool] | None = None,
    saved: Callable[[], bool] | None = None,
) -> TrainersOutcome:
    """Wait for every trainer process of this host. The first to fail fails the host: the others are
    stopped (a Horovod rank whose peer died would otherwise wait for ever); SIGTERM to the launcher is
    passed on to all of them, with ``stop_grace_s`` to save; ``abort`` returning a reason kills them all
    at once and fails the host with it; ``finished`` returning True (the run is done and saved, but its
    processes have not exited) kills them all and leaves the host's status 0. A process that fails when
    ``saved`` says every local rank is past the final barrier (a crash in NCCL's or XLA's teardown, after
    the model and the summary were written) leaves the status 0 too, with a warning that names the crash:
    failing the host would fail the job, and SageMaker uploads no model of a failed job."""
    status, returncode, abort_reason = 0, 0, None
    stopping_since: float | None = None
    lingered = False
    grace_s = peer_grace_s
    failed: list[subprocess.Popen] = []  # in the order their failures were seen
    while alive := [process for process in processes if process.poll() is None]:  # polls every one
        failed += [process for process in processes if process.returncode not in (None, 0) and process not in failed]
        if failed and stopping_since is None and not lingered and saved is not None and saved():
            _log_crash_after_saving(failed[0].returncode)
            lingered, stopping_since = True, time.monotonic()
            kill_trees([process.pid for process in alive])
        if abort is not None and stopping_since is None and not failed and (abort_reason := abort()):
            log.error("%s", abort_reason)
            write_failure(abort_reason)
            status, returncode = 1, 1
            # An abort needs no saving (the job fails anyway), and waiting out torchrun's close of ranks that
            # are blocked on a dead data host or frozen (a stopped process ignores SIGINT and SIGTERM until
            # continued) would keep every host billed for nothing: every process of the trainers, now.
            stopping_since = time.monotonic()
            kill_trees([process.pid for process in alive])
        elif finished is not None and stopping_since is None and not failed and finished():
            log.warning(
                "TrainerExitTimeout: every rank finished and the work is saved, but the trainer processes have not "
                "exited: killed (the host exits 0)"
            )
            lingered, stopping_since = True, time.monotonic()
            kill_trees([process.pid for process in alive])
        if (failed or stop.is_set()) and stopping_since is None:
            # A stop (SIGTERM) asks the trainers to save; a failure (SIGINT) only to end: torchrun then
            # closes its ranks within its own 30 s, and nothing writes "stopped" over the cause.
            sig = signal.SIGINT
            if failed:
                returncode = failed[0].returncode
                status = exit_status(returncode)
                _log_trainer_end(returncode)
            else:
                sig, grace_s = signal.SIGTERM, stop_grace_s
                log.warning("SIGTERM: the trainers get %.0f s to save a checkpoint", grace_s)
            stopping_since = time.monotonic()
            for process in alive:
                process.send_signal(sig)
        if stopping_since is not None and time.monotonic() - stopping_since > grace_s:
            kill_trees([process.pid for process in alive])  # torchrun's ranks too: they run in sessions of their own
        time.sleep(0.1)
    failed += [process for process in processes if process.returncode != 0 and process not in failed]
    if not status and not lingered and failed:
        returncode = failed[0].returncode
        if saved is not None and saved():
            _log_crash_after_saving(returncode)
            return TrainersOutcome(0, returncode)
        status = exit_status(returncode)
        _log_trainer_end(returncode)
    return TrainersOutcome(status, returncode, abort_reason)


def _log_crash_after_saving(returncode: int) -> None:
    log.warning(
        "TrainerCrashedAfterSaving: %s after every rank of this host had passed the final barrier (the model "
        "and the summary are saved; a teardown crash, NCCL's or XLA's): the host exits 0", trainer_failure(returncode, None)
    )


def _log_trainer_end(returncode: int) -> None:
    if returncode == 128 + signal.SIGTERM:  # TrainingStopped's, and torchrun's after its ranks stopped
        log.warning("the trainer stopped (SIGTERM) after saving: exit code %d", returncode)
    elif returncode < 0:
        log.error("the trainer was killed by %s", signal.Signals(-returncode).name)
    else:
        log.error("the trainer failed with exit code %d", returncode)
