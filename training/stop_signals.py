"""The stop signals, the same however a process was started: restored at each entry point, and the CLI's own.

A process that a non-interactive shell starts in the background (a CI runner, a scheduler, ``nohup … &``)
inherits SIGINT and SIGQUIT as *ignored*. Python then installs no KeyboardInterrupt handler, and an ignored
disposition survives ``exec``, so every process it starts ignores SIGINT too: a launcher that ends its other
ranks with SIGINT would wait out its grace and kill them, and Ctrl-C would not stop ``hetero local``. A
handler, unlike an ignored disposition, is reset to the default at ``exec``: so one entry point that restores
its own handlers gives every process it starts (hosts, torchrun and its ranks, tf.data.service children, a
user's script) the default too, with no code between fork and exec (which gRPC's fork handlers forbid).

Standard library only: the bottom layer, imported by the launcher, the emulated cluster and the CLI.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# What stops a run: Ctrl-C (SIGINT) and a stop (SIGTERM: StopTrainingJob, `kill`, a scheduler). SIGQUIT and
# SIGHUP are left as they came: `nohup` ignores SIGHUP on purpose, and nothing here stops with SIGQUIT.
DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def restore_stop_signals() -> list[signal.Signals]:
    """SIGINT raises KeyboardInterrupt and SIGTERM ends the process, as in a foreground shell, where either
    was inherited as ignored; a handler already installed is kept. Returns the signals restored. Outside
    the main thread (where Python refuses handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return []
    restored = []
    for sig, handler in DEFAULT_HANDLERS.items():
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, handler)
            restored.append(sig)
    return restored


class Stopped(Exception):
    """Ctrl-C or SIGTERM while a command ran: what it started is stopped before it exits."""

    def __init__(self, what: str, exit_code: int) -> None:
        super().__init__(what)
        self.what, self.exit_code = what, exit_code


STOPS = {signal.SIGINT: ("Ctrl-C", 128 + signal.SIGINT), signal.SIGTERM: ("SIGTERM", 128 + signal.SIGTERM)}


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Inside: Ctrl-C and SIGTERM raise :class:`Stopped` in the main thread (exit 130 and 143), whatever
    the process inherited, so that what the command started (emulated hosts, in sessions of their own and
    not signalled with it) is stopped on the way out. Python's default for SIGTERM ends the process on the
    spot and would leave them running; an inherited ignore would leave the command running. The previous
    handlers come back on the way out. Outside the main thread, nothing changes."""
    def on_stop(signum: int, _frame: object) -> None:
        raise Stopped(*STOPS[signal.Signals(signum)])

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, on_stop) for sig in STOPS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
