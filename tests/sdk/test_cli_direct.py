"""`hetero run --direct` from the terminal, with the SageMaker SDK installed: the job sent through
ModelTrainer, followed to its end with its result; a job that ends without figures exits 1."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from typer.testing import CliRunner

from hetero import sdk
from hetero.cli import app
from tests.sdk.conftest import REGION

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch-heterogeneous.json"
SUMMARY = {"step_time_ms": {"p50": 184.0, "p90": 190.0}, "samples_per_s": 348.0, "steps": 500, "timed_steps": 480}


def finish_when_created(aws, summary: dict | None) -> threading.Thread:
    def finish() -> None:
        give_up = time.monotonic() + 60
        while not aws.jobs() and time.monotonic() < give_up:
            time.sleep(0.05)
        aws.finish(aws.jobs()[0], summary)

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    return thread


def test_run_direct_follow_sends_through_the_sdk_and_shows_the_result(aws) -> None:
    finisher = finish_when_created(aws, SUMMARY)
    result = CliRunner().invoke(app, ["run", str(EXAMPLE), "--direct", "--follow", "--poll-s", "1", "--region", REGION, "--name", "nb-1"])
    finisher.join()
    assert result.exit_code == 0, result.output
    assert f"sent by {sdk.sdk_version()}" in result.stderr and "Completed" in result.stdout and "184.0 / 190.0 ms" in result.stdout
    (sent,) = aws.created
    assert sent["Tags"][-1] == {"Key": "run_id", "Value": "nb-1"}


def test_run_direct_without_figures_exits_1_and_no_sdk_says_nothing_of_a_fallback(aws) -> None:
    finisher = finish_when_created(aws, None)
    result = CliRunner().invoke(app, ["run", str(EXAMPLE), "--direct", "--no-sdk", "--follow", "--poll-s", "1", "--region", REGION, "--json"])
    finisher.join()
    assert result.exit_code == 1
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "Failed" and outcome["failure_reason"].startswith("NoSummary")
    assert (outcome["sent_by"], outcome["fallback"]) == ("boto3", None)
    assert "sent by boto3" in result.stderr and "note:" not in result.stderr
    misplaced = CliRunner().invoke(app, ["run", str(EXAMPLE), "--no-sdk", "--region", REGION])
    assert misplaced.exit_code == 2 and "--no-sdk goes with --direct" in misplaced.stderr
