"""The IAM permissions of `hetero run --direct` (hetero/direct.py) as a managed policy to attach to a
notebook's or a user's role: one training job of the platform without the state machine.

The client's checks (the spec's rules, the deployment's bucket allow-list and cost ceiling) run on the
caller's machine; what the account enforces is this policy. It holds a direct job to what IAM can say of
a CreateTrainingJob: the platform's job names, the instance types the deployment prices, SageMaker's longest runtime
the platform accepts, encrypted traffic between hosts, the platform's tags, and in VPC mode the
platform's subnets and security group; the role passed is the platform's SageMaker role, to SageMaker
only. Stop is held to direct jobs (tagged with a run id and no execution).

What IAM cannot say: an instance count (the cost ceiling stays the client's), and the image, command,
environment and S3 locations of a job. Whoever holds this policy can run code of their choosing as the
platform's SageMaker role: read the input buckets and, its job's session carrying no session tags, the
results bucket's direct.runs/ prefixes only (infra/constructs/execution_role.py), never a state-machine
run's. A caller whose own session carries any of a job's session-tag keys is denied CreateTrainingJob: it
could chain them into its job and reach that run's prefixes. Attach it only to people trusted with that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import acknowledge, arn_token, training_jobs_arn, wildcard_resources
from lambdas.core.job_spec import MAX_RUNTIME_S
from lambdas.core.training_request import SESSION_TAG_KEYS

# SageMaker's log group for training jobs (`hetero follow` and `hetero logs` read it).
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# The tags a direct job is created with (lambdas/core/training_request.py and hetero/direct.py): no other,
# so a direct caller cannot tag a job as an execution's (the reconciler's execution_arn).
DIRECT_TAG_KEYS = ["platform", "run_name", "run_id"]


class DirectLaunchPolicy(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, prefix: str, jobs_arn: str, sagemaker_role: iam.IRole,
                 results: s3.IBucket, instance_types: Sequence[str], vpc_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        create_conditions: dict[str, Any] = {
            # Whether SageMaker fills sagemaker:InstanceTypes from ResourceConfig.InstanceGroups is not documented:
            # ForAllValues holds for an empty set, so a heterogeneous job is not refused if it does not (the
            # client's catalog check still holds it); a single-group job's type is bound either way.
            # The types this deployment can price (the fallback table's and cdk.json's ceiling_prices_usd_per_hour),
            # the ones its launch accepts under the cost ceiling: a direct job is one no Lambda checks, and IAM
            # cannot count instances, so a type is the most it can bound.
            "ForAllValues:StringEquals": {"aws:TagKeys": DIRECT_TAG_KEYS, "sagemaker:InstanceTypes": sorted(instance_types)},
            "Null": {"sagemaker:MaxRuntimeInSeconds": "false"},
            "NumericLessThanEquals": {"sagemaker:MaxRuntimeInSeconds": MAX_RUNTIME_S},
            "Bool": {"sagemaker:InterContainerTrafficEncryption": "true"},
            "StringEquals": {"aws:RequestTag/platform": prefix},
        }
        if vpc_config:
            create_conditions["ForAllValues:StringEquals"] |= {"sagemaker:VpcSubnets": list(vpc_config["Subnets"]),
                                                               "sagemaker:VpcSecurityGroupIds": list(vpc_config["SecurityGroupIds"])}
            create_conditions["Null"] |= {"sagemaker:VpcSubnets": "false", "sagemaker:VpcSecurityGroupIds": "false"}
        self.policy = iam.ManagedPolicy(
            self, "Policy",
            description=f"hetero run --direct: one training job of the {prefix} platform without its state machine",
            statements=[
                iam.PolicyStatement(sid="CreatePlatformJobs", actions=["sagemaker:CreateTrainingJob"], resources=[jobs_arn],
                                    conditions=create_conditions),
                # A session carrying any of a job's session-tag keys could chain them into its job (SessionChainingConfig:
                # no condition key says whether a request asks for it) and reach that run's prefixes: denied, key by key.
                *(iam.PolicyStatement(sid=f"NoJobsFromSessionsTagged{key.title().replace('_', '')}", effect=iam.Effect.DENY,
                                      actions=["sagemaker:CreateTrainingJob"], resources=[jobs_arn],
                                      conditions={"Null": {f"aws:PrincipalTag/{key}": "false"}})
                  for key in SESSION_TAG_KEYS),
                # CreateTrainingJob with Tags needs AddTags too; held to the tags a direct job carries.
                iam.PolicyStatement(sid="TagPlatformJobs", actions=["sagemaker:AddTags"], resources=[jobs_arn],
                                    conditions={"ForAllValues:StringEquals": {"aws:TagKeys": DIRECT_TAG_KEYS},
                                                "StringEquals": {"aws:RequestTag/platform": prefix}}),
                iam.PolicyStatement(sid="FollowPlatformJobs", resources=[jobs_arn], actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"]),
                # Stop only direct jobs: tagged with a run id, not with an execution (a state-machine run's).
                iam.PolicyStatement(sid="StopDirectJobs", resources=[jobs_arn], actions=["sagemaker:StopTrainingJob"],
                                    conditions={"Null": {"aws:ResourceTag/run_id": "false", "aws:ResourceTag/execution_arn": "true"}}),
                iam.PolicyStatement(sid="PassTheSageMakerRole", actions=["iam:PassRole"], resources=[sagemaker_role.role_arn],
                                    conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}),
                # The run's shutdown token, written once (a conditional write: If-None-Match) under
                # control/direct.runs/<run id>/, and taken back if SageMaker refuses the job.
                iam.PolicyStatement(sid="WriteDirectRunTokensOnce", actions=["s3:PutObject"],
                                    resources=[results.arn_for_objects("control/direct.runs/*")],
                                    conditions={"Null": {"s3:if-none-match": "false"}}),
                iam.PolicyStatement(sid="TakeBackDirectRunTokens", actions=["s3:DeleteObject"],
                                    resources=[results.arn_for_objects("control/direct.runs/*")]),
                # A user workload's packed code (code/<sha256>/sourcedir.tar.gz): looked for (HeadObject needs
                # GetObject), and written once when it is not there yet.
                iam.PolicyStatement(sid="ReadWorkloadCode", actions=["s3:GetObject"], resources=[results.arn_for_objects("code/*")]),
                iam.PolicyStatement(sid="WriteWorkloadCodeOnce", actions=["s3:PutObject"], resources=[results.arn_for_objects("code/*")],
                                    conditions={"Null": {"s3:if-none-match": "false"}}),
                # Whether a run id has checkpoints (and resume_from's run), and whether a job left output.tar.gz.
                iam.PolicyStatement(sid="ListCheckpointsAndOutputs", actions=["s3:ListBucket"], resources=[results.bucket_arn],
                                    # code/*: whether a workload's archive is there answers 404 when it is not, not 403
                                    conditions={"StringLike": {"s3:prefix": ["checkpoints/*", "artifacts/*", "code/*"]}}),
                iam.PolicyStatement(sid="ReadJobOutputs", actions=["s3:GetObject"], resources=[results.arn_for_objects("artifacts/*")]),
                iam.PolicyStatement(sid="FindThePlatform", actions=["cloudformation:DescribeStacks"],
                                    resources=[stack.format_arn(service="cloudformation", resource="stack",
                                                                resource_name=f"{stack.stack_name}/*")]),
                iam.PolicyStatement(sid="ReadJobLogs", actions=["logs:FilterLogEvents"],
                                    resources=[stack.format_arn(service="logs", resource="log-group",
                                                                resource_name=f"{TRAINING_LOG_GROUP}:*",
                                                                arn_format=ArnFormat.COLON_RESOURCE_NAME)]),
            ],
        )
        acknowledge(
            self.policy,
            "Direct jobs are held to the platform's job-name prefix (and by conditions to its instance types, runtime, "
            "encryption and tags); tokens to control/direct.runs/, outputs to artifacts/; workload code to code/, written once "
            "(named by its SHA-256); the stack by its name; SageMaker's training log group, whose streams are named by job.",
            *wildcard_resources(
                training_jobs_arn(stack, prefix), f"{arn_token(results)}/control/direct.runs/*", f"{arn_token(results)}/artifacts/*",
                f"{arn_token(results)}/code/*",
                f"arn:<AWS::Partition>:cloudformation:{stack.region}:<AWS::AccountId>:stack/{stack.stack_name}/*",
                f"arn:<AWS::Partition>:logs:{stack.region}:<AWS::AccountId>:log-group:{TRAINING_LOG_GROUP}:*",
            ),
        )
