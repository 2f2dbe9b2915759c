"""The synthesized "training run" state machine, executed by moto's Step Functions interpreter, with our
real handlers (harness: tests/workflows/conftest.py)."""

from __future__ import annotations

import json
import time

import pytest

from lambdas.stop_job.handler import handler as stop
from tests.lambdas.conftest import RESULTS_BUCKET, LambdaContext
from tests.workflows.conftest import SPEC, Scenario


def history_states(harness, execution_arn: str) -> list[str]:
    """The names of the states the execution passed through, in order (every page of its history)."""
    names, token = [], None
    while True:
        page = harness.sfn.get_execution_history(executionArn=execution_arn, maxResults=1000, **({"nextToken": token} if token else {}))
        names += [e["stateExitedEventDetails"]["name"] for e in page["events"] if "stateExitedEventDetails" in e]
        token = page.get("nextToken")
        if not token:
            return names


SUMMARY = {"timed_steps": 100, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}


def test_a_job_without_capacity_is_launched_again_and_the_run_succeeds(run, monkeypatch) -> None:
    monkeypatch.setenv("RELAUNCH_BACKOFF_S", "1")  # the stack's capacity_backoff_s (120 s by default)
    harness = run(Scenario(capacity_failures=2, summary=SUMMARY))
    execution_arn = harness.start(SPEC, "run-capacity")
    execution = harness.wait(execution_arn, timeout_s=90)
    assert execution["status"] == "SUCCEEDED", execution
    result = harness.result("run-capacity")
    assert result["status"] == "Completed" and len(result["capacity_attempts"]) == 2
    assert all(a["failure_reason"].startswith("CapacityError: Unable to provision") for a in result["capacity_attempts"])
    jobs = [harness.job_of(execution_arn, SPEC["run_name"], attempt) for attempt in range(3)]
    assert [a["job_name"] for a in result["capacity_attempts"]] == jobs[:2] and result["job_name"] == jobs[2]
    assert sorted(harness.training_jobs()) == sorted(jobs)
    assert history_states(harness, execution_arn).count("Back off") == 2


def test_capacity_that_never_comes_fails_the_run_after_the_last_relaunch(run, monkeypatch) -> None:
    monkeypatch.setenv("RELAUNCH_BACKOFF_S", "1")
    monkeypatch.setenv("CAPACITY_RELAUNCHES", "1")
    harness = run(Scenario(capacity_failures=10))
    execution = harness.wait(harness.start(SPEC, "run-no-capacity"), timeout_s=90)
    assert execution["status"] == "FAILED" and execution["error"] == "TrainingJobFailed"
    result = harness.result("run-no-capacity")
    assert result["failure_reason"].startswith("CapacityError") and len(result["capacity_attempts"]) == 1
    assert len(harness.training_jobs()) == 2


def test_a_job_that_never_starts_training_is_stopped_at_the_end_of_the_start_window(run, monkeypatch) -> None:
    monkeypatch.setenv("START_TIMEOUT_S", "3")  # the stack's start_timeout_s (2 h by default)
    harness = run(Scenario(starts_for_s=None))
    execution_arn = harness.start(SPEC, "run-never-starts")
    execution = harness.wait(execution_arn, timeout_s=60)
    assert execution["status"] == "FAILED" and execution["error"] == "RunFailed"
    result = harness.result("run-never-starts")
    assert result["failure_reason"].startswith("StartTimedOut") and result["status"] == "Stopped"


def test_a_run_that_completes_writes_its_result(run) -> None:
    harness = run(Scenario(summary={"timed_steps": 100, "step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 186.0}, "wall_ms_per_step": 201.0,
                                    "samples_per_s": 347.8}))
    execution = harness.wait(harness.start(SPEC, "run-ok"))
    assert execution["status"] == "SUCCEEDED", execution
    output = json.loads(execution["output"])
    assert output["job"]["status"] == "Completed"
    result = harness.result("run-ok")
    assert result["status"] == "Completed" and result["step_time_ms"]["p50"] == 184.0
    assert result["billed_ms_per_step"] == 201.0  # the wall per step, beside the p50
    assert result["cost_per_1k_steps_usd"] == pytest.approx(5.661 * 0.201 / 3.6, rel=1e-4)


