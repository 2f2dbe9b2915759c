"""Where the platform's alarms go: one SNS topic, encrypted with a key CloudWatch may use, that every
alarm of the stack notifies (a lost job stop, a failed reconciler, a failed or unstarted sweep). Give
cdk.json's ``alarm_email`` to be told by mail; subscribe anything else to the topic (stack output
``AlarmTopic``). An alarm nobody hears is only a red light on a dashboard nobody opens."""

from __future__ import annotations

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct, IConstruct


class AlarmTopic(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, email: str | None) -> None:
        super().__init__(scope, construct_id)
        # CloudWatch cannot publish to a topic under the AWS-managed aws/sns key (its policy does not let
        # CloudWatch use it): a key of our own, rotated, that CloudWatch may use.
        stack = Stack.of(self)
        # Only this account's alarms (no confused deputy: another account's CloudWatch cannot use these).
        from_our_alarms = {
            "StringEquals": {"aws:SourceAccount": stack.account},
            "ArnLike": {"aws:SourceArn": stack.format_arn(service="cloudwatch", resource="alarm", resource_name="*",
                                                          arn_format=ArnFormat.COLON_RESOURCE_NAME)},
        }
        key = kms.Key(self, "Key", enable_key_rotation=True, description="Encrypts the platform's alarm topic",
                      removal_policy=RemovalPolicy.DESTROY)
        key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey*"], principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            resources=["*"], conditions=from_our_alarms,  # "*" in a key policy is this key
        ))
        self.topic = sns.Topic(self, "Topic", master_key=key, enforce_ssl=True, display_name="Training platform alarms")
        # A topic policy replaces SNS's default one (which let this account's services publish): CloudWatch
        # must be allowed explicitly, or no alarm is ever delivered.
        self.topic.add_to_resource_policy(iam.PolicyStatement(
            actions=["sns:Publish"], principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            resources=[self.topic.topic_arn], conditions=from_our_alarms,
        ))
        if email:
            self.topic.add_subscription(subscriptions.EmailSubscription(email))

    def notify_from_every_alarm_in(self, scope: IConstruct) -> int:
        """Add the topic as the alarm action of every alarm under ``scope``; returns how many."""
        alarms = [node for node in scope.node.find_all() if isinstance(node, cloudwatch.Alarm)]
        for alarm in alarms:
            alarm.add_alarm_action(actions.SnsAction(self.topic))
        return len(alarms)
