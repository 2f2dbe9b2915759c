"""The role SageMaker training jobs run as: read the input buckets (the datasets bucket and any the
deployment allows), write artifacts and checkpoints, pull our images (and the script images of the
repositories cdk.json's script_image_repositories names), write the job's logs and metrics.
Nothing more.

One role serves every job, yet no job reaches another's prefixes. A state-machine launch creates its job
on a session tagged with the job's own keys (lambdas/core/training_request.py SESSION_TAG_KEYS), and
SageMaker chains those tags into the job's session of this role (SessionChainingConfig; SageMaker's
"ABAC for multi-tenancy training"), so its statements name the prefixes through ${aws:PrincipalTag/...}:
checkpoints/<its run>/ and artifacts/<its job>/ to read and write, control/<its job>/ (its token) and
checkpoints/<the run it resumes>/ to read. A job launched without the state machine (hetero/direct.py)
carries no such tags; an untagged session reaches only the direct.runs/ prefixes (which direct runs
share), and a session with some keys but not all reaches nothing of the results bucket's runs. The compiled
Neuron graphs (neuron-cache/) are shared by design: every Trainium job reuses them, so a job could plant a
graph another loads. User workloads' packed code (code/<sha256>/sourcedir.tar.gz, the client's upload) is
readable by every job, tagged or not, and writable by none: an archive is named by its content's SHA-256 and
each host refuses one whose hash is not its run's, so reading another run's code reveals nothing a job could
not be handed, and no job can plant code another runs. The isolation holds while nobody creates jobs of this
role from a session whose tags they chose (DirectLaunchPolicy denies it: infra/constructs/direct_launch.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import S3_READ_ACTIONS, S3_WRITE_ACTIONS, acknowledge, arn_token, wildcard_actions, wildcard_resources
from lambdas.core.job_spec import CODE_PREFIX
from lambdas.core.training_request import CONTROL_KEY_TAG, DIRECT_RUNS, JOB_KEY_TAG, RESUME_KEY_TAG, RUN_KEY_TAG, SESSION_TAG_KEYS
from training.hyperparameters import CODE_ARCHIVE

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
        script_repositories: Iterable[ecr.IRepository] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        # sts:TagSession: SageMaker passes the launch's session tags on when it assumes the role.
        self.role = iam.Role(self, "Role", assumed_by=iam.SessionTagsPrincipal(iam.ServicePrincipal("sagemaker.amazonaws.com")))
        inputs = list(inputs)  # the datasets bucket, then cdk.json's input_buckets: what specs may read
        for bucket in inputs:
            bucket.grant_read(self.role)
        for statement in run_scoped_statements(results):
            self.role.add_to_policy(statement)
        for statement in neuron_cache_statements(results):  # compiled Neuron graphs, reused across jobs
            self.role.add_to_policy(statement)
        for statement in code_statements(results):  # user workloads' packed code: read only
            self.role.add_to_policy(statement)
        for image in images:
            image.repository.grant_pull(self.role)
        for repository in script_repositories:  # cdk.json's script_image_repositories: script jobs' own images
            repository.grant_pull(self.role)
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
            "input_buckets) and the results bucket's neuron-cache/; each job's own objects under its session tags' prefixes "
            "(checkpoints/, artifacts/, control/: the * is what lies under the job's own key), or under direct.runs/ for "
            "an untagged session; user workloads' content-addressed code under code/, read only; SageMaker's training log group; PutMetricData and "
            "ecr:GetAuthorizationToken take no resource ARN (the former is held to SageMaker's namespace).",
            *wildcard_actions(*S3_READ_ACTIONS, *S3_WRITE_ACTIONS),
            *wildcard_resources(
                "*",
                *(f"{arn_token(bucket)}/*" for bucket in inputs),
                # cdk-nag writes a policy variable ${x} as <x>
                *(f"{arn_token(results)}/{prefix}".replace("${", "<").replace("}", ">") for prefix in own_prefixes()),
                f"{arn_token(results)}/neuron-cache/*",
                f"{arn_token(results)}/{CODE_PREFIX}*/{CODE_ARCHIVE}",
                f"arn:<AWS::Partition>:logs:{stack.region}:<AWS::AccountId>:log-group:{SAGEMAKER_NAMESPACE}:*",
            ),
        )


OWN_READ_WRITE = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts")


def _tag(key: str) -> str:
    return "${aws:PrincipalTag/" + key + "}"


# (the results bucket's key pattern, written too) that a job's session reaches: a tagged session (a
# state-machine launch) by its tags; an untagged one (a direct launch) under direct.runs/.
TAGGED_PREFIXES = ((f"checkpoints/{_tag(RUN_KEY_TAG)}/*", True), (f"artifacts/{_tag(JOB_KEY_TAG)}/*", True),
                   (f"control/{_tag(CONTROL_KEY_TAG)}/*", False), (f"checkpoints/{_tag(RESUME_KEY_TAG)}/*", False))
UNTAGGED_PREFIXES = ((f"checkpoints/{DIRECT_RUNS}/*", True), (f"artifacts/{DIRECT_RUNS}/*", True), (f"control/{DIRECT_RUNS}/*", False))


def own_prefixes() -> list[str]:
    return [pattern for pattern, _ in (*TAGGED_PREFIXES, *UNTAGGED_PREFIXES)]


def run_scoped_statements(results: s3.IBucket) -> list[iam.PolicyStatement]:
    """The results bucket's statements for a job's own prefixes: a tagged session's by its tags (every key
    present), an untagged one's (no key at all) under direct.runs/ only."""
    tagged = {"Null": {f"aws:PrincipalTag/{key}": "false" for key in SESSION_TAG_KEYS}}
    untagged = {"Null": {f"aws:PrincipalTag/{key}": "true" for key in SESSION_TAG_KEYS}}
    statements = []
    for patterns, conditions in ((TAGGED_PREFIXES, tagged), (UNTAGGED_PREFIXES, untagged)):
        # "<key>/*" only: a listing of "checkpoints/abc" (no slash) would also list checkpoints/abc-x/.
        listed = [pattern for pattern, _ in patterns]
        statements += [
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[results.arn_for_objects(pattern) for pattern, _ in patterns],
                                conditions=conditions),
            iam.PolicyStatement(actions=list(OWN_READ_WRITE), resources=[results.arn_for_objects(pattern) for pattern, writes in patterns if writes],
                                conditions=conditions),
            iam.PolicyStatement(actions=["s3:ListBucket"], resources=[results.bucket_arn],
                                conditions={"StringLike": {"s3:prefix": listed}} | conditions),
        ]
    statements.append(iam.PolicyStatement(actions=["s3:GetBucketLocation"], resources=[results.bucket_arn]))
    return statements


