"""Names that tie a Step Functions execution to the training job it launched. Pure.

The job name is derived from the run name and the execution's ARN, so that whoever knows the
execution (the stop Lambda, woken by EventBridge after an abort or a timeout) finds the job without any
stored state.
"""

from __future__ import annotations

import hashlib

from lambdas.core.training_request import job_name


def job_name_for_execution(prefix: str, run_name: str, execution_arn: str) -> str:
    return job_name(prefix, run_name, hashlib.sha256(execution_arn.encode()).hexdigest()[:10])


def run_id(execution_arn: str) -> str:
    """Results live under results/<run id>/: the execution's name, unique per state machine."""
    return execution_arn.rsplit(":", 1)[-1]
