"""Names that tie a Step Functions execution to the training job it launched. Pure.

The job name is derived from the run name, the execution's ARN and its start time, so that whoever knows
the execution (the stop Lambda, woken by EventBridge after an abort or a timeout, whose event carries both)
finds the job without any stored state. The start time matters: an execution name may be used again 90
days after its execution closed, and the same ARN must not adopt the earlier execution's job.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from lambdas.core.training_request import job_name

# The tag every launched job carries with its execution's ARN: how the reconciler finds the execution.
EXECUTION_TAG = "execution_arn"


def epoch_ms(started: str | int | float | datetime) -> int:
    """An execution's start as epoch milliseconds, from any of its spellings: Step Functions' context
    object (ISO 8601, ``2026-11-30T23:59:35.123Z``), EventBridge's detail (``startDate``, epoch ms), or a
    datetime (boto3's DescribeExecution)."""
    if isinstance(started, (int, float)):
        return int(started)
    moment = started if isinstance(started, datetime) else datetime.fromisoformat(str(started).replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def job_name_for_execution(prefix: str, run_name: str, execution_arn: str, started: str | int | float | datetime, attempt: int = 0) -> str:
    """The job of the execution's ``attempt`` (0: the first launch; n: the n-th relaunch after a
    capacity failure)."""
    key = f"{execution_arn}@{epoch_ms(started)}" + (f"#{attempt}" if attempt else "")
    return job_name(prefix, run_name, hashlib.sha256(key.encode()).hexdigest()[:10])


def run_id(execution_arn: str) -> str:
    """Results live under results/<run id>/: the execution's name, unique per state machine."""
    return execution_arn.rsplit(":", 1)[-1]
