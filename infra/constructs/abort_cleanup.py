"""Stops the training job of a run whose execution was aborted, timed out or failed outside the state
machine's own cleanup: Step Functions runs no state on abort, so an EventBridge rule on the execution's
status change invokes the stop function, with retries and a dead-letter queue; a stop that fails every
asynchronous retry lands on an on-failure queue. Behind both, a scheduled reconciler stops any platform
job still running whose execution no longer runs. An alarm watches each queue and the reconciler: a
message there, or a reconciler error, is a job that may be billing with no run to show for it."""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_lambda_destinations as destinations
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from infra.nag import SQS_MANAGED_ENCRYPTION, acknowledge, skip_checkov

END_STATES = ["ABORTED", "TIMED_OUT", "FAILED"]


class AbortCleanup(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        state_machine: sfn.IStateMachine,
        stop: lambda_.Function,
        reconcile: lambda_.Function,
        reconcile_every_min: int = 15,
    ) -> None:
        super().__init__(scope, construct_id)
        self.dead_letters = self._queue("DeadLetters", "This queue is itself the dead-letter queue of the cleanup rule.")
        self.failed_stops = self._queue("FailedStops", "This queue is itself the on-failure destination of the stop function.")
        stop.configure_async_invoke(on_failure=destinations.SqsDestination(self.failed_stops), retry_attempts=2,
                                    max_event_age=Duration.hours(6))
        skip_checkov(stop, "Its failed asynchronous invocations (this rule's) go to the FailedStops on-failure destination, "
                           "which keeps the error with the event and raises an alarm; a dead-letter queue would be a second copy.",
                     "CKV_AWS_116")
        skip_checkov(reconcile, "Its one input is the schedule's tick: a failed run is redone by the next one, "
                                f"{reconcile_every_min} minutes later, and every error raises ReconcilerErrorsAlarm; a dead-letter "
                                "queue would hold ticks.", "CKV_AWS_116")
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
        self.reconcile_rule = events.Rule(
            self,
            "Reconcile",
            description="Stop platform jobs still running whose execution no longer runs",
            schedule=events.Schedule.rate(Duration.minutes(reconcile_every_min)),
            targets=[targets.LambdaFunction(reconcile, dead_letter_queue=self.dead_letters, retry_attempts=2)],
        )
        self.alarms = [
            cloudwatch.Alarm(
                self, f"{name}Alarm", metric=queue.metric_approximate_number_of_messages_visible(period=Duration.minutes(5)),
                threshold=1, evaluation_periods=1, comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
                alarm_description=f"A job stop could not be delivered or failed ({name}): check for a job billing without its run",
            )
            for name, queue in (("DeadLetters", self.dead_letters), ("FailedStops", self.failed_stops))
        ]
        self.alarms.append(
            cloudwatch.Alarm(
                self, "ReconcilerErrorsAlarm", metric=reconcile.metric_errors(period=Duration.minutes(15)),
                threshold=1, evaluation_periods=1, comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
                alarm_description="The job reconciler failed: orphaned jobs may be running",
            )
        )

    def _queue(self, name: str, why: str) -> sqs.Queue:
        queue = sqs.Queue(self, name, encryption=sqs.QueueEncryption.SQS_MANAGED, enforce_ssl=True, retention_period=Duration.days(14))
        acknowledge(queue, why, "SQS3")
        skip_checkov(queue, SQS_MANAGED_ENCRYPTION, "CKV_AWS_27")
        return queue