def neuron_cache_statements(results: s3.IBucket) -> list[iam.PolicyStatement]:
    """The shared compile cache (neuron-cache/): read and write its objects, list only under it (a bucket-wide
    s3:List* would let any job enumerate every run's keys)."""
    return [
        iam.PolicyStatement(actions=list(OWN_READ_WRITE), resources=[results.arn_for_objects("neuron-cache/*")]),
        iam.PolicyStatement(actions=["s3:ListBucket"], resources=[results.bucket_arn], conditions={"StringLike": {"s3:prefix": ["neuron-cache/*"]}}),
    ]


def code_statements(results: s3.IBucket) -> list[iam.PolicyStatement]:
    """User workloads' packed code (code/<sha256>/sourcedir.tar.gz): a job reads an archive it can name,
    writes none (the client uploads it, once). Listing only with the whole key of an archive as the prefix
    (SageMaker lists a channel's prefix before it downloads): no job enumerates code/ to find other users'
    archives; one whose SHA-256 it knows it can read (a name of 256 bits, which only the run's spec and
    DescribeTrainingJob show). A host refuses an archive whose SHA-256 is not its run's."""
    return [
        iam.PolicyStatement(actions=["s3:GetObject"], resources=[results.arn_for_objects(f"{CODE_PREFIX}*/{CODE_ARCHIVE}")]),
        iam.PolicyStatement(actions=["s3:ListBucket"], resources=[results.bucket_arn],
                            conditions={"StringLike": {"s3:prefix": [f"{CODE_PREFIX}*/{CODE_ARCHIVE}"]}}),
    ]
