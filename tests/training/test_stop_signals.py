"""Stop signals a process inherited as ignored (training/stop_signals.py): a CI runner, a scheduler or
`nohup … &` starts its job so, and every process that job starts would ignore SIGINT unless an entry point
restores it. The processes under test are started through `as_if_started_in_the_background`, which ignores
SIGINT and SIGTERM and then execs, as a non-interactive shell's background job is started (no code between
fork and exec in the test process)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.stop_signals import Stopped, restore_stop_signals, stopped_by_signals

REPO = Path(__file__).resolve().parents[2]
# Ignore the signals, then exec the command: the disposition crosses exec, as a shell's background job's does.
BACKGROUND = ("import os, signal, sys\n"
              "for sig in map(int, sys.argv[1].split(',')): signal.signal(sig, signal.SIG_IGN)\n"
              "os.execv(sys.argv[2], sys.argv[2:])\n")


def as_if_started_in_the_background(command: list[str], ignored: tuple[int, ...] = (signal.SIGINT,)) -> list[str]:
    """``command`` started with ``ignored`` signals inherited as ignored (SIGINT by default: what a shell's
    background job inherits)."""
    return [sys.executable, "-c", BACKGROUND, ",".join(str(int(sig)) for sig in ignored), *command]


def python(code: str, ignored: tuple[int, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(as_if_started_in_the_background([sys.executable, "-c", textwrap.dedent(code)], ignored), cwd=REPO,
                          capture_output=True, text=True, timeout=60)


# A child reports how it inherited SIGINT and SIGTERM: "ignored" or "default" for each.
REPORT_CHILD = """
    import signal, subprocess, sys
    probe = "import signal; print(*('ignored' if signal.getsignal(s) is signal.SIG_IGN else 'default' for s in (2, 15)))"
    print(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.parametrize("restore", [False, True])
def test_an_entry_point_that_restores_gives_every_child_the_default_stop_signals(restore: bool) -> None:
    door = "from training.stop_signals import restore_stop_signals; print(*restore_stop_signals())\n" if restore else "print()\n"
    done = python(door + textwrap.dedent(REPORT_CHILD), ignored=(signal.SIGINT, signal.SIGTERM))
    restored, child = done.stdout.splitlines()
    if restore:
        assert (restored, child) == ("2 15", "default default"), done.stderr
    else:  # what the child inherits otherwise: the test would see the defect it guards against
        assert child == "ignored ignored", done.stderr


def test_a_handler_already_installed_is_kept() -> None:
    previous = signal.signal(signal.SIGTERM, handler := (lambda *_: None))
    try:
        assert restore_stop_signals() == [] and signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(("sig", "what", "code"), [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_inside_a_stop_raises_stopped_with_its_exit_code_and_the_handlers_come_back_after(sig: signal.Signals, what: str,
                                                                                             code: int) -> None:
    before = signal.getsignal(sig)
    with pytest.raises(Stopped) as stopped, stopped_by_signals():
        signal.raise_signal(sig)
    assert (stopped.value.what, stopped.value.exit_code) == (what, code)
    assert signal.getsignal(sig) is before


def test_a_launcher_started_with_sigint_ignored_still_ends_its_other_ranks_when_one_fails() -> None:
    """The launcher ends the other ranks of a host with SIGINT when one fails (no save is asked of them):
    started as a background job is, its door restores SIGINT, so they end at once instead of being killed
    after the peer grace. Without the door, the same run shows the survivor killed (-9)."""
    run = """
        import subprocess, sys, threading, time
        from training.launcher import restore_stop_signals
        from training.trainer_watch import wait_for_trainers
        if sys.argv[1:] == ["door"]:
            restore_stop_signals()  # what training.launcher's main does first
        failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(3)"])
        survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        started = time.monotonic()
        outcome = wait_for_trainers([failing, survivor], threading.Event(), peer_grace_s=3)
        print(outcome.status, survivor.returncode, round(time.monotonic() - started))
    """
    for door, expected in ((True, -signal.SIGINT), (False, -signal.SIGKILL)):
        script = [sys.executable, "-c", textwrap.dedent(run), *(["door"] if door else [])]
        done = subprocess.run(as_if_started_in_the_background(script), cwd=REPO, capture_output=True, text=True, timeout=60)
        status, survivor, _seconds = done.stdout.split()
        assert (int(status), int(survivor)) == (3, expected), done.stderr[-2000:]


def test_the_launchers_entry_point_restores_the_stop_signals_before_anything_else() -> None:
    """`python -m training.launcher` with SIGINT and SIGTERM ignored: its main restores them first, even on
    a usage error, before any child could be started."""
    check = """
        import signal, sys
        import training.launcher as launcher
        sys.argv = ["training.launcher", "not-train"]
        code = launcher.main()
        print(code, *("ignored" if signal.getsignal(s) is signal.SIG_IGN else "restored" for s in (signal.SIGINT, signal.SIGTERM)))
    """
    done = python(check, ignored=(signal.SIGINT, signal.SIGTERM))
    assert done.stdout.splitlines()[-1].split() == ["2", "restored", "restored"], done.stdout[-2000:] + done.stderr[-2000:]
