"""The synthesized "training run" state machine, executed by moto's Step Functions interpreter.

Its Lambda tasks run our real handlers (standing in for the Lambda runtime: the event in, the result or
the error type out, as AWS's Python runtime reports them); SageMaker is moto's, scripted through its
backend objects (a job runs for a moment, then completes or fails) or made to throttle once.
"""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.awslambda_simple.models import LambdaSimpleBackend
from moto.core.exceptions import JsonRESTError
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from app import build_app
from lambdas.clients import client
from lambdas.collect_results.handler import handler as collect
from lambdas.core.execution import job_name_for_execution
from lambdas.launch_job.handler import handler as launch
from lambdas.stop_job.handler import handler as stop
from lambdas.validate_spec.handler import handler as validate
from tests.infra.conftest import ACCOUNT, REGION, deployed_references, render, state_machine_definition
from tests.lambdas.conftest import ENVIRONMENT, RESULTS_BUCKET, LambdaContext, _stop_training_job, output_archive

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HANDLERS: dict[str, Callable[[dict, Any], dict]] = {
    "ValidateSpec": validate, "LaunchJob": launch, "CollectResults": collect, "StopJob": stop,
}
SPEC = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())


@dataclass
class Scenario:
    """How the fake SageMaker behaves for a launched job."""

    final_status: str = "Completed"
    runs_for_s: float = 1.5
    failure_reason: str | None = None
    throttle_first_launches: int = 0
    summary: dict | None = None


@pytest.fixture(scope="module")
def platform() -> dict[str, Any]:
    """The platform synthesized with a 1-second poll interval (a real setting), its template as JSON."""
    from aws_cdk.assertions import Template

    app, stack = build_app(context={"platform": {"poll_interval_s": 1}})
    app.synth()
    return Template.from_stack(stack).to_json()


class Harness:
    def __init__(self, template_json: dict[str, Any], scenario: Scenario) -> None:
        self.scenario = scenario
        self.sfn = boto3.client("stepfunctions", region_name=REGION)
        self.sagemaker = boto3.client("sagemaker", region_name=REGION)
        self.s3 = boto3.client("s3", region_name=REGION)
        self.events = boto3.client("events", region_name=REGION)
        self.template_json = template_json
        self.s3.create_bucket(Bucket=RESULTS_BUCKET)
        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(RoleName="workflow", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        names = {}
        for logical_id, resource in template_json["Resources"].items():
            if resource["Type"] == "AWS::Lambda::Function":
                name = next(key for key in HANDLERS if logical_id.startswith(f"TrainingRunFunctions{key}"))
                names[logical_id] = name
                boto3.client("lambda", region_name=REGION).create_function(
                    FunctionName=name, Runtime="python3.13", Role=role, Handler=resource["Properties"]["Handler"],
                    Code={"ZipFile": _zip()},
                )
        self.definition = state_machine_definition(template_json, deployed_references(template_json, names))
        self.state_machine_arn = self.sfn.create_state_machine(
            name="hetero-training-run", definition=json.dumps(self.definition), roleArn=role
        )["stateMachineArn"]

    def start(self, spec: dict, name: str) -> str:
        execution_arn = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:hetero-training-run:{name}"
        if self.scenario.summary:
            job = job_name_for_execution("hetero", spec["run_name"], execution_arn)
            self.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"artifacts/{job}/output/output.tar.gz", Body=output_archive(self.scenario.summary))
        return self.sfn.start_execution(stateMachineArn=self.state_machine_arn, name=name, input=json.dumps(spec))["executionArn"]

    def wait(self, execution_arn: str, timeout_s: float = 60) -> dict[str, Any]:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            described = self.sfn.describe_execution(executionArn=execution_arn)
            if described["status"] != "RUNNING":
                return described
            time.sleep(0.2)
        raise AssertionError(f"execution still running after {timeout_s} s")

    def route_status_change(self, template_json: dict[str, Any], detail: dict[str, Any]) -> dict[str, Any] | None:
        """Send a Step Functions status-change event through EventBridge with the synthesized rule's
        pattern; return the event its target receives, or None when the rule does not match. (moto's
        EventBridge delivers to SQS but not to Lambda targets, so a queue stands in for the stop function.)"""
        (rule,) = [r for r in template_json["Resources"].values() if r["Type"] == "AWS::Events::Rule"]
        (machine,) = [k for k, r in template_json["Resources"].items() if r["Type"] == "AWS::StepFunctions::StateMachine"]
        pattern = render(rule["Properties"]["EventPattern"], {machine: self.state_machine_arn})
        sqs = boto3.client("sqs", region_name=REGION)
        queue_url = sqs.create_queue(QueueName="abort-cleanup-target")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self.events.put_rule(Name="abort-cleanup", EventPattern=json.dumps(pattern))
        self.events.put_targets(Rule="abort-cleanup", Targets=[{"Id": "stop", "Arn": queue_arn}])
        self.events.put_events(Entries=[{"Source": "aws.states", "DetailType": "Step Functions Execution Status Change",
                                         "Detail": json.dumps(detail)}])
        messages = sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=0).get("Messages", [])
        for message in messages:
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        return json.loads(messages[0]["Body"]) if messages else None

    def result(self, run_id: str) -> dict[str, Any]:
        return json.loads(self.s3.get_object(Bucket=RESULTS_BUCKET, Key=f"results/{run_id}/result.json")["Body"].read())

    def training_jobs(self) -> list[str]:
        return [job["TrainingJobName"] for job in self.sagemaker.list_training_jobs()["TrainingJobSummaries"]]

    def job(self, name: str) -> Any:
        return sagemaker_backends[ACCOUNT][REGION].training_jobs[name]


