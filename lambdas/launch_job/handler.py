"""Launch the training job for a validated spec: CreateTrainingJob with instance groups (the CDK's
SageMaker task cannot express them). The job name is derived from the execution and its start time, so
a retried launch finds the job it already created instead of starting a second one, and an execution name
used again (allowed 90 days after its execution closed) gets a job of its own.

It also returns how many polls the run may take: the spec's max_runtime_s plus a grace period for
SageMaker to stop the job on its own (its StoppingCondition) and upload what it has, in poll intervals.
The state machine counts them down; a job still running after the last one is stopped, and the run
fails with RunTimedOut. (Counting polls needs no clock in the state data, and only ever errs late.)

Errors the state machine retries are raised by name: LaunchThrottled, CapacityUnavailable.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from lambdas.clients import client
from lambdas.core.execution import job_name_for_execution
from lambdas.core.job_spec import validate_job_spec
from lambdas.core.training_request import LaunchSettings, create_training_job_request

logger = Logger(service="launch-job")

THROTTLING = {"ThrottlingException", "Throttling", "TooManyRequestsException"}
CAPACITY = {"ResourceLimitExceeded", "CapacityError", "InsufficientCapacityError"}


class LaunchThrottled(RuntimeError):
    pass


class CapacityUnavailable(RuntimeError):
    pass


class LaunchRefused(RuntimeError):
    pass


def settings_from_environment(environ: dict[str, str]) -> LaunchSettings:
    return LaunchSettings(
        image_uris=json.loads(environ["IMAGE_URIS"]),
        role_arn=environ["SAGEMAKER_ROLE_ARN"],
        output_s3_uri=environ["OUTPUT_S3_URI"],
        checkpoint_s3_uri=environ["CHECKPOINT_S3_URI"],
        tags=json.loads(environ.get("JOB_TAGS", "{}")),
        neuron_cache_s3_uri=environ.get("NEURON_CACHE_S3_URI", ""),
    )


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    spec = validate_job_spec(event["spec"])
    name = job_name_for_execution(os.environ["JOB_NAME_PREFIX"], spec.run_name, event["execution_arn"], event["execution_start"])
    request = create_training_job_request(
        spec, settings_from_environment(dict(os.environ)), name=name, shutdown_token=secrets.token_urlsafe(32)
    )
    sagemaker = client("sagemaker")
    try:
        sagemaker.create_training_job(**request)
    except ClientError as error:
        code = error.response["Error"]["Code"]
        message = error.response["Error"].get("Message", "")
        if code == "ResourceInUse" and _exists(sagemaker, name):
            logger.info("job already launched by an earlier attempt", extra={"job_name": name})
            return {"job_name": name, "polls_left": _polls(spec.max_runtime_s)}
        if code in THROTTLING:
            raise LaunchThrottled(message) from None
        if code in CAPACITY:
            raise CapacityUnavailable(message) from None
        raise LaunchRefused(f"{code}: {message}") from None
    logger.info("launched", extra={"job_name": name, "instance_groups": [g.name for g in spec.instance_groups]})
    return {"job_name": name, "polls_left": _polls(spec.max_runtime_s)}


def polls_allowed(max_runtime_s: int, grace_s: int, poll_interval_s: int) -> int:
    return math.ceil((max_runtime_s + grace_s) / poll_interval_s)


def _polls(max_runtime_s: int) -> int:
    return polls_allowed(max_runtime_s, int(os.environ.get("DEADLINE_GRACE_S", "900")), int(os.environ.get("POLL_INTERVAL_S", "60")))


def _exists(sagemaker: Any, name: str) -> bool:
    try:
        sagemaker.describe_training_job(TrainingJobName=name)
        return True
    except ClientError:
        return False
