"""The "benchmark sweep" state machine, its optional schedule, a dashboard and an alarm.

    Plan sweep ──SweepSpecError──▶ Fail "InvalidSweep"            (nothing launched)
    Map over configurations (at most max_concurrency at a time):
        Run configuration: a nested "training run" execution named <sweep id>-<index>, waited for
            ├─ succeeded ▶ Configuration succeeded
            └─ any error ▶ Configuration failed (recorded; the sweep goes on)
    Compare ▶ benchmarks/<sweep id>/{report.json, report.md, chart.png}, CloudWatch metrics ▶ Succeed

Each configuration runs through the training-run state machine itself (validation, launch retries,
polling, runtime bound, cleanup, result.json): one logic for single runs and sweeps, and aborting a sweep
stops its child executions, whose jobs the abort cleanup stops. The schedule (EventBridge, from cdk
context, created only when configured and enabled only when asked) starts the sweep with a fixed input,
retried, with a dead-letter queue. The dashboard shows step time and cost per 1k steps per configuration
and failures; the alarm fires on a failed sweep execution.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from infra.constructs.functions import TrainingRunFunctions, retention
from infra.constructs.training_workflow import retry_unless_final
from infra.nag import SQS_MANAGED_ENCRYPTION, acknowledge, arn_token, skip_checkov, wildcard_resources
from lambdas.core.sweep import METRIC_NAMESPACE


class BenchmarkSweep(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        prefix: str,
        functions: TrainingRunFunctions,
        training_run: sfn.StateMachine,
        max_concurrency: int,
        timeout_h: int,
        log_retention_days: int,
        schedule: Mapping[str, Any] | None,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        plan = tasks.LambdaInvoke(
            self, "Plan sweep", lambda_function=functions.plan_sweep, payload_response_only=True, result_path="$.sweep",
            payload=sfn.TaskInput.from_object({"input": sfn.JsonPath.object_at("$$.Execution.Input"),
                                               "execution_name": sfn.JsonPath.string_at("$$.Execution.Name")}),
        )
        plan.add_catch(sfn.Fail(self, "InvalidSweep", error="InvalidSweep", cause_path="$.error.Cause"),
                       errors=["SweepSpecError"], result_path="$.error")

        item = {"index": sfn.JsonPath.number_at("$.index"), "name": sfn.JsonPath.string_at("$.name"),
                "execution_name": sfn.JsonPath.string_at("$.execution_name")}
        run = tasks.StepFunctionsStartExecution(
            self, "Run configuration", state_machine=training_run,
            integration_pattern=sfn.IntegrationPattern.RUN_JOB,
            input=sfn.TaskInput.from_json_path_at("$.spec"),
            name=sfn.JsonPath.string_at("$.execution_name"),
            # The child's input must stay the bare job spec (the training run validates it strictly).
            associate_with_parent=False,
            result_selector={"status": sfn.JsonPath.string_at("$.Status")},
            result_path="$.run",
        )
        succeeded = sfn.Pass(self, "Configuration succeeded", parameters=item | {"status": "SUCCEEDED"})
        failed = sfn.Pass(
            self, "Configuration failed",
            parameters=item | {"status": "FAILED", "error": sfn.JsonPath.string_at("$.error.Error"),
                               "cause": sfn.JsonPath.string_at("$.error.Cause")},
        )
        run.add_catch(failed, errors=["States.ALL"], result_path="$.error")
        configurations = sfn.Map(
            self, "Run configurations", items_path="$.sweep.configurations", max_concurrency=max_concurrency,
            result_path="$.outcomes",
        )
        configurations.item_processor(run.next(succeeded))
        compare = tasks.LambdaInvoke(
            self, "Compare", lambda_function=functions.compare_sweep, payload_response_only=True, result_path="$.report",
            payload=sfn.TaskInput.from_object({"sweep": sfn.JsonPath.object_at("$.sweep"), "outcomes": sfn.JsonPath.object_at("$.outcomes")}),
        )
        # A retried compare finds the report whole (report.json, written last) or writes what is missing:
        # one transient error must not lose a sweep whose configurations were all paid for.
        retry_unless_final(compare)
        definition = plan.next(configurations).next(compare).next(sfn.Succeed(self, "Done"))
        self.log_group = logs.LogGroup(self, "Logs", retention=retention(log_retention_days), removal_policy=RemovalPolicy.DESTROY)
        self.state_machine = sfn.StateMachine(
            self, "StateMachine", state_machine_name=f"{prefix}-benchmark-sweep",
            definition_body=sfn.DefinitionBody.from_chainable(definition), timeout=Duration.hours(timeout_h), tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        # Executions of the training-run state machine, as CDK builds the pattern (its name from its ARN).
        machine = stack.get_logical_id(training_run.node.default_child)
        child_executions = (
            f"arn:<AWS::Partition>:states:{stack.region}:<AWS::AccountId>:execution:"
            f'{{"Fn::Select":[6,{{"Fn::Split":[":",{{"Ref":"{machine}"}}]}}]}}*'
        )
        acknowledge(
            self.state_machine.role,
            "Invoking each function includes its versions (<arn>:*); the sweep describes and stops only executions of "
            "the platform's training-run state machine; log delivery and X-Ray actions take no resource ARN.",
            *wildcard_resources("*", child_executions, *(f"{arn_token(fn)}:*" for fn in functions.sweep)),
        )
        self.schedule_rule = self._schedule(schedule) if schedule else None
        self.alarm = cloudwatch.Alarm(
            self, "FailedSweeps", alarm_description="A benchmark sweep execution failed, timed out or was aborted",
            metric=cloudwatch.MathExpression(
                expression="FILL(failed, 0) + FILL(timedOut, 0) + FILL(aborted, 0)", period=Duration.hours(1), label="Sweeps ended badly",
                using_metrics={"failed": self.state_machine.metric_failed(statistic="Sum"),
                               "timedOut": self.state_machine.metric_timed_out(statistic="Sum"),
                               "aborted": self.state_machine.metric_aborted(statistic="Sum")},
            ),
            threshold=1, evaluation_periods=1, comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        self.dashboard = self._dashboard(prefix)

    def _schedule(self, schedule: Mapping[str, Any]) -> events.Rule:
        # Its keys and input were checked with the platform's settings (infra/config.py).
        self.dead_letters = sqs.Queue(
            self, "ScheduleDeadLetters", encryption=sqs.QueueEncryption.SQS_MANAGED, enforce_ssl=True, retention_period=Duration.days(14)
        )
        acknowledge(self.dead_letters, "This queue is itself the dead-letter queue of the sweep schedule.", "SQS3")
        skip_checkov(self.dead_letters, SQS_MANAGED_ENCRYPTION, "CKV_AWS_27")
        # A scheduled sweep that could not be started (after the rule's retries) is a missed week.
        self.schedule_alarm = cloudwatch.Alarm(
            self, "UnstartedSweeps", alarm_description="The sweep schedule could not start a sweep: see the ScheduleDeadLetters queue",
            metric=self.dead_letters.metric_approximate_number_of_messages_visible(period=Duration.minutes(5)),
            threshold=1, evaluation_periods=1, comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        return events.Rule(
            self, "Schedule", description="Start the benchmark sweep on a schedule",
            schedule=events.Schedule.expression(schedule["expression"]),
            enabled=bool(schedule.get("enabled", False)),
            targets=[targets.SfnStateMachine(
                self.state_machine, input=events.RuleTargetInput.from_object(dict(schedule["input"])),
                dead_letter_queue=self.dead_letters, retry_attempts=4, max_event_age=Duration.hours(2),
            )],
        )

    def _dashboard(self, prefix: str) -> cloudwatch.Dashboard:
        def search(metric: str, label: str) -> cloudwatch.MathExpression:
            return cloudwatch.MathExpression(
                expression=f"SEARCH('{{{METRIC_NAMESPACE},Sweep,Configuration}} MetricName=\"{metric}\"', 'Average', 86400)",
                label=label, period=Duration.days(1),
            )

        dashboard = cloudwatch.Dashboard(self, "Dashboard", dashboard_name=f"{prefix}-benchmarks")
        dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Billed ms per step per configuration (evaluation and checkpoints included)", left=[search("BilledMsPerStep", "")], width=12),
            cloudwatch.GraphWidget(title="Cost per 1k steps per configuration ($)", left=[search("CostPer1kStepsUsd", "")], width=12),
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Failed configurations per sweep",
                left=[cloudwatch.MathExpression(
                    expression=f"SEARCH('{{{METRIC_NAMESPACE},Sweep}} MetricName=\"FailedConfigurations\"', 'Sum', 86400)",
                    label="", period=Duration.days(1),
                )],
                width=12,
            ),
            cloudwatch.AlarmWidget(title="Failed sweeps", alarm=self.alarm, width=12),
        )
        return dashboard

