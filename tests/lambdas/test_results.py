"""result.json's start-up figures, from DescribeTrainingJob's shape and the trainer's summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lambdas.core.results import startup_times

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_billed_time_before_the_first_batch_adds_the_download_and_the_containers_start() -> None:
    describe = {
        "TrainingStartTime": at(120),  # billing starts once the instances are up
        "SecondaryStatusTransitions": [
            {"Status": "Starting", "StartTime": T0, "EndTime": at(120)},
            {"Status": "Downloading", "StartTime": at(120), "EndTime": at(300)},
            {"Status": "Training", "StartTime": at(330), "EndTime": at(900)},
            {"Status": "Uploading", "StartTime": at(900)},
        ],
    }
    assert startup_times(describe, {"time_to_first_batch_s": 42.5}) == {
        "downloading_s": 180.0, "billed_before_training_s": 210.0, "container_to_first_batch_s": 42.5, "billed_to_first_batch_s": 252.5,
    }


def test_a_fastfile_job_has_no_download_and_a_job_without_transitions_keeps_the_containers_part() -> None:
    fastfile = {"TrainingStartTime": at(100), "SecondaryStatusTransitions": [
        {"Status": "Starting", "StartTime": T0, "EndTime": at(100)}, {"Status": "Training", "StartTime": at(130)}]}
    assert startup_times(fastfile, {"time_to_first_batch_s": 70}) == {
        "downloading_s": None, "billed_before_training_s": 30.0, "container_to_first_batch_s": 70.0, "billed_to_first_batch_s": 100.0}
    bare = startup_times({"TrainingStartTime": at(5)}, {"time_to_first_batch_s": 12.0})
    assert bare == {"downloading_s": None, "billed_before_training_s": None, "container_to_first_batch_s": 12.0, "billed_to_first_batch_s": None}
    assert startup_times({}, None)["container_to_first_batch_s"] is None
    assert startup_times({}, {"time_to_first_batch_s": True})["container_to_first_batch_s"] is None  # not a number
    assert startup_times({}, {"time_to_first_batch_s": "12"})["container_to_first_batch_s"] is None
