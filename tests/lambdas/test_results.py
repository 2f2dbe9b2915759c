"""result.json's start-up figures, from DescribeTrainingJob's shape and the trainer's summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lambdas.core.results import startup_times

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_billed_time_to_the_first_batch_counts_from_billings_start_to_the_last_ranks_first_batch() -> None:
    # The Training secondary status begins with "Downloading the training image": the pull is billed time
    # that neither the Downloading status nor the container sees, so the figure is counted between instants.
    describe = {
        "TrainingStartTime": at(120),  # billing starts once the instances are up
        "SecondaryStatusTransitions": [
            {"Status": "Starting", "StartTime": T0, "EndTime": at(120)},
            {"Status": "Downloading", "StartTime": at(120), "EndTime": at(300)},
            {"Status": "Training", "StartTime": at(300), "EndTime": at(900)},
            {"Status": "Uploading", "StartTime": at(900)},
        ],
    }
    summary = {"container_started_at": at(420).timestamp(), "first_batch_at": at(462.5).timestamp(), "time_to_first_batch_s": 42.5}
    assert startup_times(describe, summary) == {
        "billed_to_first_batch_s": 342.5, "downloading_s": 180.0, "billed_before_container_s": 300.0, "container_to_first_batch_s": 42.5,
    }


def test_a_fastfile_job_has_no_download_and_a_job_without_billing_start_keeps_the_containers_part() -> None:
    fastfile = {"TrainingStartTime": at(100), "SecondaryStatusTransitions": [
        {"Status": "Starting", "StartTime": T0, "EndTime": at(100)}, {"Status": "Training", "StartTime": at(100)}]}
    summary = {"container_started_at": at(160).timestamp(), "first_batch_at": at(230).timestamp(), "time_to_first_batch_s": 70}
    assert startup_times(fastfile, summary) == {
        "billed_to_first_batch_s": 130.0, "downloading_s": None, "billed_before_container_s": 60.0, "container_to_first_batch_s": 70.0}
    assert startup_times({}, summary) == {
        "billed_to_first_batch_s": None, "downloading_s": None, "billed_before_container_s": None, "container_to_first_batch_s": 70.0}
    assert startup_times({}, None)["container_to_first_batch_s"] is None
    assert startup_times(fastfile, {"first_batch_at": True, "time_to_first_batch_s": "12"}) == {
        "billed_to_first_batch_s": None, "downloading_s": None, "billed_before_container_s": None, "container_to_first_batch_s": None}
