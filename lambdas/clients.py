"""boto3 clients for the Lambda handlers, made on first use (never at import), one per service and
process, so that a warm Lambda reuses its connections and tests can run handlers under moto; and the two
S3 reads and writes the handlers share (write-once objects, objects that may be missing)."""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from lambdas.core.execution import EXECUTION_TAG
from lambdas.core.results import ResultExistsError, WriteConflict

# SageMaker's longest MaxRuntimeInSeconds (28 days): no running job was created before that.
LONGEST_RUNTIME_S = 28 * 24 * 3600
# Standard retry mode backs off on throttling: up to 4 retries (5 attempts) per call; the state machine
# retries what still fails.
CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 5})


@functools.cache
def client(service: str) -> Any:
    return boto3.client(service, config=CONFIG)


@functools.cache
def pricing_client() -> Any:
    """The Price List API answers only in a few regions (us-east-1 among them), for every region."""
    from lambdas.core.pricing import PRICING_REGION

    return boto3.client("pricing", region_name=PRICING_REGION, config=CONFIG)


def execution_of(sagemaker: Any, job_arn: str) -> str | None:
    """The ARN of the execution that launched a job (its execution_arn tag), or None for an untagged one."""
    tags = sagemaker.list_tags(ResourceArn=job_arn, MaxResults=100).get("Tags", [])
    return {tag["Key"]: tag["Value"] for tag in tags}.get(EXECUTION_TAG)  # a key SageMaker's AddTags set again: its last value


def put_new_object(bucket: str, key: str, body: bytes, content_type: str) -> None:
    """Write an object only if none exists at that key (If-None-Match): results and reports are never
    overwritten. Raises ResultExistsError when one does, WriteConflict when a concurrent write of the key
    is in progress (409: retry)."""
    try:
        client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type, IfNoneMatch="*")
    except ClientError as error:
        code = error.response["Error"]["Code"]
        if code == "PreconditionFailed":
            raise ResultExistsError(f"s3://{bucket}/{key} exists already; results and reports are never overwritten") from None
        if code == "ConditionalRequestConflict":
            raise WriteConflict(f"s3://{bucket}/{key}: a concurrent write is in progress (409); retry") from None
        raise


def read_object_or_none(bucket: str, key: str) -> bytes | None:
    """An object's bytes, or None when there is none at that key."""
    try:
        return client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if error.response["Error"]["Code"] in ("NoSuchKey", "404"):
            return None
        raise


def read_existing(bucket: str, key: str) -> bytes:
    """The object a write-once put was refused for (it exists). Raises WriteConflict when it reads as missing:
    a concurrent write that did not complete (retry)."""
    written = read_object_or_none(bucket, key)
    if written is None:
        raise WriteConflict(f"s3://{bucket}/{key} was refused as existing but reads as missing; retry")
    return written


def object_size_or_none(bucket: str, key: str) -> int | None:
    """An object's size in bytes, or None when there is none at that key."""
    try:
        return int(client("s3").head_object(Bucket=bucket, Key=key)["ContentLength"])
    except ClientError as error:
        if error.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
            return None
        raise


def recent_running_jobs(sagemaker: Any, stem: str) -> dict[str, str]:
    """Running jobs whose name starts with ``stem`` (name → ARN). SageMaker filters by name and status only after
    fetching each page, and jobs are never deleted: bounded by creation time (no job runs longer than
    SageMaker's longest MaxRuntime, plus a day of waiting for capacity), newest first, 100 a page."""
    since = datetime.now(UTC) - timedelta(seconds=LONGEST_RUNTIME_S) - timedelta(days=1)
    pages = sagemaker.get_paginator("list_training_jobs").paginate(
        NameContains=stem, StatusEquals="InProgress", CreationTimeAfter=since, SortBy="CreationTime", SortOrder="Descending",
        PaginationConfig={"PageSize": 100},
    )
    return {job["TrainingJobName"]: job["TrainingJobArn"] for page in pages for job in page["TrainingJobSummaries"]
            if job["TrainingJobName"].startswith(stem)}
