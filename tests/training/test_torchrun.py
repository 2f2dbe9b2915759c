"""training/torchrun.py: which failed rank is the cause, as torchrun reports its ranks' failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from training.local.cluster import free_port
from training.torchrun import cause, failure_record

REPO = Path(__file__).resolve().parents[2]


def failure(local_rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    record = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="<N/A>")
    record.timestamp = timestamp
    return record


def test_the_rank_killed_by_a_signal_is_the_cause_not_the_peer_that_died_of_it() -> None:
    # Seen in one poll: rank 0 failed on the broken all-reduce the moment rank 1 was SIGKILLed.
    failures = {0: failure(0, 1, 100), 1: failure(1, -9, 100)}
    assert cause(failures)[0] == 1
    record = failure_record(ChildFailedError("training.trainers.pytorch_runtime", failures))
    assert record == {"rank": 1, "local_rank": 1, "exitcode": -9, "signal": "SIGKILL", "pid": 1001}


def test_torchruns_own_sigterm_is_not_a_cause_and_else_the_first_failure_is() -> None:
    assert cause({0: failure(0, -15, 100), 1: failure(1, 1, 101)})[0] == 1
    assert cause({0: failure(0, 1, 105), 1: failure(1, 2, 101)})[0] == 1
    assert failure_record(ChildFailedError("m", {0: failure(0, 2, 100)}))["signal"] is None


def test_a_signal_death_from_outside_is_the_cause_whatever_its_peers_died_of_in_the_same_second() -> None:
    # The race seen under load: rank 1 SIGKILLed, rank 0 aborted (gloo's error reached C++'s terminate as
    # it tore down), both stamped in the same whole second of torchrun's poll.
    assert cause({0: failure(0, -6, 100), 1: failure(1, -9, 100)})[0] == 1
    assert cause({0: failure(0, -6, 99), 1: failure(1, -9, 100)})[0] == 1  # stamped earlier, still a consequence
    # A crash of a rank's own (SIGSEGV) is a cause before its peers' abort or exit code.
    assert cause({0: failure(0, 1, 100), 1: failure(1, -6, 100), 2: failure(2, -11, 101)})[0] == 2
    assert cause({0: failure(0, -6, 100), 1: failure(1, -7, 101)})[0] == 1  # SIGBUS, stamped later, before SIGABRT
    # Stopped ranks (SIGTERM, SIGINT, 143, 130) come last, after any exit code.
    assert cause({0: failure(0, -2, 100), 1: failure(1, 130, 100), 2: failure(2, 143, 99), 3: failure(3, 2, 101)})[0] == 3


def test_a_rank_that_raised_is_the_cause_not_the_peer_that_aborted_in_the_same_poll() -> None:
    # Rank 0 raised (exit 1); its NCCL/gloo peer aborted (SIGABRT) as the collective broke, both seen in
    # one poll: the culprit's exit code, not "killed by SIGABRT".
    assert cause({0: failure(0, 1, 100), 1: failure(1, -6, 100)})[0] == 0
    assert cause({0: failure(0, -6, 99), 1: failure(1, 1, 100)})[0] == 1  # the abort stamped a second earlier
    record = failure_record(ChildFailedError("m", {0: failure(0, 1, 100), 1: failure(1, -6, 100)}))
    assert (record["rank"], record["exitcode"], record["signal"]) == (0, 1, None)
    # The OOM killer's SIGKILL stays the cause before any of them.
    assert cause({0: failure(0, 1, 100), 1: failure(1, -6, 100), 2: failure(2, -9, 101)})[0] == 2


def test_ranks_that_all_stopped_are_a_stop_and_any_other_failure_is_not() -> None:
    from training.torchrun import stopped

    assert stopped(ChildFailedError("m", {0: failure(0, 143, 100), 1: failure(1, -15, 100)}))
    assert not stopped(ChildFailedError("m", {0: failure(0, 143, 100), 1: failure(1, 1, 100)}))


RANK = '''
import os, signal, sys, time
from pathlib import Path

def leave(*_):
    sys.exit(143)  # what a rank does after saving on a stop (TrainingStopped's exit code)

signal.signal(signal.SIGTERM, leave)
Path(os.environ["READY_DIR"], os.environ["LOCAL_RANK"]).touch()
if os.environ.get("STOP_AT_ONCE"):
    leave()
time.sleep(60)
'''


@pytest.mark.parametrize("how", ["SIGTERM to torchrun", "every rank stopped"])
def test_a_stop_under_torchrun_exits_as_a_stop_without_a_traceback(tmp_path: Path, how: str) -> None:
    """A StopTrainingJob's SIGTERM reaches torchrun (which passes it on), or the ranks stop by themselves:
    torchrun's exit is 128 + SIGTERM with one line, not 1 with its SignalException or ChildFailedError
    traceback; the ranks' own TrainingStopped is the job's reason."""
    (tmp_path / "stopping_rank.py").write_text(RANK)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = os.environ | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "READY_DIR": str(ready)}
    if how == "every rank stopped":
        env["STOP_AT_ONCE"] = "1"
    process = subprocess.Popen([sys.executable, "-m", "training.torchrun", "--nproc-per-node=2", "--master-port", str(free_port()),
                                "-m", "stopping_rank"], env=env, stderr=subprocess.PIPE, text=True)
    if how == "SIGTERM to torchrun":
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "training.torchrun: torchrun" in stderr, stderr
