"""The harness for the synthesized state machines, executed by moto's Step Functions interpreter.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import botocore.retries.standard
import pytest
from moto import mock_aws
from moto.awslambda_simple.models import LambdaSimpleBackend
from moto.core.exceptions import JsonRESTError
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import StateTaskServiceSfn
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction

from app import build_app
from lambdas.clients import client
from lambdas.collect_results.handler import handler as collect
from lambdas.compare_sweep.handler import handler as compare_sweep
from lambdas.core.execution import job_name_for_execution
from lambdas.launch_job.handler import handler as launch
from lambdas.plan_sweep.handler import handler as plan_sweep
from lambdas.reconcile_jobs.handler import handler as reconcile
from lambdas.stop_job.handler import handler as stop
from lambdas.validate_spec.handler import handler as validate
from tests.infra.conftest import ACCOUNT, REGION, deployed_references, render, state_machine_definition, state_machine_logical_id
from tests.lambdas.conftest import (
    ENVIRONMENT,
    RESULTS_BUCKET,
    LambdaContext,
    _stop_training_job,
    output_archive,
    refuse_a_name_in_use,
)
from tests.workflows.permissions import Call, allowed, call_of, function_roles, role_statements

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The handler whose code is running in this thread (None: the harness itself, or a timer).
CALLER = threading.local()
HANDLERS: dict[str, Callable[[dict, Any], dict]] = {
    "ValidateSpec": validate, "LaunchJob": launch, "CollectResults": collect, "StopJob": stop, "ReconcileJobs": reconcile,
    "PlanSweep": plan_sweep, "CompareSweep": compare_sweep,
}
# The example with SageMaker's shortest runtime: with the harness's grace and start window the run polls
# every second (poll_plan spreads a longer window over longer intervals).
SPEC = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text()) | {"max_runtime_s": 60}


@dataclass
class Scenario:
    """How the fake SageMaker behaves for a launched job."""

    final_status: str = "Completed"
    runs_for_s: float = 1.5
    failure_reason: str | None = None
    throttle_first_launches: int = 0
    summary: dict | None = None
    # Jobs of these run names end Failed whatever final_status says (one bad configuration in a sweep).
    failing_runs: frozenset[str] = frozenset()
    # Run name → the summary.json its job leaves (a sweep's configurations); others leave ``summary``.
    summaries: dict[str, dict] = field(default_factory=dict)
    # The raw output.tar.gz the job leaves (instead of one made from ``summary``): a corrupt one, say.
    archive: bytes | None = None
    # DescribeTrainingJob answers ThrottlingException this many times before it answers again.
    throttle_describes: int = 0
    # ... this many times once it has reported the job Completed (the collect's Describe).
    throttle_describes_when_done: int = 0
    # The stop function fails (as a Lambda whose code raises) every time it is invoked.
    stop_fails: bool = False
    # Seconds a job spends starting (SecondaryStatus Starting) before it trains; None: it never starts.
    starts_for_s: float | None = 0.3
    # The first N jobs launched fail while starting, as SageMaker reports a capacity shortage.
    capacity_failures: int = 0
    # The job ends only once the test's own thread (a CLI following it, say) has described it InProgress:
    # on the emulated clock a short job could otherwise end before the follower's first poll.
    ends_once_followed: bool = False


# The emulated world's clock runs this much faster than the wall's: every Wait state, state Retry interval,
# botocore backoff and fake-SageMaker timer (a job's start and run, a stop taking effect) is scaled alike,
# so the state machine takes the same path with the same counts of polls and retries, in a fifth of the
# time. Nothing of ours reads the wall clock to decide (deadlines and start windows are counted in polls).
TIME_SCALE = 0.2


def emulated(seconds: float) -> float:
    """Wall seconds for ``seconds`` of the emulated world's time."""
    return seconds * TIME_SCALE


def _wait_interval(self: WaitFunction, env: Any, wait_seconds: int) -> None:
    """moto's Wait state, on the emulated clock (a stopped execution still interrupts it at once)."""
    if wait_seconds > 0:
        env.program_state_event.wait(emulated(wait_seconds))


