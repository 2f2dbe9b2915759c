"""Launch the training job for a validated spec: CreateTrainingJob with instance groups (the CDK's
SageMaker task cannot express them). The job name is derived from the execution, its start time and the
attempt, so a retried launch finds the job it already created instead of starting a second one, and an
execution name used again (allowed 90 days after its execution closed) gets a job of its own.

It also returns how the run polls: the interval between two DescribeTrainingJob calls, and two budgets
the state machine counts down: polls while the job has not started training yet (``start_left``:
``START_TIMEOUT_S``, instances launching, image and data downloading) and polls once it trains
(``left``: the spec's max_runtime_s plus a grace period for SageMaker to stop the job on its own and
upload what it has). The run's deadline so counts from the job's training start, not from the launch.
A job past either budget is stopped, and the run fails (StartTimedOut, RunTimedOut). Both budgets
together are bounded (MAX_POLLS): Step Functions fails an execution at 25,000 history events, and each
poll costs some, so a long runtime gets a longer interval instead of more polls.

Capacity: SageMaker reports a shortage not at CreateTrainingJob but as a job that Failed with a
``CapacityError`` FailureReason. The state machine then calls this function again with the failed
launch (``previous``) and the reason: after a backoff it creates the next attempt's job, up to
``CAPACITY_RELAUNCHES`` times, carrying the poll budgets over and recording every failed attempt
(``attempts``, which result.json keeps).

One run never reaches another's prefixes: the job is created on a session of the job launcher role that
carries the job's session tags (its run, token, artifacts and resumed run: job_session_tags), which
SageMaker chains into the job's session of the execution role (SessionChainingConfig), whose S3
statements name each prefix by those tags.

Errors the state machine retries are raised by name: LaunchThrottled, CapacityUnavailable. A run name
whose job is running already is refused (RunNameInUse) before anything is created, and so is a run whose
checkpoint prefix holds checkpoints already (CheckpointsExist). A job is adopted only when its
execution_arn tag is this execution's (a retried launch); another execution's job of the same name is
refused (JobNameTaken).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from typing import Any

import boto3
from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from lambdas.clients import CONFIG, client, execution_of, object_size_or_none, put_new_object, recent_running_jobs
from lambdas.core.deadlines import next_backoff_s, poll_plan
from lambdas.core.execution import EXECUTION_TAG, job_name_for_execution, run_id
from lambdas.core.job_spec import RUN_ID, SpecPolicy, split_s3_uri, validate_job_spec
from lambdas.core.results import ResultExistsError, WriteConflict
from lambdas.core.training_request import (
    JOB_KEY_TAG,
    checkpoint_uri,
    create_training_job_request,
    job_session_tags,
    settings_from_environment,
    token_uri,
)
from training.hyperparameters import TOKEN_FILE
from training.workload.code import stored_archive_problem

logger = Logger(service="launch-job")

THROTTLING = {"ThrottlingException", "Throttling", "TooManyRequestsException"}
CAPACITY = {"ResourceLimitExceeded", "CapacityError", "InsufficientCapacityError"}


class LaunchThrottled(RuntimeError):
    pass


class CapacityUnavailable(RuntimeError):
    pass


class LaunchRefused(RuntimeError):
    pass


class RunIdTaken(RuntimeError):
    """results/<run id>/result.json exists: an execution name used again (90 days on) would train, then
    find no place for its result. Refused before anything is billed."""


class RunIdUnsupported(RuntimeError):
    """The execution's name has characters a SageMaker tag value cannot hold (e.g. ``!'()``): the job
    could not carry the tag the reconciler finds it by. Refused before anything is created."""


class NothingToResume(RuntimeError):
    """The spec resumes a run that left no checkpoints: it would silently train from scratch."""


class CodeMissing(RuntimeError):
    """A user workload's archive is not where the spec says, or is not the archive its SHA-256 names: the
    job would start, bill, and fail on every host. Refused before anything is created (``hetero run``
    uploads it)."""


class JobNameTaken(RuntimeError):
    """A job of this launch's name exists but belongs to another execution (its execution_arn tag says so):
    adopting it would poll, stop and collect another run's job. Nothing is created."""


class CheckpointsExist(RuntimeError):
    """The run's own checkpoint prefix holds checkpoints already (written by someone other than this run):
    its job would resume their last step instead of training from the start. Nothing is launched."""


class RunNameInUse(RuntimeError):
    """Another execution's job of the same run name is running: two runs of one name at once would
    compete for the same results and, resuming, the same checkpoints."""


# How SageMaker reports a capacity shortage: a Failed job whose FailureReason starts "CapacityError: Unable
# to provision requested ML compute capacity..." (the SageMaker Python SDK looks for the same word).
CAPACITY_FAILURE = "CapacityError"


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    if event.get("step") == "decide_relaunch":
        return decide_relaunch(event["previous"])
    return launch(event)


