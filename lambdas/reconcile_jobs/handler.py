"""Stop the platform's training jobs that still run although the execution that launched them does not:
the last line of defence against orphans billing until their MaxRuntime (an abort whose cleanup event was
lost, a stop that failed every retry, a launch whose execution died before it recorded the job).

Runs on a schedule. Every running job whose name carries the platform's prefix is checked: its
``execution_arn`` tag (set at launch) names the execution; a job whose execution is no longer RUNNING,
or no longer exists, is stopped. A job without the tag was not launched by a training run: it is left
alone and logged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from lambdas.clients import client, execution_of, recent_running_jobs

logger = Logger(service="reconcile-jobs")


class ReconcileError(RuntimeError):
    """Some orphaned jobs could not be stopped (the others were): the function fails, and its alarm fires."""


def orphans(jobs: dict[str, str | None], execution_status: Callable[[str], str | None]) -> list[str]:
    """The jobs (name → execution ARN, or None when untagged) to stop: those whose execution is not
    running (None: it does not exist). Pure but for ``execution_status``."""
    return sorted(name for name, execution in jobs.items() if execution is not None and execution_status(execution) != "RUNNING")


def _running_jobs(sagemaker: Any, prefix: str) -> dict[str, str | None]:
    jobs: dict[str, str | None] = {}
    for name, arn in recent_running_jobs(sagemaker, f"{prefix}-").items():
        jobs[name] = execution_of(sagemaker, arn)
    return jobs


def _execution_status(stepfunctions: Any) -> Callable[[str], str | None]:
    def status(execution_arn: str) -> str | None:
        try:
            return stepfunctions.describe_execution(executionArn=execution_arn)["status"]
        except ClientError as error:
            if error.response["Error"]["Code"] == "ExecutionDoesNotExist":
                return None
            raise

    return status


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    sagemaker = client("sagemaker")
    jobs = _running_jobs(sagemaker, os.environ["JOB_NAME_PREFIX"])
    untagged = sorted(name for name, execution in jobs.items() if execution is None)
    if untagged:
        logger.info("running jobs launched outside a training run, left alone", extra={"jobs": untagged})
    stopped, errors = [], []
    for name in orphans(jobs, _execution_status(client("stepfunctions"))):
        logger.warning("stopping a job whose execution is no longer running", extra={"job_name": name, "execution_arn": jobs[name]})
        try:
            sagemaker.stop_training_job(TrainingJobName=name)
            stopped.append(name)
        except ClientError as error:  # one job (ended meanwhile, say) never keeps the others running
            if error.response["Error"]["Code"] != "ValidationException":
                errors.append(f"{name}: {error}")
    if errors:
        raise ReconcileError("; ".join(errors))
    return {"checked": len(jobs), "stopped": stopped}
