"""tests/sdk/ runs in .venv-sdk, the client with the real SageMaker Python SDK (sagemaker-train), not the
platform's packages (torch, TensorFlow, CDK): `make test` runs

    .venv-sdk/bin/python -m pytest tests/sdk --confcutdir=tests/sdk

AWS is moto's at the network boundary, botocore validating every request; the deployed stack is a
CloudFormation stack with the platform's outputs (its LaunchSettings as the launch function has them:
tests/infra checks that the synthesized output is the function's environment). Every CreateTrainingJob
any client sends is recorded at the botocore layer (``Aws.created``), whoever built it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from moto import mock_aws
from moto.core.responses import EmptyResult
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from tests.archives import output_archive
from tests.lambdas.conftest import _stop_training_job as stop_training_job
from tests.lambdas.conftest import refuse_a_name_in_use

REGION, ACCOUNT = "us-east-1", "123456789012"
RESULTS, DATASETS = "results-bucket", "datasets-bucket"
# The launch function's settings, as the stack exports them (infra/constructs/functions.py).
LAUNCH_SETTINGS = {
    "JOB_NAME_PREFIX": "hetero",
    "INPUT_BUCKETS": json.dumps([DATASETS]),
    "RUN_COST_CEILING_USD": "1000.0",
    "SWEEP_COST_CEILING_USD": "5000.0",
    "CEILING_PRICES": json.dumps({"ml.trn1.2xlarge": 1.5484, "ml.trn1.32xlarge": 24.7726}),
    "IMAGE_URIS": json.dumps({variant: f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/cdk-assets:{variant}"
                              for variant in ("pytorch", "tensorflow", "neuron")}),
    "SAGEMAKER_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/HeteroTrainingPlatform-SageMakerExecutionRole",
    "OUTPUT_S3_URI": f"s3://{RESULTS}/artifacts/",
    "CHECKPOINT_S3_URI": f"s3://{RESULTS}/checkpoints/",
    "CONTROL_S3_URI": f"s3://{RESULTS}/control/",
    "NEURON_CACHE_S3_URI": f"s3://{RESULTS}/neuron-cache/",
    "JOB_TAGS": json.dumps({"platform": "hetero"}),
}

def _create_training_job(self: SageMakerModelBackend, training_job_name: str, *args: Any, **kwargs: Any) -> Any:
    """CreateTrainingJob as SageMaker answers it (ResourceInUse for a name that exists, as the Lambda
    tests have it), and a new job InProgress (moto's is Completed at once); the test ends it (Aws.finish)."""
    created = refuse_a_name_in_use(self, training_job_name, *args, **kwargs)
    job = self.training_jobs[training_job_name]
    job.training_job_status, job.secondary_status = "InProgress", "Starting"
    return created


STOPPED: list[str] = []


def _stop_training_job(self: SageMakerResponse) -> EmptyResult:
    """StopTrainingJob as the Lambda tests add it to moto, each job it reached recorded."""
    reply = stop_training_job(self)
    STOPPED.append(self._get_param("TrainingJobName"))
    return reply


@dataclass
class Aws:
    created: list[dict[str, Any]] = field(default_factory=list)  # every CreateTrainingJob botocore sent, as sent
    stops: list[str] = field(default_factory=lambda: STOPPED)  # every job StopTrainingJob reached

    @property
    def s3(self) -> Any:
        return boto3.client("s3", region_name=REGION)

    @property
    def sagemaker(self) -> Any:
        return boto3.client("sagemaker", region_name=REGION)

    def keys(self, prefix: str) -> list[str]:
        return [item["Key"] for item in self.s3.list_objects_v2(Bucket=RESULTS, Prefix=prefix).get("Contents", [])]

    def jobs(self) -> list[str]:
        return sorted(job["TrainingJobName"] for job in self.sagemaker.list_training_jobs()["TrainingJobSummaries"])

    def finish(self, job_name: str, summary: dict[str, Any] | None, billable_s: int = 600) -> None:
        """The job completes, its hosts' summary (if any) in output.tar.gz as SageMaker uploads it."""
        if summary is not None:  # under the job's own S3OutputPath, as SageMaker uploads it
            output = self.sagemaker.describe_training_job(TrainingJobName=job_name)["OutputDataConfig"]["S3OutputPath"]
            prefix = output.removeprefix(f"s3://{RESULTS}/").rstrip("/")
            self.s3.put_object(Bucket=RESULTS, Key=f"{prefix}/{job_name}/output/output.tar.gz", Body=output_archive(summary))
        job = sagemaker_backends[ACCOUNT][REGION].training_jobs[job_name]
        job.training_job_status = job.secondary_status = "Completed"
        job.billable_time_in_seconds = billable_s


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[Aws]:
    for key, value in {"AWS_DEFAULT_REGION": REGION, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "SAGEMAKER_USER_CONFIG_OVERRIDE", "SAGEMAKER_ADMIN_CONFIG_OVERRIDE", "SAGEMAKER_VALIDATE_ROLE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no SageMaker SDK config of the machine's user
    STOPPED.clear()
    recorded = Aws()
    convert = BaseClient._convert_to_request_dict

    # The parameters botocore serializes and sends, after every event handler (the SDK's and ours) had them.
    def record(self: BaseClient, api_params: dict[str, Any], operation_model: Any, *args: Any, **kwargs: Any) -> Any:
        if operation_model.name == "CreateTrainingJob":
            recorded.created.append(json.loads(json.dumps(api_params)))
        return convert(self, api_params, operation_model, *args, **kwargs)

    monkeypatch.setattr(BaseClient, "_convert_to_request_dict", record)
    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", _create_training_job)
    monkeypatch.setattr(SageMakerResponse, "stop_training_job", _stop_training_job, raising=False)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        for bucket in (RESULTS, DATASETS):
            s3.create_bucket(Bucket=bucket)
        template = {"Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
                    "Outputs": {"ResultsBucket": {"Value": RESULTS}, "LaunchSettings": {"Value": json.dumps(LAUNCH_SETTINGS)}}}
        boto3.client("cloudformation", region_name=REGION).create_stack(StackName="HeteroTrainingPlatform", TemplateBody=json.dumps(template))
        yield recorded
