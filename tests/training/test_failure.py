"""The failure file (training/failure.py), SageMaker's FailureReason: written whole or not at all, the
first reason kept by those who only add one, and never raised over."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from training.cluster import BASE_DIR_ENV
from training.failure import failure_path, write_failure, write_first_failure


def test_the_first_reason_stays_a_later_consequence_does_not_replace_it_and_the_launchers_does(tmp_path: Path) -> None:
    environ = {BASE_DIR_ENV: str(tmp_path)}
    write_first_failure("FileNotFoundError: the progress folder is gone", environ)  # nothing there yet: it is the reason
    assert failure_path(environ).read_text() == "FileNotFoundError: the progress folder is gone"
    write_failure("the trainer was killed by SIGKILL on algo-1", environ)  # the launcher's: the cause, replaces it
    write_first_failure("RuntimeError: a peer hung up", environ)  # a consequence: kept out
    assert failure_path(environ).read_text() == "the trainer was killed by SIGKILL on algo-1"
    assert [path.name for path in failure_path(environ).parent.iterdir()] == ["failure"]  # nothing staged left behind
    write_failure("x" * 2000, environ)
    assert len(failure_path(environ).read_text()) == 1024  # SageMaker reads the first 1024 characters


def test_a_tree_that_cannot_be_written_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "output").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING):
        write_failure("the reason", {BASE_DIR_ENV: str(tmp_path)})
        write_first_failure("the reason", {BASE_DIR_ENV: str(tmp_path)})
    assert caplog.text.count("could not write") == 2
