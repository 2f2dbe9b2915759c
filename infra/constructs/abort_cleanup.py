"""Stops the training job of a run whose execution was aborted, timed out or failed outside the state
machine's own cleanup: Step Functions runs no state on abort, so an EventBridge rule on the execution's
status change invokes the stop function, with retries and a dead-letter queue."""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from infra.nag import acknowledge

END_STATES = ["ABORTED", "TIMED_OUT", "FAILED"]


class AbortCleanup(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, state_machine: sfn.IStateMachine, stop: lambda_.IFunction) -> None:
        super().__init__(scope, construct_id)
        self.dead_letters = sqs.Queue(
            self, "DeadLetters", encryption=sqs.QueueEncryption.SQS_MANAGED, enforce_ssl=True, retention_period=Duration.days(14)
        )
        acknowledge(self.dead_letters, "This queue is itself the dead-letter queue of the cleanup rule.", "SQS3")
        self.rule = events.Rule(
            self,
            "Rule",
            description="Stop the training job of a run whose execution ended without its own cleanup",
            event_pattern=events.EventPattern(
                source=["aws.states"],
                detail_type=["Step Functions Execution Status Change"],
                detail={"status": END_STATES, "stateMachineArn": [state_machine.state_machine_arn]},
            ),
            targets=[
                targets.LambdaFunction(stop, dead_letter_queue=self.dead_letters, retry_attempts=8, max_event_age=Duration.hours(6))
            ],
        )
