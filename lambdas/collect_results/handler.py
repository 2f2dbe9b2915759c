"""Write results/<run id>/result.json for a finished (or failed) run, never over an existing one.

Event: {"spec", "execution_arn", "job_name"?, "attempts"?: [{job_name, failure_reason}], "failure"?: {"Error", "Cause"}}. The step times come from
the trainer's summary.json inside the job's output.tar.gz (an archive that cannot be read, or is larger
than MAX_ARCHIVE_BYTES, is recorded as such: the run failed with SummaryUnreadable); cost from the
fallback price table. A retried collect of the same execution finds its own result and returns it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from aws_lambda_powertools import Logger

from lambdas.clients import client, object_size_or_none, put_new_object, read_existing, read_object_or_none
from lambdas.core.execution import run_id
from lambdas.core.job_spec import validate_job_spec
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.results import ResultExistsError, read_summary, result_document

logger = Logger(service="collect-results")


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    spec = validate_job_spec(event["spec"])
    job_name = event.get("job_name")
    describe = client("sagemaker").describe_training_job(TrainingJobName=job_name) if job_name else None
    failure = event.get("failure")
    # A failure recorded by the state machine needs no figures: the archive is not read then.
    summary, problem = read_summary(describe, object_size_or_none, read_object_or_none) if describe and not failure else (None, None)
    document = result_document(
        run_id=run_id(event["execution_arn"]),
        groups=[(group.instance_type, group.count) for group in spec.instance_groups],
        raw_spec=event["spec"],
        job_name=job_name,
        describe=describe,
        summary=summary,
        summary_problem=problem,
        prices=FALLBACK_PRICES,
        failure=f"{failure.get('Error')}: {failure.get('Cause')}" if failure else None,
        attempts=event.get("attempts"),
    )
    bucket, key = os.environ["RESULTS_BUCKET"], f"results/{document['run_id']}/result.json"
    try:
        put_new_object(bucket, key, json.dumps(document, indent=2, default=str).encode(), "application/json")
    except ResultExistsError:
        existing = json.loads(read_existing(bucket, key))  # WriteConflict: the state machine retries the collect
        if existing.get("job_name") != job_name:
            raise  # another run's result: never ours to replace
        logger.info("result written by an earlier attempt of this collect", extra={"key": key})
        document = existing
    logger.info("result written", extra={"key": key, "status": document["status"]})
    return {"result_uri": f"s3://{bucket}/{key}", "status": document["status"], "step_time_ms": document["step_time_ms"]}