def decide_relaunch(previous: dict[str, Any]) -> dict[str, Any]:
    """Whether the failed job of ``previous`` is launched again: it failed for want of capacity, and
    relaunches and start window are left (a relaunch without time to start would be stopped unstarted)."""
    reason = client("sagemaker").describe_training_job(TrainingJobName=previous["job_name"]).get("FailureReason", "")
    relaunch = CAPACITY_FAILURE in reason and previous["relaunches_left"] > 0 and previous["polls"]["start_left"] > 0
    logger.info("failed job", extra={"job_name": previous["job_name"], "reason": reason, "relaunch": relaunch})
    return {"relaunch": relaunch, "reason": reason}


def launch(event: dict[str, Any]) -> dict[str, Any]:
    spec = validate_job_spec(event["spec"], SpecPolicy.from_environment(os.environ))
    run = run_id(event["execution_arn"])
    if not RUN_ID.fullmatch(run):
        raise RunIdUnsupported(f"execution name {run!r}: start the run under a name of letters, digits, '-' and '_' (≤ 80)")
    previous = event.get("previous")
    plan = next_attempt(previous, event.get("failure_reason", "")) if previous else first_attempt(spec.max_runtime_s)
    prefix = os.environ["JOB_NAME_PREFIX"]
    name = job_name_for_execution(prefix, spec.run_name, event["execution_arn"], event["execution_start"], plan["attempt"])
    settings = settings_from_environment(dict(os.environ))
    # The reconciler (lambdas/reconcile_jobs) finds the execution of a running job by this tag.
    settings = replace(settings, tags=dict(settings.tags) | {EXECUTION_TAG: event["execution_arn"]})
    request = create_training_job_request(spec, settings, name=name, run_id=run, chain_session_tags=True)
    if spec.resume_from and not _has_checkpoints(checkpoint_uri(settings, spec.resume_from)):
        raise NothingToResume(f"run {spec.resume_from!r} left no checkpoints ({checkpoint_uri(settings, spec.resume_from)}): "
                              "name a run that wrote some, or leave resume_from out to start afresh")
    if spec.code is not None:
        problem = stored_archive_problem(client("s3"), *split_s3_uri(spec.code.source), spec.code.sha256)
        if problem is not None:  # every host would refuse it, after the job started billing
            raise CodeMissing(f"the workload's code: {problem}: start the run with `hetero run`, which packs and uploads it")
    result_key = f"results/{run}/result.json"
    if object_size_or_none(os.environ["RESULTS_BUCKET"], result_key) is not None:
        raise RunIdTaken(f"{result_key} exists already (an earlier execution of this name): start the run under another name")
    sagemaker = client("sagemaker")
    adopted = _own_job(sagemaker, name, event["execution_arn"])
    if adopted:  # a retried launch (the Lambda's answer was lost): its job was created, and may have checkpointed since
        logger.info("job already launched by an earlier attempt", extra={"job_name": name})
        return {"job_name": name} | plan
    # Only this run's jobs write under checkpoints/<run id>/: anything there now (a direct launcher's
    # upload, an earlier execution of this name) would be resumed as if this run had trained it. A
    # capacity relaunch follows a job that never started, which wrote none.
    if _has_checkpoints(checkpoint_uri(settings, run)):
        raise CheckpointsExist(f"{checkpoint_uri(settings, run)} holds checkpoints this run did not write: start the run under another "
                               "name, or name their run in resume_from to continue it")
    try:
        others = running_jobs_of(sagemaker, prefix, spec.run_name) - {name}
        if others:
            raise RunNameInUse(f"run {spec.run_name!r} is running already (training job {sorted(others)[0]}); wait for it, stop it, or pick another run_name")
        _write_token(token_uri(settings, name))
        job_creator(job_session_tags(spec, name=name, run_id=run)).create_training_job(**request)
    except ClientError as error:
        code = error.response["Error"]["Code"]
        message = error.response["Error"].get("Message", "")
        if code == "ResourceInUse" and _own_job(sagemaker, name, event["execution_arn"]):  # created by a retry botocore made
            logger.info("job already launched by an earlier attempt", extra={"job_name": name})
            return {"job_name": name} | plan
        if code == "ResourceInUse":
            raise JobNameTaken(f"training job {name} exists and is not this execution's: nothing was created") from None
        raise _named(code, message) from None
    logger.info("launched", extra={"job_name": name, "attempt": plan["attempt"], "instance_groups": [g.name for g in spec.instance_groups]})
    stop_if_execution_ended(sagemaker, event["execution_arn"], name)
    return {"job_name": name} | plan


def job_creator(tags: dict[str, str]) -> Any:
    """A SageMaker client on a session of the job launcher role that carries the job's session tags: the
    job's own session of the execution role inherits them (SessionChainingConfig), and with them reaches
    only its own prefixes. The session lasts the call (15 minutes, STS's least)."""
    credentials = client("sts").assume_role(
        RoleArn=os.environ["JOB_LAUNCHER_ROLE_ARN"], RoleSessionName=tags[JOB_KEY_TAG][:64], DurationSeconds=900,
        Tags=[{"Key": key, "Value": value} for key, value in tags.items()],
    )["Credentials"]
    return boto3.client("sagemaker", aws_access_key_id=credentials["AccessKeyId"], aws_secret_access_key=credentials["SecretAccessKey"],
                        aws_session_token=credentials["SessionToken"], config=CONFIG)


