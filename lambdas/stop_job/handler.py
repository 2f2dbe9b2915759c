"""Stop the training job of a run, if one is running.

Called by the state machine's Catch (event {"job_name"}), and by an EventBridge rule when an execution
is aborted or times out, where Step Functions itself runs no cleanup (event: the "Step Functions
Execution Status Change" notification, whose detail holds the execution ARN, its start date and input;
the job name is derived from them as the launch derived it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from lambdas.clients import client
from lambdas.core.execution import job_name_for_execution

logger = Logger(service="stop-job")
RUNNING = {"InProgress"}


def job_name_from_event(event: dict[str, Any]) -> str | None:
    if "job_name" in event:
        return event["job_name"]
    detail = event.get("detail", {})
    try:
        run_name = json.loads(detail.get("input") or "{}")["run_name"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None  # an input that never validated launched nothing
    return job_name_for_execution(os.environ["JOB_NAME_PREFIX"], run_name, detail["executionArn"], detail["startDate"])


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    name = job_name_from_event(event)
    if name is None:
        return {"job_name": None, "stopped": False, "status": "NotStarted"}
    sagemaker = client("sagemaker")
    try:
        status = sagemaker.describe_training_job(TrainingJobName=name)["TrainingJobStatus"]
    except ClientError as error:
        if error.response["Error"]["Code"] == "ValidationException":  # no such job: never launched
            return {"job_name": name, "stopped": False, "status": "NotStarted"}
        raise
    if status not in RUNNING:
        return {"job_name": name, "stopped": False, "status": status}
    sagemaker.stop_training_job(TrainingJobName=name)
    logger.info("stopped", extra={"job_name": name})
    return {"job_name": name, "stopped": True, "status": "Stopping"}
