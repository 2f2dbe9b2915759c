"""The Lambda handlers, each run for real against moto: validate, launch, collect, stop."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import boto3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moto.core.exceptions import JsonRESTError
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends

from lambdas.collect_results.handler import handler as collect
from lambdas.core.deadlines import COLLECT_FINAL_ERRORS
from lambdas.core.execution import job_name_for_execution
from lambdas.core.job_spec import JobSpecError
from lambdas.core.results import ResultExistsError
from lambdas.core.sweep import SweepSpecError
from lambdas.launch_job.handler import (
    CapacityUnavailable,
    CheckpointsExist,
    JobNameTaken,
    LaunchThrottled,
    RunIdTaken,
    RunIdUnsupported,
    RunNameInUse,
)
from lambdas.launch_job.handler import handler as launch
from lambdas.plan_sweep.handler import handler as plan_sweep
from lambdas.stop_job.handler import handler as stop
from lambdas.validate_spec.handler import handler as validate
from tests.lambdas.conftest import ACCOUNT, REGION, RESULTS_BUCKET, output_archive

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXECUTION = "arn:aws:states:us-east-1:123456789012:execution:training-run:run-0001"
STARTED = "2026-11-30T12:00:00.000Z"  # $$.Execution.StartTime


def spec(name: str = "pytorch-heterogeneous.json") -> dict:
    return json.loads((EXAMPLES / name).read_text())


def test_validate_summarises_a_valid_spec_and_refuses_an_invalid_one(aws, context) -> None:
    assert validate(spec(), context) == {"run_name": "vision-hetero", "variant": "pytorch", "heterogeneous": True, "instances": 2,
                                         "worst_case_cost_usd": 5.66, "cost_ceiling_usd": 1000.0}
    with pytest.raises(JobSpecError, match="instance_groups"):
        validate(spec() | {"instance_groups": []}, context)


def test_validate_and_launch_apply_the_deployments_policy(aws, context) -> None:
    """The environment's allow-list and ceiling (set by the stack) refuse before anything is created."""
    elsewhere = spec() | {"inputs": {"train": {"s3_uri": "s3://not-ours/x/", "groups": ["data_group"]}}}
    costly = spec() | {"max_runtime_s": 5 * 24 * 3600, "instance_groups": [
        {"name": "data_group", "role": "data", "instance_type": "ml.c5.18xlarge", "count": 4},
        {"name": "dnn_group", "role": "dnn", "instance_type": "ml.p4d.24xlarge", "count": 2}]}
    for refused, message in ((elsewhere, "'not-ours' is not one the platform's jobs may read"), (costly, r"may cost \$10,807.68")):
        with pytest.raises(JobSpecError, match=message):
            validate(refused, context)
        with pytest.raises(JobSpecError, match=message):
            launch({"spec": refused, "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []


# The SHA-256 of the archive the tests upload (b"packed code"): the launch checks the bytes against it.
ARCHIVE = b"packed code"
SHA = __import__("hashlib").sha256(ARCHIVE).hexdigest()


def user_workload(code: str, base: dict | None = None) -> dict:
    workload = {"code": code} | ({"sha256": SHA} if code.startswith("s3://") else {})
    return (base or spec()) | {"workload": workload, "hyperparameters": {"steps": 100, "hidden": 64}}


def test_validate_launch_and_plan_refuse_a_local_code_folder_naming_hetero_run(aws, context) -> None:
    """The state machine cannot read the user's disk: a folder reaches no job (`hetero run` uploads it)."""
    local = user_workload("my_workload")
    for step in (lambda: validate(local, context),
                 lambda: launch({"spec": local, "execution_arn": EXECUTION, "execution_start": STARTED}, context)):
        with pytest.raises(JobSpecError, match="a local folder: start the run with `hetero run`, which uploads it") as refused:
            step()
        assert refused.value.field == "workload.code"
    with pytest.raises(SweepSpecError, match="which uploads it") as refused:
        plan_sweep({"input": {"sweep_name": "mine", "configurations": [local]}, "execution_name": "mine-1"}, context)
    assert refused.value.field == "configurations[0].workload.code"
    assert aws.training_jobs() == []


def test_launch_takes_code_only_from_code_sha256_of_its_results_bucket(aws, context) -> None:
    from lambdas.launch_job.handler import CodeMissing

    for elsewhere in (f"s3://datasets-bucket/code/{SHA}/sourcedir.tar.gz", f"s3://{RESULTS_BUCKET}/code/{'cd' * 32}/sourcedir.tar.gz"):
        with pytest.raises(JobSpecError, match="only from its platform's results bucket"):
            launch({"spec": user_workload(elsewhere), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []
    # An archive that is not there (an execution started by hand, past the client): refused, nothing billed.
    with pytest.raises(CodeMissing, match=f"code/{SHA}/sourcedir.tar.gz does not exist: start the run with `hetero run`"):
        launch({"spec": user_workload(f"s3://{RESULTS_BUCKET}/code/{SHA}/sourcedir.tar.gz"), "execution_arn": EXECUTION,
                "execution_start": STARTED}, context)
    # Other bytes under the archive's name (planted by anyone who may write code/): every host would refuse them.
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"code/{SHA}/sourcedir.tar.gz", Body=b"other bytes", IfNoneMatch="*")
    with pytest.raises(CodeMissing, match="holds other bytes than its name says"):
        launch({"spec": user_workload(f"s3://{RESULTS_BUCKET}/code/{SHA}/sourcedir.tar.gz"), "execution_arn": EXECUTION,
                "execution_start": STARTED}, context)
    assert aws.training_jobs() == []
    aws.s3.delete_object(Bucket=RESULTS_BUCKET, Key=f"code/{SHA}/sourcedir.tar.gz")
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"code/{SHA}/sourcedir.tar.gz", Body=ARCHIVE, IfNoneMatch="*")
    launched = launch({"spec": user_workload(f"s3://{RESULTS_BUCKET}/code/{SHA}/sourcedir.tar.gz"), "execution_arn": EXECUTION,
                       "execution_start": STARTED}, context)
    described = aws.sagemaker.describe_training_job(TrainingJobName=launched["job_name"])
    (code,) = [channel for channel in described["InputDataConfig"] if channel["ChannelName"] == "code"]
    assert code["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{RESULTS_BUCKET}/code/{SHA}/sourcedir.tar.gz"
    assert described["HyperParameters"]["workload_sha256"] == SHA and described["HyperParameters"]["workload_module"] == "workload"


def test_launch_creates_the_job_once_per_execution(aws, context) -> None:
    first = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert first["job_name"] == job_name_for_execution("hetero", "vision-hetero", EXECUTION, STARTED)
    assert first["job_name"].startswith("hetero-vision-hetero-")
    described = aws.sagemaker.describe_training_job(TrainingJobName=first["job_name"])
    assert [g["InstanceGroupName"] for g in described["ResourceConfig"]["InstanceGroups"]] == ["data_group", "dnn_group"]
    assert "shutdown_token" not in described["HyperParameters"]
    token = aws.s3.get_object(Bucket=RESULTS_BUCKET, Key=f"control/{first['job_name']}/shutdown_token")["Body"].read()
    assert len(token) >= 32
    again = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)  # a retried launch
    assert again == first and aws.training_jobs() == [first["job_name"]]
    # ... which keeps the token the job has (it may have read it already).
    assert aws.s3.get_object(Bucket=RESULTS_BUCKET, Key=f"control/{first['job_name']}/shutdown_token")["Body"].read() == token
    # The same execution name used again (90 days on) is another execution: it gets a job of its own,
    # once the first one is no longer running (one run name runs once at a time).
    later = {"spec": spec(), "execution_arn": EXECUTION, "execution_start": "2027-03-01T08:00:00.000Z"}
    jobs = sagemaker_backends[ACCOUNT][REGION].training_jobs
    jobs[first["job_name"]].training_job_status = "InProgress"  # moto's jobs complete at once; a real one runs
    with pytest.raises(RunNameInUse, match=f"run 'vision-hetero' is running already \\(training job {first['job_name']}\\)"):
        launch(later, context)
    assert aws.training_jobs() == [first["job_name"]]
    jobs[first["job_name"]].training_job_status = "Completed"
    reused = launch(later, context)
    assert reused["job_name"] != first["job_name"] and len(aws.training_jobs()) == 2


def test_the_run_may_poll_for_the_specs_runtime_plus_grace() -> None:
    from lambdas.core.deadlines import MAX_POLLS, poll_plan

    assert poll_plan(3600, 900, 60, 7200) == (60, 75, 120)
    assert poll_plan(60, 0, 7) == (7, 9, 0)  # rounded up: the deadline only ever errs late
    # Long runtimes poll less often instead of more: the execution's history stays bounded.
    interval, polls, start_polls = poll_plan(5 * 24 * 3600, 900, 60, 7200)
    assert polls + start_polls <= MAX_POLLS and interval * polls >= 5 * 24 * 3600 + 900 and interval * start_polls >= 7200
    assert interval == 630
    assert sum(poll_plan(28 * 24 * 3600, 900, 60, 24 * 3600)[1:]) <= MAX_POLLS  # SageMaker's longest MaxRuntime too


def test_a_capacity_relaunch_carries_the_budgets_over_and_records_the_attempt() -> None:
    from lambdas.launch_job.handler import CapacityUnavailable as NoCapacity
    from lambdas.launch_job.handler import next_attempt

    first = {"job_name": "hetero-r-0", "poll_interval_s": 60, "polls": {"left": 75, "start_left": 118}, "attempt": 0,
             "relaunches_left": 2, "backoff_s": 120, "attempts": []}
    second = next_attempt(first, "CapacityError: Unable to provision")
    assert second == {"poll_interval_s": 60, "polls": {"left": 75, "start_left": 118}, "attempt": 1, "relaunches_left": 1,
                      "backoff_s": 240, "attempts": [{"job_name": "hetero-r-0", "failure_reason": "CapacityError: Unable to provision"}]}
    third = next_attempt(second | {"job_name": "hetero-r-1"}, "CapacityError: again")
    assert [a["job_name"] for a in third["attempts"]] == ["hetero-r-0", "hetero-r-1"] and third["relaunches_left"] == 0
    with pytest.raises(NoCapacity, match="no relaunches left after 3 attempts"):
        next_attempt(third | {"job_name": "hetero-r-2"}, "CapacityError")


def test_a_relaunch_creates_the_next_attempts_job_once(aws, context) -> None:
    first = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    sagemaker_backends[ACCOUNT][REGION].training_jobs[first["job_name"]].training_job_status = "Failed"
    event = {"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED, "previous": first, "failure_reason": "CapacityError: x"}
    second = launch(event, context)
    assert second["job_name"] == job_name_for_execution("hetero", "vision-hetero", EXECUTION, STARTED, 1) != first["job_name"]
    assert second["attempt"] == 1 and second["attempts"] == [{"job_name": first["job_name"], "failure_reason": "CapacityError: x"}]
    assert launch(event, context) == second and len(aws.training_jobs()) == 2  # a retried relaunch finds its job
    # The abort cleanup finds the running job whichever attempt it is.
    sagemaker_backends[ACCOUNT][REGION].training_jobs[second["job_name"]].training_job_status = "InProgress"
    detail = {"executionArn": EXECUTION, "startDate": 1796040000000, "input": json.dumps(spec())}
    assert STARTED == "2026-11-30T12:00:00.000Z"  # 1796040000000 ms
    stopped = stop({"detail": detail}, context)
    assert stopped == {"job_name": second["job_name"], "stopped": True, "status": "Stopping"}


def test_launch_of_an_invalid_spec_creates_nothing(aws, context) -> None:
    with pytest.raises(JobSpecError):
        launch({"spec": spec() | {"variant": "jax"}, "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []


def test_an_execution_name_no_sagemaker_tag_can_hold_is_refused_before_anything_starts(aws, context) -> None:
    """Step Functions allows ``!'()`` in execution names; SageMaker tag values do not (the reconciler
    finds a job by its execution tag). Refused, by name, with nothing created."""
    odd = EXECUTION.replace("run-0001", "run(1)!")
    with pytest.raises(RunIdUnsupported, match="letters, digits"):
        launch({"spec": spec(), "execution_arn": odd, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []
    sweep = {"sweep_name": "s", "configurations": [spec()]}
    with pytest.raises(SweepSpecError, match="execution_name"):
        plan_sweep({"input": sweep, "execution_name": "weekly(1)"}, context)
    assert plan_sweep({"input": sweep, "execution_name": "weekly-1"}, context)["configurations"][0]["execution_name"] == "weekly-1-0"


@pytest.mark.parametrize(("code", "error"), [("ThrottlingException", LaunchThrottled), ("ResourceLimitExceeded", CapacityUnavailable)])
def test_launch_names_the_errors_the_state_machine_retries(aws, context, monkeypatch, code: str, error: type) -> None:
    def refuse(self, *args, **kwargs):  # SageMaker's answer, at moto's boundary (botocore retries throttling 4 times first)
        raise JsonRESTError(code, "slow down")

    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", refuse)
    with pytest.raises(error, match="slow down"):
        launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []


def test_collect_writes_the_result_once(aws, context) -> None:
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    job = aws.training_job(name)
    job.billable_time_in_seconds = 1800
    # A median of 184 ms, and 230 ms per step over the timed steps with their evaluations and checkpoints.
    summary = {"timed_steps": 100, "step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 185.0}, "wall_ms_per_step": 230.0,
               "samples_per_s": 347.8}
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"artifacts/{name}/output/output.tar.gz", Body=output_archive(summary))
    reply = collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": name}, context)
    assert reply["result_uri"] == f"s3://{RESULTS_BUCKET}/results/run-0001/result.json"
    result = json.loads(aws.s3.get_object(Bucket=RESULTS_BUCKET, Key="results/run-0001/result.json")["Body"].read())
    assert result["status"] == "Completed" and result["step_time_ms"]["p50"] == 184.0
    assert result["usd_per_hour"] == pytest.approx(5.661)  # 1× ml.c5.9xlarge + 1× ml.p3.2xlarge
    assert result["billed_ms_per_step"] == 230.0  # what a step is billed for: not the median
    assert result["cost_per_1k_steps_usd"] == pytest.approx(5.661 * 0.230 / 3.6, rel=1e-4)
    assert result["run_cost_usd"] == pytest.approx(5.661 / 2, rel=1e-3)  # the whole run, start-up included
    assert result["spec_steps"] == spec()["hyperparameters"]["steps"]
    assert result["cost_per_1k_steps_with_startup_usd"] is None  # no billing start known here: no amortised figure
    assert result["prices"]["source"].startswith("fallback table") and result["prices"]["date"]
    # A retried collect of the same execution (its reply lost) finds its own result and returns it...
    assert collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": name}, context) == reply
    # ... but a result is never replaced by another job's (the execution name used again, 90 days on),
    # and such an execution is refused before it launches anything.
    with pytest.raises(RunIdTaken, match="results/run-0001/result.json exists already"):
        launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": "2027-03-01T08:00:00.000Z"}, context)
    assert aws.training_jobs() == [name]
    other = copy.copy(aws.training_job(name))  # a job of another execution whose result would land here
    other.training_job_name = "hetero-vision-hetero-0123456789"
    sagemaker_backends[ACCOUNT][REGION].training_jobs[other.training_job_name] = other
    with pytest.raises(ResultExistsError, match="never overwritten"):
        collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": other.training_job_name}, context)


@pytest.mark.parametrize(
    ("archive", "reason"),
    [
        (b"not a gzip archive", "SummaryUnreadable: output.tar.gz cannot be read: BadGzipFile"),
        (output_archive({"timed_steps": 0, "start_step": 60, "steps": 60, "step_time_ms": None}), "NoStepsTimed: the job trained no step"),
        (None, "NoSummary: the job completed without writing summary.json"),
    ],
    ids=["unreadable archive", "no step timed", "no summary"],
)
def test_a_completed_job_without_usable_figures_is_a_failed_run(aws, context, archive, reason) -> None:
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    if archive is not None:
        aws.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"artifacts/{name}/output/output.tar.gz", Body=archive)
    reply = collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": name}, context)
    result = json.loads(aws.s3.get_object(Bucket=RESULTS_BUCKET, Key="results/run-0001/result.json")["Body"].read())
    assert reply["status"] == result["status"] == "Failed" and result["job_status"] == "Completed"
    assert result["failure_reason"].startswith(reason)


def test_collect_records_a_failure_without_a_job(aws, context) -> None:
    failure = {"Error": "CapacityUnavailable", "Cause": "no ml.p3.2xlarge capacity"}
    reply = collect({"spec": spec(), "execution_arn": EXECUTION, "failure": failure}, context)
    result = json.loads(aws.s3.get_object(Bucket=RESULTS_BUCKET, Key="results/run-0001/result.json")["Body"].read())
    assert reply["status"] == "NotStarted" and result["failure_reason"] == "CapacityUnavailable: no ml.p3.2xlarge capacity"
    assert result["step_time_ms"] is None and result["cost_per_1k_steps_usd"] is None


def test_stop_stops_a_running_job_and_leaves_others(aws, context) -> None:
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    assert stop({"job_name": name}, context)["stopped"] is False  # moto's jobs complete at once
    aws.training_job(name).training_job_status = "InProgress"
    assert stop({"job_name": name}, context) == {"job_name": name, "stopped": True, "status": "Stopping"}
    assert aws.sagemaker.describe_training_job(TrainingJobName=name)["TrainingJobStatus"] == "Stopping"
    assert stop({"job_name": "never-launched"}, context)["status"] == "NotStarted"


def test_stop_finds_the_job_of_an_aborted_execution(aws, context) -> None:
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    aws.training_job(name).training_job_status = "InProgress"
    event = {
        "detail-type": "Step Functions Execution Status Change",
        "detail": {"executionArn": EXECUTION, "status": "ABORTED", "input": json.dumps(spec()),
                   "startDate": 1796040000000},  # EventBridge's epoch ms for STARTED
    }
    assert stop(event, context)["stopped"] is True
    garbage = {"detail": {"executionArn": EXECUTION, "status": "TIMED_OUT", "input": "not json"}}
    assert stop(garbage, context) == {"job_name": None, "stopped": False, "status": "NotStarted"}


MUTATIONS = st.sampled_from([
    ("variant", "jax"), ("workload", "nlp"), ("distribution", "mpi"), ("instance_groups", []),
    ("max_runtime_s", 5), ("run_name", "bad name"), ("inputs", {}), ("hyperparameters", {"lerning_rate": 1}),
    ("instance_groups", [{"name": "g", "role": "dnn", "instance_type": "ml.trn1.2xlarge", "count": 1}]),
    ("hyperparameters", {"steps": -1}), ("spec_version", 9), ("extra", True),
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=3))
def test_fuzzed_invalid_specs_never_reach_create_training_job(aws, context, mutations) -> None:
    broken = spec() | dict(mutations)
    with pytest.raises(JobSpecError):
        launch({"spec": broken, "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []


GROUPS = st.lists(
    st.builds(lambda count, kind: {"role": "data", "instance_type": kind, "count": count},
              st.integers(1, 4), st.sampled_from(["ml.c5.xlarge", "ml.c5.4xlarge", "ml.c5.18xlarge"])),
    max_size=4,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data_groups=GROUPS,
    dnn=st.tuples(st.integers(1, 3), st.sampled_from(["ml.p3.2xlarge", "ml.p4d.24xlarge"])),
    steps=st.integers(2, 10_000),
    batch=st.integers(1, 512),
)
def test_valid_specs_make_requests_botocore_accepts(aws, context, data_groups, dnn, steps, batch) -> None:
    groups = [dict(group, name=f"data_{index}") for index, group in enumerate(data_groups)]
    groups.append({"name": "dnn_group", "role": "dnn", "instance_type": dnn[1], "count": dnn[0]})
    channel = {"s3_uri": "s3://datasets-bucket/images/"} | ({"groups": [g["name"] for g in groups if g["role"] == "data"]} if data_groups else {})
    candidate = spec() | {
        "instance_groups": groups, "inputs": {"train": channel},
        "hyperparameters": {"steps": steps, "batch_size": batch, "warmup_steps": 1},
    }
    execution = f"{EXECUTION}-{len(aws.training_jobs())}"
    name = launch({"spec": candidate, "execution_arn": execution, "execution_start": STARTED}, context)["job_name"]
    described = aws.sagemaker.describe_training_job(TrainingJobName=name)
    counts = [g["InstanceCount"] for g in described["ResourceConfig"].get("InstanceGroups", [])] or [described["ResourceConfig"]["InstanceCount"]]
    assert sum(counts) == sum(g["count"] for g in groups)


def test_in_vpc_mode_every_job_gets_the_platforms_subnets_and_security_group(aws, context, monkeypatch) -> None:
    vpc = {"SecurityGroupIds": ["sg-0123456789abcdef0"], "Subnets": ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"]}
    monkeypatch.setenv("VPC_CONFIG", json.dumps(vpc))  # as the stack sets it in VPC mode
    launched = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.sagemaker.describe_training_job(TrainingJobName=launched["job_name"])["VpcConfig"] == vpc


def test_a_launch_whose_execution_ended_meanwhile_stops_the_job_it_created(aws, context) -> None:
    """Aborted while its launch ran, the execution's cleanup looked for a job not yet created: the launch
    itself stops the job instead of leaving it to bill until the reconciler's next round."""
    import boto3

    sfn = boto3.client("stepfunctions", region_name=REGION)
    machine = sfn.create_state_machine(name="hetero-training-run", roleArn=f"arn:aws:iam::{ACCOUNT}:role/sfn",
                                       definition=json.dumps({"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 600, "End": True}}}))
    execution = sfn.start_execution(stateMachineArn=machine["stateMachineArn"], name="run-aborted")["executionArn"]
    sfn.stop_execution(executionArn=execution)
    launched = launch({"spec": spec(), "execution_arn": execution, "execution_start": STARTED}, context)
    assert aws.sagemaker.describe_training_job(TrainingJobName=launched["job_name"])["TrainingJobStatus"] == "Stopping"
    running = sfn.start_execution(stateMachineArn=machine["stateMachineArn"], name="run-running")["executionArn"]
    kept = launch({"spec": spec() | {"run_name": "other"}, "execution_arn": running, "execution_start": STARTED}, context)
    assert aws.sagemaker.describe_training_job(TrainingJobName=kept["job_name"])["TrainingJobStatus"] != "Stopping"


def test_a_failed_job_is_relaunched_only_for_capacity_with_relaunches_and_start_window_left(aws, context) -> None:
    first = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    job = sagemaker_backends[ACCOUNT][REGION].training_jobs[first["job_name"]]
    job.training_job_status = "Failed"

    def decide(reason: str | None, **changes) -> dict:
        job.failure_reason = reason  # None: SageMaker gave none (its model does not promise one)
        return launch({"step": "decide_relaunch", "previous": first | changes}, context)

    capacity = "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."
    assert decide(capacity) == {"relaunch": True, "reason": capacity}
    assert decide("AlgorithmError: exit 1")["relaunch"] is False
    assert decide(None) == {"relaunch": False, "reason": ""}
    assert decide(capacity, relaunches_left=0)["relaunch"] is False
    assert decide(capacity, polls={"left": 75, "start_left": 0})["relaunch"] is False  # it would be stopped unstarted


def test_a_job_of_the_launchs_name_from_another_execution_is_never_adopted(aws, context) -> None:
    """Adopting a job by its name alone let two executions share one job (one polled, stopped and
    collected the other's): only a job tagged with the launch's own execution is its retry's."""
    event = {"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}
    name = job_name_for_execution("hetero", "vision-hetero", EXECUTION, STARTED)
    other = "arn:aws:states:us-east-1:123456789012:execution:training-run:someone-else"
    aws.sagemaker.create_training_job(
        TrainingJobName=name, AlgorithmSpecification={"TrainingImage": "x", "TrainingInputMode": "File"},
        RoleArn=f"arn:aws:iam::{ACCOUNT}:role/x", OutputDataConfig={"S3OutputPath": f"s3://{RESULTS_BUCKET}/artifacts/"},
        ResourceConfig={"InstanceType": "ml.m5.large", "InstanceCount": 1, "VolumeSizeInGB": 1},
        StoppingCondition={"MaxRuntimeInSeconds": 60}, Tags=[{"Key": "execution_arn", "Value": other}],
    )
    aws.training_job(name).training_job_status = "Failed"
    with pytest.raises(JobNameTaken, match=f"training job {name} exists and is not this execution's"):
        launch(event, context)
    assert aws.training_jobs() == [name] and aws.training_job(name).training_job_status == "Failed"


def test_a_run_whose_own_checkpoint_prefix_is_not_empty_is_refused_before_launch(aws, context) -> None:
    """Checkpoints seeded under checkpoints/<run id>/ (by a direct launcher, or an earlier execution of the
    name) would be resumed as if this run had trained them."""
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key="checkpoints/run-0001/step-100.pt", Body=b"forged")
    with pytest.raises(CheckpointsExist, match="checkpoints/run-0001/ holds checkpoints this run did not write"):
        launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []
    assert aws.s3.list_objects_v2(Bucket=RESULTS_BUCKET, Prefix="control/").get("KeyCount", 0) == 0  # no token either


def test_a_retried_launch_adopts_its_own_job_even_after_it_checkpointed(aws, context) -> None:
    event = {"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}
    first = launch(event, context)
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key="checkpoints/run-0001/step-10.pt", Body=b"the job's own")
    assert launch(event, context) == first and aws.training_jobs() == [first["job_name"]]


@pytest.mark.parametrize("run_name", ["team-a--vision--hetero--c5-9xl--p3-2xl--2026-12-01--run-1", "a" + "-" * 40 + "b"])
def test_a_run_name_past_forty_characters_is_refused_however_many_hyphens(aws, context, run_name) -> None:
    with pytest.raises(JobSpecError, match="run_name"):
        launch({"spec": spec() | {"run_name": run_name}, "execution_arn": EXECUTION, "execution_start": STARTED}, context)
    assert aws.training_jobs() == []


@pytest.mark.parametrize("bad_input", [
    json.dumps(spec() | {"run_name": "bad name!"}),
    '{"run_name": ' + "9" * 4300 + "}",  # past Python's 4,300-digit int limit: ValueError, not JSONDecodeError
    json.dumps(spec() | {"run_name": 12345}),
    json.dumps([1, 2]),
])
def test_stop_of_an_execution_refused_for_its_spec_looks_for_nothing_and_does_not_fail(aws, context, bad_input) -> None:
    """The abort rule also fires for executions that failed InvalidJobSpec: a stop that threw there would,
    after Lambda's retries, raise the 'a job may be billing' alarm for a run that launched nothing."""
    event = {"detail": {"executionArn": EXECUTION, "status": "FAILED", "input": bad_input, "startDate": 1796040000000}}
    assert stop(event, context) == {"job_name": None, "stopped": False, "status": "NotStarted"}


def test_a_launch_creates_its_job_on_a_session_tagged_with_its_own_prefixes(aws, context, monkeypatch) -> None:
    """The job's session of the execution role inherits the launch's session tags (SessionChainingConfig),
    and the role's S3 statements name the job's prefixes by them (tests/infra: the role's side). Captured
    as botocore sends them."""
    sent: dict[str, dict] = {}
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # the test's own, gone after it
    boto3.setup_default_session()  # every client of this launch is made from it and copies its handlers
    for operation in ("sts.AssumeRole", "sagemaker.CreateTrainingJob"):
        boto3.DEFAULT_SESSION.events.register(f"provide-client-params.{operation}",
                                              lambda params, model, **_: sent.__setitem__(model.name, dict(params)))
    resumed = spec() | {"resume_from": "run-0000"}
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key="checkpoints/run-0000/checkpoint.pt", Body=b"the earlier run's")
    name = launch({"spec": resumed, "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    assume = sent["AssumeRole"]
    assert assume["RoleArn"].endswith(":role/training-job-launcher") and assume["RoleSessionName"] == name
    assert {tag["Key"]: tag["Value"] for tag in assume["Tags"]} == {
        "run_key": "run-0001", "control_key": name, "job_key": name, "resume_key": "run-0000"}
    create = sent["CreateTrainingJob"]
    assert create["SessionChainingConfig"] == {"EnableSessionTagChaining": True} and create["TrainingJobName"] == name
    assert create["CheckpointConfig"]["S3Uri"].endswith("/checkpoints/run-0001/")  # the prefix run_key names


def test_a_collect_whose_write_meets_a_concurrent_one_is_retried_not_written_off(aws, context, monkeypatch) -> None:
    """S3's 409 ConditionalRequestConflict is a write in progress, not a result that exists: WriteConflict,
    which the state machine retries (ResultExistsError it does not), and the retry writes the result."""
    from moto.s3.exceptions import S3ClientError
    from moto.s3.models import S3Backend

    from lambdas.core.results import WriteConflict

    class Conflict(S3ClientError):
        code = 409

    original, conflicts = S3Backend.put_object, []

    def put_object(self, bucket_name, key_name, *args, **kwargs):
        if key_name.startswith("results/") and not conflicts:
            conflicts.append(key_name)
            raise Conflict("ConditionalRequestConflict", "A conflicting conditional operation is currently in progress")
        return original(self, bucket_name, key_name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", put_object)
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    aws.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"artifacts/{name}/output/output.tar.gz",
                      Body=output_archive({"timed_steps": 10, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
    with pytest.raises(WriteConflict, match="409"):
        collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": name}, context)
    assert "WriteConflict" not in COLLECT_FINAL_ERRORS
    assert collect({"spec": spec(), "execution_arn": EXECUTION, "job_name": name}, context)["status"] == "Completed"


def test_an_aborted_runs_job_is_stopped_though_todays_validator_refuses_its_spec(aws, context) -> None:
    """Launched under an earlier deployment, its spec now refused (a range tightened): only the run name
    makes the job's name, so only it is checked, and the job is stopped."""
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    aws.training_job(name).training_job_status = "InProgress"
    refused_today = spec() | {"hyperparameters": {"steps": -1}}
    event = {"detail": {"executionArn": EXECUTION, "status": "ABORTED", "input": json.dumps(refused_today), "startDate": 1796040000000}}
    assert stop(event, context) == {"job_name": name, "stopped": True, "status": "Stopping"}


def test_an_abort_never_stops_a_job_of_its_name_that_another_execution_launched(aws, context) -> None:
    name = launch({"spec": spec(), "execution_arn": EXECUTION, "execution_start": STARTED}, context)["job_name"]
    job = aws.training_job(name)
    job.training_job_status = "InProgress"
    aws.sagemaker.add_tags(ResourceArn=job.arn, Tags=[{"Key": "execution_arn", "Value": EXECUTION + "-someone-else"}])
    event = {"detail": {"executionArn": EXECUTION, "status": "ABORTED", "input": json.dumps(spec()), "startDate": 1796040000000}}
    assert stop(event, context)["stopped"] is False and job.training_job_status == "InProgress"