def test_a_failed_job_fails_the_execution_and_records_why(run) -> None:
    harness = run(Scenario(final_status="Failed", failure_reason="AlgorithmError: trainer exited with 137"))
    execution = harness.wait(harness.start(SPEC, "run-failed"))
    assert execution["status"] == "FAILED" and execution["error"] == "TrainingJobFailed"
    result = harness.result("run-failed")
    assert result["status"] == "Failed" and result["failure_reason"] == "AlgorithmError: trainer exited with 137"


def test_a_throttled_launch_is_retried(run) -> None:
    # botocore retries a throttled call 4 times itself (lambdas/clients.py: 5 attempts); when all five are
    # refused, the state machine sees LaunchThrottled, and its Retry launches again.
    harness = run(Scenario(throttle_first_launches=5, summary={"timed_steps": 100, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
    execution_arn = harness.start(SPEC, "run-throttled")
    execution = harness.wait(execution_arn, timeout_s=90)
    assert execution["status"] == "SUCCEEDED", execution
    history = harness.sfn.get_execution_history(executionArn=execution_arn)["events"]
    failures = [e for e in history if e["type"] == "LambdaFunctionFailed"]
    assert [json.loads(e["lambdaFunctionFailedEventDetails"]["cause"])["errorType"] for e in failures] == ["LaunchThrottled"]
    assert len(harness.training_jobs()) == 1


def test_an_invalid_spec_fails_naming_the_field_and_launches_nothing(run) -> None:
    harness = run(Scenario())
    execution = harness.wait(harness.start(SPEC | {"instance_groups": []}, "run-invalid"))
    assert execution["status"] == "FAILED" and execution["error"] == "InvalidJobSpec"
    assert "instance_groups" in execution["cause"]
    assert harness.training_jobs() == []


def test_a_spec_over_the_cost_ceiling_fails_with_the_figure_and_launches_nothing(run) -> None:
    harness = run(Scenario())
    costly = SPEC | {"max_runtime_s": 5 * 24 * 3600, "instance_groups": [
        SPEC["instance_groups"][0], SPEC["instance_groups"][1] | {"instance_type": "ml.p4d.24xlarge", "count": 20}]}
    execution = harness.wait(harness.start(costly, "run-costly"))
    assert execution["status"] == "FAILED" and execution["error"] == "InvalidJobSpec"
    assert "may cost $90,671.52, above the ceiling of $1,000.00" in execution["cause"]  # (1.836 + 20 × 37.688) × 120 h
    assert harness.training_jobs() == []


def test_a_job_running_past_the_specs_runtime_is_stopped_and_the_run_fails(run, monkeypatch) -> None:
    monkeypatch.setenv("DEADLINE_GRACE_S", "0")  # no grace: the state machine stops the job at the runtime
    harness = run(Scenario(runs_for_s=600, starts_for_s=3))  # SageMaker never stops it on its own here
    spec = SPEC | {"max_runtime_s": 60}  # the shortest runtime a spec may ask for
    execution_arn = harness.start(spec, "run-overtime")
    execution = harness.wait(execution_arn, timeout_s=120)
    assert execution["status"] == "FAILED" and execution["error"] == "RunFailed"
    # The deadline counts from the job's training start: the polls while it started (SecondaryStatus
    # Starting) came out of the start window, and the whole runtime's 60 polls were still spent training.
    counted = history_states(harness, execution_arn)
    assert counted.count("Count down the start") >= 1 and counted.count("Count down") == 60
    job_name = harness.job_of(execution_arn, SPEC["run_name"])
    assert harness.sagemaker.describe_training_job(TrainingJobName=job_name)["TrainingJobStatus"] == "Stopped"
    result = harness.result("run-overtime")
    assert result["failure_reason"] == "RunTimedOut: the job ran past the spec's max_runtime_s"
    # Recorded once SageMaker had stopped the job: its terminal status and billable time, not "Stopping".
    assert result["status"] == "Stopped" and result["billable_seconds"] == 120


@pytest.mark.parametrize("ending", ["ABORTED", "TIMED_OUT"])
def test_an_execution_ended_from_outside_has_its_job_stopped(run, platform, ending: str) -> None:
    harness = run(Scenario(runs_for_s=600))
    execution_arn = harness.start(SPEC, f"run-{ending.lower()}")
    job_name = harness.job_of(execution_arn, SPEC["run_name"])
    give_up = time.monotonic() + 30
    while job_name not in harness.training_jobs() or harness.job(job_name).training_job_status != "InProgress":
        assert time.monotonic() < give_up, "the job was never launched"
        time.sleep(0.2)
    harness.sfn.stop_execution(executionArn=execution_arn)  # moto reports ABORTED; a timeout ends the same way
    described = harness.wait(execution_arn, timeout_s=30)
    assert described["status"] == "ABORTED"
    detail = {"executionArn": execution_arn, "stateMachineArn": harness.state_machine_arn, "status": ending,
              "input": described["input"], "name": described["name"],
              "startDate": int(described["startDate"].timestamp() * 1000)}  # as EventBridge sends it: epoch ms
    delivered = harness.route_status_change(platform, detail)
    assert harness.route_status_change(platform, detail | {"status": "SUCCEEDED"}) is None
    assert harness.route_status_change(platform, detail | {"stateMachineArn": harness.state_machine_arn + "-other"}) is None
    assert delivered is not None and delivered["detail"]["status"] == ending
    reply = stop(delivered, LambdaContext(function_name="StopJob"))  # the event as the rule delivers it
    assert reply == {"job_name": job_name, "stopped": True, "status": "Stopping"}
    assert harness.sagemaker.describe_training_job(TrainingJobName=job_name)["TrainingJobStatus"] in ("Stopping", "Stopped")


def test_a_throttled_poll_never_stops_a_healthy_job(run) -> None:
    """Describe refused 10 times in a row (botocore's own retries, the state's retries with jitter, then
    "Poll failed" counted as a poll): the job runs on and the run completes."""
    harness = run(Scenario(throttle_describes=10, runs_for_s=3, summary={"timed_steps": 100, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
    execution_arn = harness.start(SPEC, "run-poll-throttled")
    execution = harness.wait(execution_arn, timeout_s=240)
    assert execution["status"] == "SUCCEEDED", execution
    assert harness.faults["describes_throttled"] == 10
    job_name = harness.job_of(execution_arn, SPEC["run_name"])
    assert harness.sagemaker.describe_training_job(TrainingJobName=job_name)["TrainingJobStatus"] == "Completed"  # never stopped
    assert harness.result("run-poll-throttled")["status"] == "Completed"


def test_a_stop_that_keeps_failing_is_retried_then_recorded(run, monkeypatch) -> None:
    monkeypatch.setenv("DEADLINE_GRACE_S", "0")
    harness = run(Scenario(runs_for_s=600, stop_fails=True))
    execution_arn = harness.start(SPEC | {"max_runtime_s": 60}, "run-stop-fails")
    execution = harness.wait(execution_arn, timeout_s=240)
    assert execution["status"] == "FAILED" and execution["error"] == "RunFailed"
    assert harness.faults["stop_attempts"] == 5  # one attempt and four retries; then the abort rule takes over
    result = harness.result("run-stop-fails")
    assert result["failure_reason"] == "RunTimedOut: the job ran past the spec's max_runtime_s"


def test_an_unreadable_output_archive_is_a_failed_run_whose_result_says_so(run) -> None:
    harness = run(Scenario(archive=b"\x1f\x8b truncated"))
    execution = harness.wait(harness.start(SPEC, "run-unreadable"))
    assert execution["status"] == "FAILED" and execution["error"] == "RunFailed"
    result = harness.result("run-unreadable")
    assert result["job_status"] == "Completed" and result["status"] == "Failed"
    assert result["failure_reason"].startswith("SummaryUnreadable: output.tar.gz cannot be read")


def test_runs_of_one_spec_keep_their_own_checkpoints_unless_one_resumes_another(run) -> None:
    harness = run(Scenario(runs_for_s=0.5, summary={"timed_steps": 100, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
    # Resuming a run that left no checkpoints is refused: it would silently train from scratch.
    refused = harness.wait(harness.start(SPEC | {"resume_from": "week-0"}, "week-0-more"))
    assert refused["status"] == "FAILED" and refused["error"] == "LaunchFailed" and "NothingToResume" in refused["cause"]
    jobs = {}
    for name, spec in (("week-1", SPEC), ("week-2", SPEC), ("week-2-more", SPEC | {"resume_from": "week-2"})):
        execution_arn = harness.start(spec, name)
        assert harness.wait(execution_arn)["status"] == "SUCCEEDED"
        jobs[name] = harness.sagemaker.describe_training_job(TrainingJobName=harness.job_of(execution_arn, SPEC["run_name"]))
        # What SageMaker syncs from the job's /opt/ml/checkpoints, under its own prefix.
        uri = jobs[name]["CheckpointConfig"]["S3Uri"]
        harness.s3.put_object(Bucket=RESULTS_BUCKET, Key=uri.split("/", 3)[3] + "checkpoint.pt", Body=b"state")
    checkpoints = {name: job["CheckpointConfig"]["S3Uri"] for name, job in jobs.items()}
    assert checkpoints["week-1"].endswith("/checkpoints/week-1/") and checkpoints["week-2"].endswith("/checkpoints/week-2/")
    # The resuming run reads week-2's checkpoints (a channel on its DNN group) and writes only its own.
    assert checkpoints["week-2-more"].endswith("/checkpoints/week-2-more/")
    (resume,) = [c for c in jobs["week-2-more"]["InputDataConfig"] if c["ChannelName"] == "resume"]
    assert resume["DataSource"]["S3DataSource"]["S3Uri"] == checkpoints["week-2"]
    assert resume["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["dnn_group"]


def test_the_reconciler_stops_a_job_whose_execution_ended_and_spares_the_others(run) -> None:
    """An execution aborted with its cleanup event lost: the scheduled reconciler finds the job by its
    execution tag and stops it; a running execution's job and a job launched outside the platform's
    runs are left alone."""
    from lambdas.reconcile_jobs.handler import handler as reconcile

    harness = run(Scenario(runs_for_s=600))
    orphaned, healthy = harness.start(SPEC, "run-orphaned"), harness.start(SPEC | {"run_name": "other-run"}, "run-healthy")
    jobs = {arn: harness.job_of(arn, name) for arn, name in ((orphaned, SPEC["run_name"]), (healthy, "other-run"))}
    give_up = time.monotonic() + 30
    while not set(jobs.values()) <= set(harness.training_jobs()):
        assert time.monotonic() < give_up, "the jobs were never launched"
        time.sleep(0.2)
    harness.sagemaker.create_training_job(**_outside_job(harness.job(jobs[healthy])))
    harness.job("hetero-by-hand-0000000000").training_job_status = "InProgress"  # moto's would complete at once
    harness.sfn.stop_execution(executionArn=orphaned)  # and no EventBridge delivery follows
    harness.wait(orphaned, timeout_s=30)
    reply = reconcile({}, LambdaContext(function_name="ReconcileJobs"))
    assert reply["stopped"] == [jobs[orphaned]] and reply["checked"] == 3
    assert harness.job(jobs[orphaned]).training_job_status in ("Stopping", "Stopped")
    assert harness.job(jobs[healthy]).training_job_status == "InProgress"
    assert harness.job("hetero-by-hand-0000000000").training_job_status == "InProgress"
    harness.sfn.stop_execution(executionArn=healthy)


def _outside_job(template) -> dict:
    """A running job of the platform's prefix that no training run launched (no execution tag)."""
    return {"TrainingJobName": "hetero-by-hand-0000000000", "AlgorithmSpecification": {"TrainingImage": template.algorithm_specification["TrainingImage"], "TrainingInputMode": "File"},
            "RoleArn": template.role_arn, "OutputDataConfig": template.output_data_config,
            "ResourceConfig": {"InstanceType": "ml.c5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
            "StoppingCondition": {"MaxRuntimeInSeconds": 3600}}


def test_a_completed_runs_result_survives_a_throttled_collect(run) -> None:
    """DescribeTrainingJob throttled past botocore's five attempts once the job completed: the collect is
    retried by the state machine, and the paid run's result is Completed, not a write-once Failed."""
    harness = run(Scenario(throttle_describes_when_done=6, summary=SUMMARY))
    execution_arn = harness.start(SPEC, "run-collect-throttled")
    execution = harness.wait(execution_arn, timeout_s=240)
    assert execution["status"] == "SUCCEEDED", execution
    assert harness.faults["describes_throttled"] == 6
    assert harness.result("run-collect-throttled")["status"] == "Completed"
    assert history_states(harness, execution_arn).count("Collect results") == 1  # one state, retried within


def test_executions_never_share_a_job_and_an_abort_touches_only_its_own(run, platform) -> None:
    """Two executions whose run names are 40 characters alike but for their last: each its own job (the
    job name is never cut, so its per-execution hash stays); aborting one stops its job only. The run
    names the review used (56 characters, hyphens) are refused before anything launches."""
    harness = run(Scenario(runs_for_s=600))
    long = "team-a--vision--hetero--c5-9xl--p3-2xl--2026-12-01--run-1"
    refused = harness.wait(harness.start(SPEC | {"run_name": long}, "run-long-name"), timeout_s=30)
    assert refused["status"] == "FAILED" and refused["error"] == "InvalidJobSpec" and harness.training_jobs() == []
    names = ["team-a--vision--hetero--c5-9xl--2026-1", "team-a--vision--hetero--c5-9xl--2026-2"]
    assert all(len(name) <= 40 for name in names)
    arns = [harness.start(SPEC | {"run_name": name}, f"run-share-{index}") for index, name in enumerate(names)]
    jobs = [harness.job_of(arn, name) for arn, name in zip(arns, names, strict=True)]
    give_up = time.monotonic() + 30
    while sorted(harness.training_jobs()) != sorted(jobs) or any(harness.job(job).training_job_status != "InProgress" for job in jobs):
        assert time.monotonic() < give_up, harness.training_jobs()
        time.sleep(0.2)
    assert len(set(jobs)) == 2
    harness.sfn.stop_execution(executionArn=arns[1])
    described = harness.wait(arns[1], timeout_s=30)
    detail = {"executionArn": arns[1], "stateMachineArn": harness.state_machine_arn, "status": "ABORTED",
              "input": described["input"], "name": described["name"], "startDate": int(described["startDate"].timestamp() * 1000)}
    stop(harness.route_status_change(platform, detail), LambdaContext(function_name="StopJob"))
    assert harness.job(jobs[1]).training_job_status in ("Stopping", "Stopped")
    assert harness.job(jobs[0]).training_job_status == "InProgress"
    assert harness.sfn.describe_execution(executionArn=arns[0])["status"] == "RUNNING"
    harness.sfn.stop_execution(executionArn=arns[0])
