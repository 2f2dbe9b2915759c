"""The reason a host failed, where SageMaker looks for it: the first 1024 characters of
/opt/ml/output/failure become the training job's FailureReason (DescribeTrainingJob, the console, and
our result.json)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from training.cluster import base_dir

log = logging.getLogger(__name__)

# Where training/torchrun.py records torchrun's first failed rank (JSON) for the launcher.
RANK_FAILURE_ENV = "TRAINING_RANK_FAILURE_FILE"


def failure_path(environ: Mapping[str, str] = os.environ) -> Path:
    return base_dir(environ) / "output" / "failure"


def write_failure(message: str, environ: Mapping[str, str] = os.environ) -> None:
    write_quietly(failure_path(environ), message[:1024])


def write_first_failure(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """write_failure unless a reason is already there: for an error nothing named, which may be the
    consequence of the first (a trainer orphaned by its killed torchrun finds the launcher's folders gone
    after the launcher wrote why), never its cause's replacement. Atomic: of two writers, the first wins,
    and a writer killed half-way leaves nothing (a check-then-write let such a trainer empty the file)."""
    write_quietly(failure_path(environ), message[:1024], replace=False)


def write_quietly(path: Path, text: str, replace: bool = True) -> None:
    """Write a reason to ``path`` whole or not at all (written beside it, then moved in: a process killed
    while writing leaves no empty or cut reason); ``replace`` False: only where none is yet. A full,
    read-only or missing tree is logged, never raised: it must not hide the reason itself, which the log
    still holds."""
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(text)
        if replace:
            os.replace(staged, path)
        else:
            with contextlib.suppress(FileExistsError):  # a reason is there: it stays
                os.link(staged, path)  # create-if-absent, atomically
    except OSError as error:
        log.warning("could not write %s: %s", path, error)
    finally:
        if staged.exists():
            with contextlib.suppress(OSError):
                staged.unlink()