class _EmulatedSleep:
    """The ``time`` module as moto's Retrier sees it: its interval sleeps on the emulated clock."""

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(emulated(seconds))


def on_the_emulated_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WaitFunction, "_wait_interval", _wait_interval)
    monkeypatch.setattr(retrier_decl, "time", _EmulatedSleep)
    backoff = botocore.retries.standard.ExponentialBackoff.delay_amount
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount",
                        lambda self, context: emulated(backoff(self, context)))


CAPACITY_ERROR = "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."


@pytest.fixture(scope="package")
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
        self.cloudwatch = boto3.client("cloudwatch", region_name=REGION)
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
        references = deployed_references(template_json, names) | {state_machine_logical_id(template_json): self.state_machine_arn}
        self.sweep_definition = state_machine_definition(template_json, references, construct="BenchmarkSweep")
        self.sweep_arn = self.sfn.create_state_machine(
            name="hetero-benchmark-sweep", definition=json.dumps(self.sweep_definition), roleArn=role
        )["stateMachineArn"]

    def start(self, spec: dict, name: str) -> str:
        return self.sfn.start_execution(stateMachineArn=self.state_machine_arn, name=name, input=json.dumps(spec))["executionArn"]

    def start_sweep(self, sweep_input: dict, name: str, summaries: dict[str, dict] | None = None) -> str:
        """Start a sweep; ``summaries`` (run name → summary.json) are what each configuration's job leaves
        in its output when it ends (the scenario's summary for the others)."""
        self.scenario.summaries = summaries or {}
        return self.sfn.start_execution(stateMachineArn=self.sweep_arn, name=name, input=json.dumps(sweep_input))["executionArn"]

    def job_of(self, execution_arn: str, run_name: str, attempt: int = 0) -> str:
        """The job an execution launched, derived as the platform derives it (ARN, start time, attempt)."""
        started = self.sfn.describe_execution(executionArn=execution_arn)["startDate"]
        return job_name_for_execution("hetero", run_name, execution_arn, started, attempt)

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
        (rule,) = [r for k, r in template_json["Resources"].items() if r["Type"] == "AWS::Events::Rule" and k.startswith("AbortCleanupRule")]
        machine = state_machine_logical_id(template_json)
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


_moto_normalise_sfn_parameters = StateTaskServiceSfn._normalise_parameters


def _start_execution_parameters_as_boto_names(self, parameters: dict, boto_service_name=None, service_action_name=None) -> None:
    """moto 5.2.5's interpreter passes a states:startExecution task's parameters to boto3 with the ASL
    names (Input, Name, StateMachineArn) where boto3 expects input, name, stateMachineArn, so every nested
    execution fails with KeyError 'Input'. Step Functions itself maps them; this does the same for the fake."""
    _moto_normalise_sfn_parameters(self, parameters, boto_service_name, service_action_name)
    if service_action_name is None and self._get_boto_service_action() == "start_execution":
        for key in [key for key in parameters if key[:1].isupper()]:
            parameters[key[0].lower() + key[1:]] = parameters.pop(key)


def _sfn_response_as_step_functions_names(self, response, boto_service_name=None, service_action_name=None) -> None:
    """The other half of the same gap: Step Functions hands a startExecution task boto3's response with
    capitalised names (ExecutionArn, Status, Output); moto 5.2.5 leaves them as boto3 spells them, and its
    own .sync:2 waiter then fails on KeyError 'ExecutionArn'."""
    if isinstance(response, dict):
        for key in [key for key in response if key[:1].islower()]:
            response[key[0].upper() + key[1:]] = response.pop(key)


