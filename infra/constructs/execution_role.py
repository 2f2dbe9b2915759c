"""The role SageMaker training jobs run as: read the input buckets (the datasets bucket and any the
deployment allows), write artifacts and checkpoints, pull our images, write the job's logs and metrics.
Nothing more."""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import S3_READ_ACTIONS, S3_WRITE_ACTIONS, acknowledge, arn_token, wildcard_actions, wildcard_resources

SAGEMAKER_NAMESPACE = "/aws/sagemaker/TrainingJobs"


class ExecutionRole(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        inputs: Iterable[s3.IBucket],
        results: s3.IBucket,
        images: Iterable[ecr_assets.DockerImageAsset],
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"))
        inputs = list(inputs)  # the datasets bucket, then cdk.json's input_buckets: what specs may read
        for bucket in inputs:
            bucket.grant_read(self.role)
        results.grant_read(self.role, "control/*")  # the job's own shutdown token, as its platform channel
        results.grant_read_write(self.role, "artifacts/*")
        results.grant_read_write(self.role, "checkpoints/*")
        results.grant_read_write(self.role, "neuron-cache/*")  # compiled Neuron graphs, reused across jobs
        for image in images:
            image.repository.grant_pull(self.role)
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[stack.format_arn(service="logs", resource="log-group", resource_name=f"{SAGEMAKER_NAMESPACE}:*", arn_format=ArnFormat.COLON_RESOURCE_NAME)],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": SAGEMAKER_NAMESPACE}},
            )
        )
        acknowledge(
            self.role,
            "S3 action families from grant_read/grant_read_write, held to the input buckets (datasets, and cdk.json's "
            "input_buckets) and the results "
            "bucket's control/ (read), artifacts/, checkpoints/ and neuron-cache/ prefixes; SageMaker's training log group; PutMetricData and "
            "ecr:GetAuthorizationToken take no resource ARN (the former is held to SageMaker's namespace).",
            *wildcard_actions(*S3_READ_ACTIONS, *S3_WRITE_ACTIONS),
            *wildcard_resources(
                "*",
                *(f"{arn_token(bucket)}/*" for bucket in inputs),
                f"{arn_token(results)}/control/*",
                f"{arn_token(results)}/artifacts/*",
                f"{arn_token(results)}/checkpoints/*",
                f"{arn_token(results)}/neuron-cache/*",
                f"arn:<AWS::Partition>:logs:{stack.region}:<AWS::AccountId>:log-group:{SAGEMAKER_NAMESPACE}:*",
            ),
        )
