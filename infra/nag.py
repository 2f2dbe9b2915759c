"""Scanner acknowledgments, each on the one resource it concerns, with the reason it is safe, so that a new
finding fails: cdk-nag's (AwsSolutions pack) at synthesis, checkov's and cfn-lint's in the tests
(tests/infra/test_template_scanners.py).

cdk-nag 3 reports each wildcard as its own finding, ``AwsSolutions-IAM5[Resource::<arn>]`` or
``[Action::<action>]``; we acknowledge findings one by one. checkov reads its skips from the resource's
CloudFormation metadata (``Metadata.checkov.skip``: id and comment). cfn-lint's few ignored rules are
CFN_LINT_IGNORED, template-wide, each with its reason."""

from __future__ import annotations

from aws_cdk import Acknowledgment, CfnResource, Stack, Validations
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


def skip_checkov(construct: IConstruct, reason: str, *check_ids: str) -> None:
    """Acknowledge checkov checks on ``construct``'s CloudFormation resource (its default child), adding to
    the skips it has."""
    resource = construct if isinstance(construct, CfnResource) else construct.node.default_child
    skips = [*(resource.get_metadata("checkov") or {}).get("skip", []), *({"id": check, "comment": reason} for check in check_ids)]
    resource.add_metadata("checkov", {"skip": skips})


# checkov's CKV_AWS_27 reads only KmsMasterKeyId, not SqsManagedSseEnabled.
SQS_MANAGED_ENCRYPTION = ("Encrypted at rest with SQS-managed keys (SqsManagedSseEnabled), which CKV_AWS_27 does not read; a KMS "
                          "key would have to let EventBridge use it for dead-letter delivery, and the messages are events and "
                          "error records, no data.")


# cfn-lint rules the templates are not checked against, and why.
CFN_LINT_IGNORED = {
    # CDK puts a role (and its default policy) in the DependsOn of what uses the role, besides the GetAtt
    # of its ARN: the policy must exist before the function or state machine first runs. Redundant for
    # the role, needed for its policy, and CDK's to write.
    "W3005": "CDK's DependsOn on a role next to the GetAtt of its ARN (it needs the same for the role's policy)",
}
