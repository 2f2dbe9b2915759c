"""One KMS key, rotated, for every CloudWatch log group of the stack: the functions', the state machines'
(which log execution data: job specs, hyperparameters) and, in VPC mode, the flow logs. CloudWatch Logs
uses the key on the writers' and readers' behalf (its key policy lets this region's CloudWatch Logs use
it for this account's log groups only), so no role needs a KMS permission of its own, and who may read
the logs is held by the key policy as well as by IAM."""

from __future__ import annotations

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct, IConstruct


class LogEncryption(Construct):
    def __init__(self, scope: Construct, construct_id: str) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.key = kms.Key(self, "Key", enable_key_rotation=True, description="Encrypts the platform's CloudWatch log groups",
                           removal_policy=RemovalPolicy.DESTROY)
        # CloudWatch Logs' documented key policy ("Encrypt log data in CloudWatch Logs using AWS KMS"), held by
        # the encryption context to this account's log groups in the stack's region ("*" in a key policy is this key).
        self.key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
            principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
            resources=["*"],
            conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn": stack.format_arn(
                service="logs", resource="log-group", resource_name="*", arn_format=ArnFormat.COLON_RESOURCE_NAME)}},
        ))

    def encrypt_every_log_group_in(self, scope: IConstruct) -> int:
        """Set this key on every log group under ``scope`` that has none; returns how many."""
        groups = [node for node in scope.node.find_all() if isinstance(node, logs.CfnLogGroup) and node.kms_key_id is None]
        for group in groups:
            group.kms_key_id = self.key.key_arn
        return len(groups)
