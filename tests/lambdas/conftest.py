"""AWS for the Lambda tests: moto behind botocore (which validates every request), plus the one call
moto lacks (StopTrainingJob), added to moto's SageMaker service the way moto implements its others."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.core.exceptions import JsonRESTError
from moto.core.responses import EmptyResult
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from lambdas.clients import client
from tests.archives import output_archive  # noqa: F401 - the Lambda and workflow tests import it from here

ACCOUNT, REGION = "123456789012", "us-east-1"
RESULTS_BUCKET = "results-bucket"
ENVIRONMENT = {
    "AWS_DEFAULT_REGION": REGION,
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "RESULTS_BUCKET": RESULTS_BUCKET,
    "JOB_NAME_PREFIX": "hetero",
    "IMAGE_URIS": json.dumps({"pytorch": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/training-pytorch:abc"}),
    "SAGEMAKER_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/training-sagemaker",
    "JOB_LAUNCHER_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/training-job-launcher",
    "OUTPUT_S3_URI": f"s3://{RESULTS_BUCKET}/artifacts/",
    "CHECKPOINT_S3_URI": f"s3://{RESULTS_BUCKET}/checkpoints/",
    "CONTROL_S3_URI": f"s3://{RESULTS_BUCKET}/control/",
    "PRICING_REGION_CODE": REGION,
    "CAPACITY_RELAUNCHES": "3",
    # The deployment's policy, as infra/constructs/functions.py sets it (the datasets bucket of the examples).
    "INPUT_BUCKETS": json.dumps(["datasets-bucket"]),
    "RUN_COST_CEILING_USD": "1000",
    "SWEEP_COST_CEILING_USD": "5000",
    "CEILING_PRICES": json.dumps({"ml.trn1.2xlarge": 1.5, "ml.trn1.32xlarge": 25.0}),
}


_moto_create_training_job = SageMakerModelBackend.create_training_job


def refuse_a_name_in_use(self: SageMakerModelBackend, training_job_name: str, *args, **kwargs):
    """SageMaker refuses CreateTrainingJob for a name that exists (ResourceInUse); moto 5 overwrites the
    job silently. This stands in for the service at its boundary."""
    if training_job_name in self.training_jobs:
        raise JsonRESTError("ResourceInUse", f"Training job names must be unique within an AWS account and region, and a training job with this name already exists ({training_job_name})")
    return _moto_create_training_job(self, training_job_name, *args, **kwargs)


def _stop_training_job(self: SageMakerResponse) -> EmptyResult:
    job = self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")]
    job.training_job_status = job.secondary_status = "Stopping"
    return EmptyResult()


@dataclass
class LambdaContext:
    function_name: str = "test-function"
    memory_limit_in_mb: int = 256
    invoked_function_arn: str = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:test-function"
    aws_request_id: str = "request-1"


class Aws:
    """Handles on the fake account: clients, and moto's SageMaker backend for scripting a job."""

    def __init__(self) -> None:
        self.sagemaker = boto3.client("sagemaker", region_name=REGION)
        self.s3 = boto3.client("s3", region_name=REGION)

    def training_job(self, name: str) -> Any:
        return sagemaker_backends[ACCOUNT][REGION].training_jobs[name]

    def training_jobs(self) -> list[str]:
        return [job["TrainingJobName"] for job in self.sagemaker.list_training_jobs()["TrainingJobSummaries"]]


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Aws]:
    for key, value in ENVIRONMENT.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(SageMakerResponse, "stop_training_job", _stop_training_job, raising=False)
    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", refuse_a_name_in_use)
    client.cache_clear()
    with mock_aws():
        fake = Aws()
        fake.s3.create_bucket(Bucket=RESULTS_BUCKET)
        yield fake
    client.cache_clear()


@pytest.fixture
def context() -> LambdaContext:
    return LambdaContext()
