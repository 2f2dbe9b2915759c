"""Stop the training job of a run, if one is running.

Called by the state machine's Catch (event {"job_name"}), and by an EventBridge rule when an execution
is aborted or times out, where Step Functions itself runs no cleanup (event: the "Step Functions
Execution Status Change" notification, whose detail holds the execution ARN, its start date and input;
the job names are derived from them as the launch derived them, one per launch attempt: after capacity
failures, the running job is a later attempt's).
"""

from __future__ import annotations

import json
import os
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from lambdas.clients import client, execution_of
from lambdas.core.execution import job_name_for_execution
from lambdas.core.job_spec import is_run_name

logger = Logger(service="stop-job")
RUNNING = {"InProgress"}


def job_names_from_event(event: dict[str, Any]) -> list[str]:
    """The job the state machine names, or every job the aborted execution may have launched."""
    if "job_name" in event:
        return [event["job_name"]]
    detail = event.get("detail", {})
    try:
        # ValueError: bad JSON, or an integer past Python's 4,300 digits
        run_name = json.loads(detail.get("input") or "{}")["run_name"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return []  # an input that never validated launched nothing
    # Only the run name makes the job's name, so only it is checked (a spec the code of today refuses may
    # have launched under yesterday's). A name no run can have (the run failed InvalidJobSpec) launched
    # nothing: no job to look for, and no error either (a failed stop raises the "a job may be billing" alarm).
    if not isinstance(run_name, str) or not is_run_name(run_name):
        return []
    attempts = 1 + int(os.environ.get("CAPACITY_RELAUNCHES", "0"))
    prefix = os.environ["JOB_NAME_PREFIX"]
    return [job_name_for_execution(prefix, run_name, detail["executionArn"], detail["startDate"], attempt) for attempt in range(attempts)]


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    names = job_names_from_event(event)
    sagemaker = client("sagemaker")
    outcome = {"job_name": names[0] if names else None, "stopped": False, "status": "NotStarted"}
    for name in names:
        try:
            described = sagemaker.describe_training_job(TrainingJobName=name)
        except ClientError as error:
            if error.response["Error"]["Code"] == "ValidationException":  # no such job: this attempt never launched
                continue
            raise
        status = described["TrainingJobStatus"]
        outcome = {"job_name": name, "stopped": False, "status": status}
        # After an abort, only the aborted execution's own job (the state machine names its job itself).
        if status in RUNNING and "job_name" not in event and execution_of(sagemaker, described["TrainingJobArn"]) != event["detail"]["executionArn"]:
            logger.warning("a job of this name is another execution's: left running", extra={"job_name": name})
            continue
        if status in RUNNING:
            sagemaker.stop_training_job(TrainingJobName=name)
            logger.info("stopped", extra={"job_name": name})
            return {"job_name": name, "stopped": True, "status": "Stopping"}
    return outcome

