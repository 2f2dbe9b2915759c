"""result.json's figures: start-up times from DescribeTrainingJob's shape and the trainer's summary; the bounded read of the summary."""

from __future__ import annotations

import io
import json
import tarfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from lambdas.core import results
from lambdas.core.results import SummaryUnreadable, startup_times, summary_from_output_archive

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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


def test_an_archive_that_inflates_past_the_bound_is_refused_without_inflating_it_all(monkeypatch) -> None:
    """64 MiB of gzip can inflate to tens of GiB (26.9 s per 4 GiB): read on, the collect would time out
    and the run's result be lost. Past MAX_INFLATED_BYTES before the summary, it is SummaryUnreadable."""
    monkeypatch.setattr(results, "MAX_INFLATED_BYTES", 1 << 20)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in (("data/zeros.bin", bytes(4 << 20)), ("data/summary.json", json.dumps({"timed_steps": 1}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = buffer.getvalue()
    assert len(archive) < 64 << 10  # small on S3, large inflated
    with pytest.raises(SummaryUnreadable, match="inflates to more than 1048576 bytes"):
        summary_from_output_archive(archive)
    monkeypatch.setattr(results, "MAX_INFLATED_BYTES", 8 << 20)  # within the bound, the summary is found
    assert summary_from_output_archive(archive) == {"timed_steps": 1}


def test_a_result_holds_the_steady_state_cost_the_whole_runs_billed_cost_and_the_cost_with_its_start_up() -> None:
    from lambdas.core.price_performance import FALLBACK_PRICES

    spec = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    fastfile = {"TrainingJobStatus": "Completed", "BillableTimeInSeconds": 400, "TrainingStartTime": at(100),
                "SecondaryStatusTransitions": [{"Status": "Starting", "StartTime": T0, "EndTime": at(100)},
                                               {"Status": "Training", "StartTime": at(100)}]}
    # A resumed job: steps 200 to 500, of which 295 timed at 200 ms (its warm-up and its compile not timed).
    summary = {"container_started_at": at(160).timestamp(), "first_batch_at": at(230).timestamp(), "time_to_first_batch_s": 70,
               "steps": 500, "start_step": 200, "timed_steps": 295, "step_time_ms": {"p50": 180.0, "p90": 190.0, "mean": 185.0},
               "wall_ms_per_step": 200.0}
    groups = [(group["instance_type"], group["count"]) for group in spec["instance_groups"]]
    document = results.result_document(run_id="r", groups=groups, raw_spec=spec, job_name="j", describe=fastfile, summary=summary,
                                       prices=FALLBACK_PRICES)
    hourly = document["usd_per_hour"]
    assert document["spec_steps"] == spec["hyperparameters"]["steps"] and document["steps_trained"] == 300
    assert document["billable_seconds"] == 400 and document["billed_overhead_s"] == pytest.approx(400 - 295 * 0.2)
    assert document["cost_per_1k_steps_usd"] == pytest.approx(hourly * 0.200 / 3.6, rel=1e-5)  # the steady state
    assert document["run_cost_usd"] == pytest.approx(400 / 3600 * hourly, abs=1e-4)  # all of it, start-up included
    # The whole bill over the 300 steps this job trained.
    assert document["cost_per_1k_steps_with_startup_usd"] == pytest.approx(400 / 3600 * hourly * 1000 / 300, rel=1e-5)
    no_summary = results.result_document(run_id="r", groups=groups, raw_spec=spec, job_name="j", describe=fastfile, summary=None,
                                         prices=FALLBACK_PRICES)
    assert no_summary["steps_trained"] is None and no_summary["cost_per_1k_steps_with_startup_usd"] is None
