"""cdk-nag (AwsSolutions pack) acknowledgments. cdk-nag 3 reports each wildcard as its own finding,
``AwsSolutions-IAM5[Resource::<arn>]`` or ``[Action::<action>]``; we acknowledge findings one by one, on
the one construct they concern, with the reason they are safe, so that a new wildcard fails synth."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Stack, Validations
from constructs import IConstruct

PACK = "AwsSolutions"
# What grant_read/grant_read_write add: S3 action families, each held to the resources granted.
S3_READ_ACTIONS = ("s3:GetObject*", "s3:GetBucket*", "s3:List*")
S3_WRITE_ACTIONS = ("s3:DeleteObject*", "s3:Abort*")


def acknowledge(construct: IConstruct, reason: str, *findings: str) -> None:
    for finding in findings:
        Validations.of(construct).acknowledge(Acknowledgment(id=f"{PACK}::{PACK}-{finding}", reason=reason))


def wildcard_actions(*actions: str) -> list[str]:
    return [f"IAM5[Action::{action}]" for action in actions]


def wildcard_resources(*resources: str) -> list[str]:
    return [f"IAM5[Resource::{resource}]" for resource in resources]


def arn_token(construct: IConstruct) -> str:
    """How cdk-nag spells a resource's ARN in a finding: <LogicalId.Arn> for a resource of the stack; an
    imported bucket (no resource of ours) is spelled as its ARN."""
    if construct.node.default_child is None and hasattr(construct, "bucket_name"):
        return f"arn:<AWS::Partition>:s3:::{construct.bucket_name}"
    return f"<{Stack.of(construct).get_logical_id(construct.node.default_child)}.Arn>"


def training_jobs_arn(stack: Stack, prefix: str) -> str:
    return f"arn:<AWS::Partition>:sagemaker:{stack.region}:<AWS::AccountId>:training-job/{prefix}-*"
