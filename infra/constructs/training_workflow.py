"""The "training run" state machine: validate → launch → poll → collect, with retries on what is
transient, cleanup on what fails, and a failure recorded in results/ either way.

    Validate spec ──JobSpecError──▶ Fail "InvalidJobSpec"        (nothing launched)
    Launch job (retries LaunchThrottled, CapacityUnavailable with backoff)
        └─any error──▶ Record launch failure ▶ Fail "LaunchFailed"
    Wait (the launch's interval) ▶ Describe job (retried; still failing: "Poll failed", status Unknown)
        ▶ Completed? ─yes─▶ Collect results ▶ figures usable? ▶ Succeed (else Fail "RunFailed": no step timed...)
          Failed? ─▶ Decide relaunch: a CapacityError, relaunches and start window left? ─yes─▶ Back off (the launch's,
                     doubling) ▶ Relaunch job (the next attempt's job, poll budgets carried over) ▶ Wait
                     otherwise (and Stopped) ─▶ Collect failed run ▶ Fail "TrainingJobFailed"
          not training yet? ─▶ start polls left? ─yes─▶ Count down the start ▶ Wait
                                                  no ──▶ Start timed out ▶ Stop job ▶ ...
          no polls left ─▶ Run timed out ▶ Stop job ▶ await a terminal status (≤ 12 polls) ▶ Record failure
                           ▶ Fail "RunFailed"
          otherwise ▶ Count down ▶ Wait
        collect retries anything transient (COLLECT_RETRY); what still fails, and any error relaunching ▶ Stop job (retried; still failing: recorded) ▶ Record
        failure ▶ Fail
    A failing poll never stops a job: only the run's deadlines do, the runtime's counted from the job's
    training start (polls while it starts count against the start window instead).

An aborted or timed-out execution runs none of this; the AbortCleanup construct stops its job.
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from infra.constructs.functions import TrainingRunFunctions, retention, training_jobs_resource
from infra.nag import acknowledge, arn_token, training_jobs_arn, wildcard_resources
from lambdas.core.deadlines import (
    COLLECT_FINAL_ERRORS,
    COLLECT_RETRY,
    DECIDE_RELAUNCH_RETRY,
    POLL_RETRY,
    STOP_POLL_RETRY,
    STOP_POLLS,
    STOP_RETRY,
    RetrySchedule,
)
from lambdas.core.deadlines import LAUNCH_RETRIES as LAUNCH_RETRY_SCHEDULE

SPEC = sfn.JsonPath.object_at("$$.Execution.Input")
EXECUTION_ARN = sfn.JsonPath.execution_id
EXECUTION_START = sfn.JsonPath.execution_start_time
# SageMaker's secondary statuses before a job trains (SecondaryStatus, botocore's model): polls in these
# count against the start window, not the run's deadline.
STARTING = ("Pending", "Starting", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading", "DownloadingTrainingImage")


def retrier(schedule: RetrySchedule) -> dict:
    """A Retry of the definition from its schedule in lambdas/core/deadlines.py (which the run's timeout
    adds up), with full jitter."""
    return {"errors": list(schedule.errors), "interval": Duration.seconds(schedule.interval_s), "backoff_rate": 2,
            "max_attempts": schedule.attempts, "jitter_strategy": sfn.JitterType.FULL,
            **({"max_delay": Duration.seconds(schedule.max_delay_s)} if schedule.max_delay_s else {})}


def retry_unless_final(task: sfn.TaskStateBase) -> None:
    """COLLECT_RETRY on anything but COLLECT_FINAL_ERRORS: those first, matched and not retried (MaxAttempts
    0), then States.ALL alone and last, as Step Functions requires."""
    task.add_retry(errors=list(COLLECT_FINAL_ERRORS), max_attempts=0)
    task.add_retry(**retrier(COLLECT_RETRY))


# What a launch (and a relaunch) retries: throttling, and capacity or quota errors CreateTrainingJob itself
# returns.
LAUNCH_RETRIES = tuple(retrier(schedule) for schedule in LAUNCH_RETRY_SCHEDULE)
DECIDE_RETRY = retrier(DECIDE_RELAUNCH_RETRY)


class TrainingWorkflow(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        prefix: str,
        functions: TrainingRunFunctions,
        poll_interval_s: int,
        start_timeout_s: int,
        timeout_s: int,
        log_retention_days: int,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        jobs_arn = training_jobs_resource(stack, prefix)

        def invoke(name: str, function, payload: dict, result_path: str | None) -> tasks.LambdaInvoke:
            return tasks.LambdaInvoke(
                self, name, lambda_function=function, payload=sfn.TaskInput.from_object(payload),
                payload_response_only=True, result_path=result_path or sfn.JsonPath.DISCARD,
            )

        validate = tasks.LambdaInvoke(
            self, "Validate spec", lambda_function=functions.validate, payload_response_only=True, result_path="$.validation"
        )
        launch = invoke("Launch job", functions.launch, {"spec": SPEC, "execution_arn": EXECUTION_ARN, "execution_start": EXECUTION_START},
                        "$.launch")
        for launch_retry in LAUNCH_RETRIES:
            launch.add_retry(**launch_retry)
        # The launch chose the interval (at least poll_interval_s; longer for long runtimes, so that the
        # number of polls, and so the execution's history, stays bounded).
        wait = sfn.Wait(self, "Wait", time=sfn.WaitTime.seconds_path("$.launch.poll_interval_s"))
        def describe_job(name: str) -> tasks.CallAwsService:
            """DescribeTrainingJob of the run's job, its status into $.job.status."""
            return tasks.CallAwsService(
                self, name, service="sagemaker", action="describeTrainingJob",
                parameters={"TrainingJobName": sfn.JsonPath.string_at("$.launch.job_name")},
                iam_resources=[jobs_arn],
                result_selector={"status": sfn.JsonPath.string_at("$.TrainingJobStatus"),
                                 "secondary": sfn.JsonPath.string_at("$.SecondaryStatus")},
                result_path="$.job",
            )

        describe = describe_job("Describe job")
        # A poll that fails is retried, then simply counted as a poll: it never stops a healthy job (the
        # run's deadline still bounds it). Few retries: each costs history events (see MAX_POLLS).
        describe.add_retry(**retrier(POLL_RETRY))
        job = {"spec": SPEC, "execution_arn": EXECUTION_ARN, "job_name": sfn.JsonPath.string_at("$.launch.job_name"),
               "attempts": sfn.JsonPath.list_at("$.launch.attempts")}
        collect = invoke("Collect results", functions.collect, job, "$.result")
        collect_failed = invoke("Collect failed run", functions.collect, job, "$.result")
        stop = invoke("Stop job", functions.stop, {"job_name": sfn.JsonPath.string_at("$.launch.job_name")}, None)
        # Briefly: a run that fails anyway ends FAILED; the abort rule's stop (two asynchronous retries, then
        # the on-failure queue and its alarm) and the reconciler, every 15 minutes, follow up.
        stop.add_retry(**retrier(STOP_RETRY))
        record_failure = invoke("Record failure", functions.collect, job | {"failure": sfn.JsonPath.object_at("$.error")}, None)
        record_launch_failure = invoke(
            "Record launch failure", functions.collect,
            {"spec": SPEC, "execution_arn": EXECUTION_ARN, "failure": sfn.JsonPath.object_at("$.error")}, None,
        )
        for record in (record_failure, record_launch_failure):  # a failure unrecorded is a run with no result at all
            retry_unless_final(record)
        invalid = sfn.Fail(self, "InvalidJobSpec", error="InvalidJobSpec", cause_path="$.error.Cause")
        validate.add_catch(invalid, errors=["JobSpecError"], result_path="$.error")
        launch.add_catch(record_launch_failure.next(sfn.Fail(self, "LaunchFailed", error="LaunchFailed", cause_path="$.error.Cause")),
                         result_path="$.error")
        record_failure.next(sfn.Fail(self, "RunFailed", error="RunFailed", cause_path="$.error.Cause"))
        # After a stop, wait (bounded: STOP_POLLS poll intervals) for SageMaker to end the job, so that the
        # result records a terminal status and its billable seconds, not "Stopping" and null.
        begin_stop_wait = sfn.Pass(self, "Await stop", parameters={"polls_left": STOP_POLLS}, result_path="$.stopping")
        stop_wait = sfn.Wait(self, "Wait for stop", time=sfn.WaitTime.duration(Duration.seconds(poll_interval_s)))
        describe_stopping = describe_job("Describe stopping job")
        describe_stopping.add_retry(**retrier(STOP_POLL_RETRY))
        describe_stopping.add_catch(record_failure, result_path="$.stop_error")
        stop_countdown = sfn.Pass(
            self, "Count down the stop",
            parameters={"polls_left": sfn.JsonPath.math_add(sfn.JsonPath.number_at("$.stopping.polls_left"), -1)},
            result_path="$.stopping",
        ).next(stop_wait)
        stopped_yet = (
            sfn.Choice(self, "Stopped yet?")
            .when(sfn.Condition.or_(*(sfn.Condition.string_equals("$.job.status", status) for status in ("Stopped", "Failed", "Completed"))),
                  record_failure)
            .when(sfn.Condition.number_less_than_equals("$.stopping.polls_left", 0), record_failure)
            .otherwise(stop_countdown)
        )
        # Look first (a job that had ended already needs no wait), then wait between looks.
        stop_wait.next(describe_stopping)
        cleanup = stop.next(begin_stop_wait).next(describe_stopping).next(stopped_yet)
        # A stop that keeps failing is recorded with the run's failure; the reconciler stops the job later.
        # The original error stays in $.error.
        stop.add_catch(record_failure, result_path="$.stop_error")
        for state in (collect, collect_failed):
            retry_unless_final(state)  # what may pass is retried before the Catch writes the run off
            state.add_catch(cleanup, result_path="$.error")

        count_down = sfn.Pass(
            self, "Count down",
            parameters={"left": sfn.JsonPath.math_add(sfn.JsonPath.number_at("$.launch.polls.left"), -1),
                        "start_left": sfn.JsonPath.number_at("$.launch.polls.start_left")},
            result_path="$.launch.polls",
        ).next(wait)
        count_down_start = sfn.Pass(
            self, "Count down the start",
            parameters={"left": sfn.JsonPath.number_at("$.launch.polls.left"),
                        "start_left": sfn.JsonPath.math_add(sfn.JsonPath.number_at("$.launch.polls.start_left"), -1)},
            result_path="$.launch.polls",
        ).next(wait)
        poll_failed = sfn.Pass(self, "Poll failed", parameters={"status": "Unknown", "secondary": "Unknown"}, result_path="$.job")
        describe.add_catch(poll_failed, result_path="$.poll_error")
        # The spec's runtime (plus grace) has passed and SageMaker has not stopped the job: stop it here.
        timed_out = sfn.Pass(self, "Run timed out", parameters={"Error": "RunTimedOut", "Cause": "the job ran past the spec's max_runtime_s"},
                             result_path="$.error").next(cleanup)
        start_timed_out = sfn.Pass(
            self, "Start timed out",
            parameters={"Error": "StartTimedOut", "Cause": f"the job did not start training within {start_timeout_s} s (the start window)"},
            result_path="$.error",
        ).next(cleanup)
        # Capacity: SageMaker fails a job it cannot find instances for; the launch function creates the
        # next attempt's job after a backoff, up to its relaunch limit. The reason is read only for a
        # Failed job (where SageMaker always gives one).
        # Decided by the launch function (it reads the failed job's FailureReason, which SageMaker's model
        # does not promise: a state reading a missing field would fail the execution, uncatchably).
        decide_relaunch = invoke("Decide relaunch", functions.launch,
                                 {"step": "decide_relaunch", "previous": sfn.JsonPath.object_at("$.launch")}, "$.failure")
        # It only reads: retried on any error (a throttled Describe must not forfeit a relaunch).
        decide_relaunch.add_retry(**DECIDE_RETRY)
        relaunch = invoke("Relaunch job", functions.launch,
                          {"spec": SPEC, "execution_arn": EXECUTION_ARN, "execution_start": EXECUTION_START,
                           "previous": sfn.JsonPath.object_at("$.launch"), "failure_reason": sfn.JsonPath.string_at("$.failure.reason")},
                          "$.launch")
        for launch_retry in LAUNCH_RETRIES:
            relaunch.add_retry(**launch_retry)
        # The previous attempt's job has failed; a job this attempt created before failing is the
        # reconciler's (its execution has ended).
        relaunch.add_catch(record_failure, result_path="$.error")
        back_off = sfn.Wait(self, "Back off", time=sfn.WaitTime.seconds_path("$.launch.backoff_s")).next(relaunch)
        relaunch.next(wait)
        failed_job = collect_failed.next(sfn.Fail(self, "TrainingJobFailed", error="TrainingJobFailed",
                                                  cause="The training job failed or was stopped; see results/<run id>/result.json"))
        decide_relaunch.add_catch(failed_job, result_path="$.failure_error")
        capacity = (
            sfn.Choice(self, "Capacity to retry?")
            .when(sfn.Condition.boolean_equals("$.failure.relaunch", True), back_off)
            .otherwise(failed_job)
        )
        decide_relaunch.next(capacity)
        # A job that completed but left no usable figures (no step timed, an unreadable summary) is a
        # failed run: result.json says why.
        usable = (
            sfn.Choice(self, "Figures usable?")
            .when(sfn.Condition.string_equals("$.result.status", "Completed"), sfn.Succeed(self, "Succeeded"))
            .otherwise(sfn.Fail(self, "NoUsableFigures", error="RunFailed",
                                cause="The job completed without usable figures; see results/<run id>/result.json"))
        )
        finished = (
            sfn.Choice(self, "Job finished?")
            .when(sfn.Condition.string_equals("$.job.status", "Completed"), collect.next(usable))
            .when(sfn.Condition.string_equals("$.job.status", "Failed"), decide_relaunch)
            .when(sfn.Condition.string_equals("$.job.status", "Stopped"), failed_job)
            # A poll that failed tells nothing of the job: it counts against the start window while any
            # is left, then against the run's deadline (a job still running past both is stopped).
            .when(sfn.Condition.and_(sfn.Condition.string_equals("$.job.status", "Unknown"),
                                     sfn.Condition.number_greater_than("$.launch.polls.start_left", 0)), count_down_start)
            .when(sfn.Condition.and_(sfn.Condition.or_(*(sfn.Condition.string_equals("$.job.secondary", status) for status in STARTING)),
                                     sfn.Condition.number_less_than_equals("$.launch.polls.start_left", 0)), start_timed_out)
            .when(sfn.Condition.or_(*(sfn.Condition.string_equals("$.job.secondary", status) for status in STARTING)), count_down_start)
            .when(sfn.Condition.number_less_than_equals("$.launch.polls.left", 0), timed_out)
            .otherwise(count_down)
        )
        poll_failed.next(finished)
        definition = validate.next(launch).next(wait).next(describe).next(finished)
        self.log_group = logs.LogGroup(self, "Logs", retention=retention(log_retention_days), removal_policy=RemovalPolicy.DESTROY)
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=f"{prefix}-training-run",
            definition_body=sfn.DefinitionBody.from_chainable(definition),
            timeout=Duration.seconds(timeout_s),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        acknowledge(
            self.state_machine.role,
            "Invoking each function includes its versions (<arn>:*); DescribeTrainingJob is held to the platform's "
            "job-name prefix; log delivery and X-Ray actions take no resource ARN.",
            *wildcard_resources(
                "*", training_jobs_arn(stack, prefix), *(f"{arn_token(fn)}:*" for fn in functions.training_run)
            ),
        )