def _zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("placeholder.py", "")  # moto stores the package; our handlers run in-process
    return buffer.getvalue()


@pytest.fixture
def run(platform, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Scenario], Harness]]:
    for key, value in ENVIRONMENT.items():
        monkeypatch.setenv(key, value)
    # The launch function's own settings, as synthesized (the others are deploy-time references).
    (launch_function,) = [r for r in platform["Resources"].values()
                          if r["Type"] == "AWS::Lambda::Function" and r["Properties"]["Handler"].startswith("lambdas.launch_job.")]
    for key in ("POLL_INTERVAL_S", "DEADLINE_GRACE_S"):
        monkeypatch.setenv(key, launch_function["Properties"]["Environment"]["Variables"][key])
    monkeypatch.setattr(SageMakerResponse, "stop_training_job", _stop_training_job, raising=False)
    timers: list[threading.Timer] = []
    state: dict[str, Any] = {}

    def invoke(self, function_name, qualifier, body, headers, response_headers):  # the Lambda runtime's contract
        name = function_name.rsplit(":", 1)[-1]
        try:
            result = HANDLERS[name](json.loads(body), LambdaContext(function_name=name))
        except Exception as error:  # noqa: BLE001 - the runtime reports any error by its type
            response_headers["x-amz-function-error"] = "Unhandled"
            return json.dumps({"errorType": type(error).__name__, "errorMessage": str(error)}).encode()
        if name == "LaunchJob":
            script_job(result["job_name"])
        return json.dumps(result).encode()

    def script_job(job_name: str) -> None:
        scenario: Scenario = state["scenario"]
        job = sagemaker_backends[ACCOUNT][REGION].training_jobs[job_name]
        job.training_job_status = "InProgress"

        def finish() -> None:
            if job.training_job_status == "InProgress":
                job.training_job_status = scenario.final_status
                job.failure_reason = scenario.failure_reason
                job.billable_time_in_seconds = 600

        timer = threading.Timer(scenario.runs_for_s, finish)
        timers.append(timer)
        timer.start()

    original_create = SageMakerModelBackend.create_training_job

    def create_training_job(self, *args, **kwargs):
        if state["throttles_left"] > 0:
            state["throttles_left"] -= 1
            raise JsonRESTError("ThrottlingException", "Rate exceeded")
        return original_create(self, *args, **kwargs)

    monkeypatch.setattr(LambdaSimpleBackend, "invoke", invoke)
    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", create_training_job)
    client.cache_clear()
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}):

        def make(scenario: Scenario) -> Harness:
            state["scenario"], state["throttles_left"] = scenario, scenario.throttle_first_launches
            return Harness(platform, scenario)

        yield make
    for timer in timers:
        timer.cancel()
    client.cache_clear()


