"""torchrun, recording which rank failed and how, and giving its ranks the time to save when stopped.

* torchrun prints its "Root Cause" report to stderr and writes an error file only for a rank that wrote
  one itself; a rank killed by a signal (the OOM killer's SIGKILL) writes nothing. This runs torchrun's
  own ``main`` and, when ranks fail, writes the one that caused it as JSON (rank, local rank, exit code,
  signal) to the file the launcher names in ``TRAINING_RANK_FAILURE_FILE``, then fails as torchrun does.
  The cause is found by the kind of each death before its time (``cause``): a rank SIGKILLed (the OOM
  killer) before one that crashed (SIGSEGV, SIGBUS, SIGFPE, SIGILL), before one that exited non-zero (a
  rank that raised), before one that aborted (SIGABRT: how a peer of a dead rank often ends), before a
  rank stopped by the SIGTERM torchrun itself sends; a peer that died of the broken collective a moment
  later, by whatever means, is not the cause.
* On SIGTERM torchrun passes the signal to its ranks and kills them 30 s later (the default of its
  process context's ``close``). When the SIGTERM came to torchrun (a stop: StopTrainingJob, a spot
  interruption), its ranks get RANK_STOP_GRACE_S instead, within SageMaker's 120 s, to save; when torchrun
  closes them because a rank failed, its own 30 s stand. A stop ends as one: exit 128 + SIGTERM, one
  line, no traceback (the ranks' TrainingStopped is the job's reason).

    TRAINING_RANK_FAILURE_FILE=/tmp/rank-failure.json python -m training.torchrun --nproc-per-node=2 -m my.module
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main as torchrun_main

from training.failure import RANK_FAILURE_ENV

# Below the launcher's STOP_GRACE_S (100 s), which is below SageMaker's 120 s before SIGKILL.
RANK_STOP_GRACE_S = 90


# How likely a rank's death is the cause rather than a consequence of its peer's, by kind, best first.
# SIGKILL comes from outside (the kernel's OOM killer, an operator): no rank sends it to itself. A crash
# signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL) is the rank's own fault. Then exit codes: a rank that raised
# exits 1, and so may a peer whose collective broke, so among them the time decides. SIGABRT after them:
# it is how a rank whose peer died usually ends (gloo's or NCCL's error escapes into C++'s terminate while
# the process tears down, or NCCL's watchdog aborts it). Last the ranks that were stopped: by torchrun's
# own SIGTERM, by SIGINT, or saved and left on one (TrainingStopped's 143, 130).
EXTERNAL, CRASHED, EXITED, ABORTED, STOPPED = range(5)
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def death_kind(exitcode: int) -> int:
    """One of EXTERNAL .. STOPPED for a rank's exit code (-N: killed by signal N). Pure."""
    if exitcode in {-sig for sig in STOP_SIGNALS} | {128 + sig for sig in STOP_SIGNALS}:
        return STOPPED
    if exitcode >= 0:
        return EXITED
    if -exitcode == signal.SIGKILL:
        return EXTERNAL
    return ABORTED if -exitcode == signal.SIGABRT else CRASHED


def cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failed rank that caused the others to fail. Pure.

    By kind first (death_kind), then time, then rank: the time alone cannot tell, since torchrun stamps a
    rank that wrote no error file when it polls it, in whole seconds, so a rank killed and the peer that
    died of it a moment later are often stamped alike, and seen in one poll."""
    return min(failures.items(), key=lambda item: (death_kind(item[1].exitcode), item[1].timestamp, item[0]))


def failure_record(error: ChildFailedError) -> dict[str, Any]:
    rank, failure = cause(error.failures)
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "pid": failure.pid,
    }


class _StopGrace:
    """Wraps torchrun's signal handler (to learn that a stop was asked) and its process context's close
    (to give the ranks the longer grace after a stop). torchrun installs the handler by its module name
    when it starts the ranks, so replacing the module attribute is enough."""

    def __init__(self) -> None:
        self.stop_requested = False
        self._handler = elastic_processes._terminate_process_handler
        self._close = elastic_processes.PContext.close

    def install(self) -> None:
        grace = self

        def on_signal(signum: int, frame: Any) -> None:
            grace.stop_requested = signum == signal.SIGTERM
            grace._handler(signum, frame)  # raises torchrun's SignalException, as before

        def close(context: Any, death_sig: Any = None, timeout: int = 30) -> None:
            grace._close(context, death_sig, RANK_STOP_GRACE_S if grace.stop_requested else timeout)

        elastic_processes._terminate_process_handler = on_signal
        elastic_processes.PContext.close = close  # type: ignore[method-assign]


def stopped(error: ChildFailedError) -> bool:
    """Whether every failed rank was stopped (a SIGTERM or SIGINT, or saved and left on one), none of
    them failing: the job was stopped, not broken. Pure."""
    return bool(error.failures) and all(death_kind(failure.exitcode) == STOPPED for failure in error.failures.values())


def main(argv: list[str]) -> None:
    grace = _StopGrace()
    grace.install()
    try:
        torchrun_main(argv)
    except elastic_processes.SignalException as error:
        if not grace.stop_requested:
            raise
        leave_stopped(f"torchrun stopped by {error.sigval.name}: its ranks had {RANK_STOP_GRACE_S} s to save")
    except ChildFailedError as error:
        if stopped(error):
            leave_stopped(f"torchrun's ranks stopped ({', '.join(sorted({str(f.exitcode) for f in error.failures.values()}))}) after saving")
        path = os.environ.get(RANK_FAILURE_ENV)
        if path:
            with open(path, "w") as file:
                json.dump(failure_record(error), file)
        raise


def leave_stopped(message: str) -> None:
    """A stop exits as one, 128 + SIGTERM, with one line and no traceback: the ranks wrote the reason."""
    print(f"training.torchrun: {message}", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1:])