@pytest.fixture
def run(platform, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Scenario], Harness]]:
    for key, value in ENVIRONMENT.items():
        monkeypatch.setenv(key, value)
    # The launch function's own settings, as synthesized (the others are deploy-time references).
    (launch_function,) = [r for r in platform["Resources"].values()
                          if r["Type"] == "AWS::Lambda::Function" and r["Properties"]["Handler"].startswith("lambdas.launch_job.")]
    for key in ("POLL_INTERVAL_S", "DEADLINE_GRACE_S", "START_TIMEOUT_S", "RELAUNCH_BACKOFF_S", "CAPACITY_RELAUNCHES"):
        monkeypatch.setenv(key, launch_function["Properties"]["Environment"]["Variables"][key])
    # A one-minute start window (the stack's is 2 h) and five minutes' grace (the stack's 15): the polls'
    # interval stays the configured second.
    monkeypatch.setenv("START_TIMEOUT_S", "60")
    monkeypatch.setenv("DEADLINE_GRACE_S", "300")
    on_the_emulated_clock(monkeypatch)
    def stop_training_job(self: SageMakerResponse):  # Stopping, then Stopped a moment later, as SageMaker does
        reply = _stop_training_job(self)
        job = self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")]

        def stopped() -> None:
            job.training_job_status, job.secondary_status, job.billable_time_in_seconds = "Stopped", "Stopped", 120

        timer = threading.Timer(emulated(1.0), stopped)
        timers.append(timer)
        timer.start()
        return reply

    monkeypatch.setattr(SageMakerResponse, "stop_training_job", stop_training_job, raising=False)
    monkeypatch.setattr(StateTaskServiceSfn, "_normalise_parameters", _start_execution_parameters_as_boto_names)
    monkeypatch.setattr(StateTaskServiceSfn, "_normalise_response", _sfn_response_as_step_functions_names)
    timers: list[threading.Timer] = []
    state: dict[str, Any] = {}

    def invoke(self, function_name, qualifier, body, headers, response_headers):  # the Lambda runtime's contract
        name = function_name.rsplit(":", 1)[-1]
        try:
            if name == "StopJob" and state["scenario"].stop_fails:
                state["stop_attempts"] = state.get("stop_attempts", 0) + 1
                raise ConnectionError("SageMaker unreachable from the stop function")
            CALLER.name = name  # the calls the handler makes, checked against its role (tests/workflows/permissions.py)
            result = HANDLERS[name](json.loads(body), LambdaContext(function_name=name))
        except Exception as error:  # noqa: BLE001 - the runtime reports any error by its type
            response_headers["x-amz-function-error"] = "Unhandled"
            return json.dumps({"errorType": type(error).__name__, "errorMessage": str(error)}).encode()
        finally:
            CALLER.name = None
        if name == "LaunchJob" and "job_name" in result:  # a launch, not a relaunch decision
            script_job(result["job_name"])
        return json.dumps(result).encode()

    def script_job(job_name: str) -> None:
        scenario: Scenario = state["scenario"]
        job = sagemaker_backends[ACCOUNT][REGION].training_jobs[job_name]
        if job_name in state.setdefault("scripted", set()):
            return  # an adopted job (a retried launch found it): it keeps whatever state it is in, as on SageMaker
        state["scripted"].add(job_name)
        job.training_job_status, job.secondary_status = "InProgress", "Starting"
        state["launched"] = state.get("launched", 0) + 1
        if state["launched"] <= scenario.capacity_failures:
            def no_capacity() -> None:
                job.training_job_status, job.secondary_status, job.failure_reason = "Failed", "Failed", CAPACITY_ERROR
                job.billable_time_in_seconds = 0

            timer = threading.Timer(emulated(scenario.starts_for_s or 0.3), no_capacity)
            timers.append(timer)
            timer.start()
            return
        if scenario.starts_for_s is None:
            return  # stuck starting (the start window ends it)

        def training() -> None:
            if job.training_job_status == "InProgress":
                job.secondary_status = "Training"

        started = threading.Timer(emulated(scenario.starts_for_s), training)
        timers.append(started)
        started.start()

        fails = any(f"-{run}-" in job_name for run in scenario.failing_runs)
        summary = next((value for run, value in scenario.summaries.items() if f"-{run}-" in job_name), scenario.summary)

        def finish() -> None:
            if scenario.ends_once_followed and not state["followed"].is_set():
                again = threading.Timer(emulated(0.2), finish)  # not seen running yet: it runs a while longer
                timers.append(again)
                again.start()
                return
            body = scenario.archive if scenario.archive is not None else output_archive(summary) if summary is not None else None
            if body is not None:  # what the job's hosts leave in its output, as SageMaker uploads it
                boto3.client("s3", region_name=REGION).put_object(
                    Bucket=RESULTS_BUCKET, Key=f"artifacts/{job_name}/output/output.tar.gz", Body=body
                )
            if job.training_job_status == "InProgress":
                job.training_job_status = "Failed" if fails else scenario.final_status
                job.secondary_status = job.training_job_status
                job.failure_reason = "AlgorithmError: the trainer exited with 137" if fails else scenario.failure_reason
                job.billable_time_in_seconds = 600

        timer = threading.Timer(emulated(scenario.starts_for_s + scenario.runs_for_s), finish)
        timers.append(timer)
        timer.start()

    def create_training_job(self, *args, **kwargs):
        if state["throttles_left"] > 0:
            state["throttles_left"] -= 1
            raise JsonRESTError("ThrottlingException", "Rate exceeded")
        return refuse_a_name_in_use(self, *args, **kwargs)

    original_describe = SageMakerModelBackend.describe_training_job

    def describe_training_job(self, *args, **kwargs):
        if state["describe_throttles_left"] > 0:
            state["describe_throttles_left"] -= 1
            state["describes_throttled"] = state.get("describes_throttled", 0) + 1
            raise JsonRESTError("ThrottlingException", "Rate exceeded")
        if state.get("seen_done") and state["done_throttles_left"] > 0:
            state["done_throttles_left"] -= 1
            state["describes_throttled"] = state.get("describes_throttled", 0) + 1
            raise JsonRESTError("ThrottlingException", "Rate exceeded")
        job = original_describe(self, *args, **kwargs)
        if (threading.current_thread() is threading.main_thread() and not getattr(CALLER, "name", None)
                and job.get("TrainingJobStatus") == "InProgress"):
            state["followed"].set()  # the test's thread, not a handler of the state machine, saw it running
        state["seen_done"] = state.get("seen_done") or job.get("TrainingJobStatus") == "Completed"
        return job

    monkeypatch.setattr(SageMakerModelBackend, "describe_training_job", describe_training_job)
    monkeypatch.setattr(LambdaSimpleBackend, "invoke", invoke)
    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", create_training_job)
    client.cache_clear()
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}):

        calls: list[Call] = []

        def record(params: dict, model: Any, **_: Any) -> None:
            if getattr(CALLER, "name", None):
                calls.append(call_of(CALLER.name, model.service_model.signing_name, model.name, params))

        # Every client made from here (the handlers', the job creator's) copies the default session's handlers.
        monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
        boto3.setup_default_session()
        boto3.DEFAULT_SESSION.events.register("provide-client-params", record)

        def make(scenario: Scenario) -> Harness:
            state["scenario"], state["throttles_left"] = scenario, scenario.throttle_first_launches
            state["describe_throttles_left"] = scenario.throttle_describes
            state["done_throttles_left"] = scenario.throttle_describes_when_done
            state["followed"] = threading.Event()
            harness = Harness(platform, scenario)
            harness.faults = state
            return harness

        yield make
    for timer in timers:
        timer.cancel()
    client.cache_clear()
    roles = {next(key for key in HANDLERS if logical_id.startswith(f"TrainingRunFunctions{key}")): names
             for logical_id, names in function_roles(platform).items()}
    denied = sorted({call for call in calls
                     if not allowed(call, [s for role in roles[call.function] for s in role_statements(platform, role)], RESULTS_BUCKET)},
                    key=str)
    assert not denied, f"calls the synthesized roles would refuse on AWS: {denied}"