def test_a_run_that_completes_writes_its_result(run) -> None:
    harness = run(Scenario(summary={"step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 186.0}, "samples_per_s": 347.8}))
    execution = harness.wait(harness.start(SPEC, "run-ok"))
    assert execution["status"] == "SUCCEEDED", execution
    output = json.loads(execution["output"])
    assert output["job"]["status"] == "Completed"
    result = harness.result("run-ok")
    assert result["status"] == "Completed" and result["step_time_ms"]["p50"] == 184.0
    assert result["cost_per_1k_steps_usd"] == pytest.approx(5.661 * 0.184 / 3.6, rel=1e-4)


def test_a_failed_job_fails_the_execution_and_records_why(run) -> None:
    harness = run(Scenario(final_status="Failed", failure_reason="AlgorithmError: trainer exited with 137"))
    execution = harness.wait(harness.start(SPEC, "run-failed"))
    assert execution["status"] == "FAILED" and execution["error"] == "TrainingJobFailed"
    result = harness.result("run-failed")
    assert result["status"] == "Failed" and result["failure_reason"] == "AlgorithmError: trainer exited with 137"


def test_a_throttled_launch_is_retried(run) -> None:
    # botocore retries a throttled call 4 times itself (lambdas/clients.py: 5 attempts); when all five are
    # refused, the state machine sees LaunchThrottled, and its Retry launches again.
    harness = run(Scenario(throttle_first_launches=5, summary={"step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
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


def test_a_job_running_past_the_specs_runtime_is_stopped_and_the_run_fails(run, monkeypatch) -> None:
    monkeypatch.setenv("DEADLINE_GRACE_S", "0")  # no grace: the state machine stops the job at the runtime
    harness = run(Scenario(runs_for_s=600))  # SageMaker never stops it on its own here
    spec = SPEC | {"max_runtime_s": 60}  # the shortest runtime a spec may ask for
    execution_arn = harness.start(spec, "run-overtime")
    execution = harness.wait(execution_arn, timeout_s=120)
    assert execution["status"] == "FAILED" and execution["error"] == "RunFailed"
    job_name = job_name_for_execution("hetero", SPEC["run_name"], execution_arn)
    assert harness.sagemaker.describe_training_job(TrainingJobName=job_name)["TrainingJobStatus"] == "Stopping"
    assert harness.result("run-overtime")["failure_reason"] == "RunTimedOut: the job ran past the spec's max_runtime_s"


@pytest.mark.parametrize("ending", ["ABORTED", "TIMED_OUT"])
def test_an_execution_ended_from_outside_has_its_job_stopped(run, platform, ending: str) -> None:
    harness = run(Scenario(runs_for_s=600))
    execution_arn = harness.start(SPEC, f"run-{ending.lower()}")
    job_name = job_name_for_execution("hetero", SPEC["run_name"], execution_arn)
    give_up = time.monotonic() + 30
    while job_name not in harness.training_jobs() or harness.job(job_name).training_job_status != "InProgress":
        assert time.monotonic() < give_up, "the job was never launched"
        time.sleep(0.2)
    harness.sfn.stop_execution(executionArn=execution_arn)  # moto reports ABORTED; a timeout ends the same way
    described = harness.wait(execution_arn, timeout_s=30)
    assert described["status"] == "ABORTED"
    detail = {"executionArn": execution_arn, "stateMachineArn": harness.state_machine_arn, "status": ending,
              "input": described["input"], "name": described["name"]}
    delivered = harness.route_status_change(platform, detail)
    assert harness.route_status_change(platform, detail | {"status": "SUCCEEDED"}) is None
    assert harness.route_status_change(platform, detail | {"stateMachineArn": harness.state_machine_arn + "-other"}) is None
    assert delivered is not None and delivered["detail"]["status"] == ending
    reply = stop(delivered, LambdaContext(function_name="StopJob"))  # the event as the rule delivers it
    assert reply == {"job_name": job_name, "stopped": True, "status": "Stopping"}
    assert harness.sagemaker.describe_training_job(TrainingJobName=job_name)["TrainingJobStatus"] == "Stopping"
