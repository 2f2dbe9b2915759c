"""training/torchrun.py: which failed rank is the cause, as torchrun reports its ranks' failures."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from training.torchrun import cause, failure_record


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
