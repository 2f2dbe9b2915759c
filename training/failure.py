"""The reason a host failed, where SageMaker looks for it: the first 1024 characters of
/opt/ml/output/failure become the training job's FailureReason (DescribeTrainingJob, the console, and
our result.json)."""

from __future__ import annotations

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
    after the launcher wrote why), never its cause's replacement."""
    if not failure_path(environ).exists():
        write_failure(message, environ)


def write_quietly(path: Path, text: str) -> None:
    """Write a reason to ``path``; a full, read-only or missing tree is logged, never raised: it must not
    hide the reason itself, which the log still holds."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        log.warning("could not write %s: %s", path, error)