def stop_if_execution_ended(sagemaker: Any, execution_arn: str, name: str) -> bool:
    """An execution aborted while this launch ran: its cleanup looked for the job before it existed, so
    the launch stops it itself (else it bills until the reconciler's next round)."""
    try:
        status = client("stepfunctions").describe_execution(executionArn=execution_arn)["status"]
    except ClientError as error:
        logger.warning("could not check the execution; the reconciler will", extra={"error": error.response["Error"]["Code"]})
        return False
    if status == "RUNNING":  # eventually consistent: a very recent abort may still read RUNNING (the reconciler follows up)
        return False
    try:
        sagemaker.stop_training_job(TrainingJobName=name)
    except ClientError as error:  # the abort cleanup stopped it first, or it ended already
        logger.info("job not stopped here", extra={"job_name": name, "error": error.response["Error"]["Code"]})
        return False
    logger.info("execution ended during the launch: job stopped", extra={"job_name": name, "execution_status": status})
    return True


def first_attempt(max_runtime_s: int) -> dict[str, Any]:
    interval, polls, start_polls = poll_plan(
        max_runtime_s, int(os.environ.get("DEADLINE_GRACE_S", "900")), int(os.environ.get("POLL_INTERVAL_S", "60")),
        int(os.environ.get("START_TIMEOUT_S", "7200")),
    )
    relaunches = int(os.environ.get("CAPACITY_RELAUNCHES", "3"))
    return {"poll_interval_s": interval, "polls": {"left": polls, "start_left": start_polls}, "attempt": 0,
            "relaunches_left": relaunches, "backoff_s": int(os.environ.get("RELAUNCH_BACKOFF_S", "120")), "attempts": []}


def next_attempt(previous: dict[str, Any], failure_reason: str) -> dict[str, Any]:
    """The attempt after a capacity failure: the poll budgets carried over (the deadline is the run's,
    not the attempt's), one relaunch fewer, twice the backoff, and the failed attempt on the record. Pure."""
    if previous["relaunches_left"] <= 0:
        raise CapacityUnavailable(f"no relaunches left after {len(previous['attempts']) + 1} attempts: {failure_reason}")
    return {
        "poll_interval_s": previous["poll_interval_s"],
        "polls": dict(previous["polls"]),
        "attempt": previous["attempt"] + 1,
        "relaunches_left": previous["relaunches_left"] - 1,
        "backoff_s": next_backoff_s(previous["backoff_s"]),
        "attempts": [*previous["attempts"], {"job_name": previous["job_name"], "failure_reason": failure_reason}],
    }


def _has_checkpoints(prefix_uri: str) -> bool:
    bucket, prefix = split_s3_uri(prefix_uri)
    return client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0) > 0


def _write_token(prefix_uri: str) -> None:
    """The job's shutdown token, once: a retried launch keeps the one its job may have read already."""
    bucket, prefix = split_s3_uri(prefix_uri)
    try:
        put_new_object(bucket, f"{prefix}{TOKEN_FILE}", secrets.token_urlsafe(32).encode(), "text/plain")
    except ResultExistsError:
        pass
    except WriteConflict as conflict:  # a concurrent write of the same token: the state machine retries the launch
        raise LaunchThrottled(str(conflict)) from None


def _named(code: str, message: str) -> Exception:
    """A SageMaker error as the state machine knows it: retried (LaunchThrottled, CapacityUnavailable) or not."""
    if code in THROTTLING:
        return LaunchThrottled(message)
    if code in CAPACITY:
        return CapacityUnavailable(message)
    return LaunchRefused(f"{code}: {message}")


def running_jobs_of(sagemaker: Any, prefix: str, run_name: str) -> set[str]:
    """The platform's running jobs of ``run_name`` (their names are <prefix>-<run name>-<10 hex>)."""
    stem = f"{prefix}-{run_name}-"
    return {name for name in recent_running_jobs(sagemaker, stem) if len(name) == len(stem) + 10}


def _own_job(sagemaker: Any, name: str, execution_arn: str) -> bool:
    """Whether job ``name`` exists and was launched by this execution (its execution_arn tag). A job of
    another execution's is never adopted, whatever its name."""
    try:
        arn = sagemaker.describe_training_job(TrainingJobName=name)["TrainingJobArn"]
    except ClientError as error:
        if error.response["Error"]["Code"] in ("ValidationException", "ResourceNotFound"):  # SageMaker's "not found"
            return False
        raise _named(error.response["Error"]["Code"], error.response["Error"].get("Message", "")) from None
    return execution_of(sagemaker, arn) == execution_arn
