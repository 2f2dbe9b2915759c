"""The benchmark sweep in the synthesized platform: its state machine graph, the schedule from cdk
context (target, input, retries, dead letters; off unless enabled), the dashboard and the alarm, and the
least-privilege rules around them (cdk-nag clean with a schedule too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from app import build_app
from infra.config import PlatformConfig, PlatformConfigError
from lambdas.core.sweep import METRIC_NAMESPACE, SweepSpecError
from tests.infra.conftest import state_machine_definition, state_machine_logical_id

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SWEEP_INPUT = {
    "sweep_name": "resnet-weekly",
    "base": json.loads((EXAMPLES / "tensorflow-heterogeneous.json").read_text()),
    "data_hosts": [0, 1, 2, 4],
    "step_time_target_ms": 150,
}
SCHEDULE = {"expression": "cron(0 6 ? * MON *)", "input": SWEEP_INPUT, "enabled": True}


def resources(template_json: dict[str, Any], kind: str) -> dict[str, Any]:
    return {key: value for key, value in template_json["Resources"].items() if value["Type"] == kind}


@pytest.fixture(scope="module")
def scheduled() -> dict[str, Any]:
    """The platform synthesized with a weekly sweep enabled (cdk-nag runs as part of synthesis)."""
    app, stack = build_app(context={"platform": {"sweep_schedule": SCHEDULE, "sweep_max_concurrency": 3, "input_buckets": ["team-datasets"]}})
    app.synth()
    return Template.from_stack(stack).to_json()


def test_the_sweep_graph_runs_each_configuration_as_a_training_run(template_json) -> None:
    definition = state_machine_definition(template_json, construct="BenchmarkSweep")
    states = definition["States"]
    assert definition["StartAt"] == "Plan sweep"
    assert states["Plan sweep"]["Catch"] == [{"ErrorEquals": ["SweepSpecError"], "ResultPath": "$.error", "Next": "InvalidSweep"}]
    runs = states["Run configurations"]
    assert runs["Type"] == "Map" and runs["ItemsPath"] == "$.sweep.configurations" and runs["MaxConcurrency"] == 2
    item = runs["ItemProcessor"]["States"]["Run configuration"]
    assert item["Resource"].endswith(":states:::states:startExecution.sync:2")
    assert item["Parameters"]["StateMachineArn"] == f"<{state_machine_logical_id(template_json)}>"
    assert item["Parameters"]["Input.$"] == "$.spec" and item["Parameters"]["Name.$"] == "$.execution_name"
    assert "AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID.$" not in json.dumps(item["Parameters"])  # the spec stays bare
    assert item["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Configuration failed"}]
    assert runs["Next"] == "Compare" and states["Compare"]["Next"] == "Done"


def test_without_a_configured_schedule_there_is_none(template_json) -> None:
    rules = resources(template_json, "AWS::Events::Rule")
    sweep_rules = [rule for logical_id, rule in rules.items() if not logical_id.startswith("AbortCleanupReconcile")]
    assert all("ScheduleExpression" not in rule["Properties"] for rule in sweep_rules)  # the reconciler's is its own


def test_the_schedule_starts_the_sweep_with_its_input_retries_and_dead_letters(scheduled) -> None:
    (rule,) = [rule for logical_id, rule in resources(scheduled, "AWS::Events::Rule").items()
               if "ScheduleExpression" in rule["Properties"] and not logical_id.startswith("AbortCleanupReconcile")]
    assert rule["Properties"]["ScheduleExpression"] == "cron(0 6 ? * MON *)" and rule["Properties"]["State"] == "ENABLED"
    (target,) = rule["Properties"]["Targets"]
    assert target["Arn"] == {"Ref": state_machine_logical_id(scheduled, "BenchmarkSweep")}
    assert json.loads(target["Input"]) == SWEEP_INPUT
    assert target["RetryPolicy"] == {"MaximumEventAgeInSeconds": 7200, "MaximumRetryAttempts": 4}
    queue = target["DeadLetterConfig"]["Arn"]["Fn::GetAtt"][0]
    assert scheduled["Resources"][queue]["Type"] == "AWS::SQS::Queue"
    definition = state_machine_definition(scheduled, construct="BenchmarkSweep")
    assert definition["States"]["Run configurations"]["MaxConcurrency"] == 3


def test_a_schedule_is_off_unless_enabled_and_a_bad_input_fails_synthesis() -> None:
    app, stack = build_app(context={"platform": {"sweep_schedule": SCHEDULE | {"enabled": False}}})
    (rule,) = [r for logical_id, r in resources(Template.from_stack(stack).to_json(), "AWS::Events::Rule").items()
               if "ScheduleExpression" in r["Properties"] and not logical_id.startswith("AbortCleanupReconcile")]
    assert rule["Properties"]["State"] == "DISABLED"
    with pytest.raises(SweepSpecError, match="data_hosts"):
        build_app(context={"platform": {"sweep_schedule": SCHEDULE | {"input": SWEEP_INPUT | {"data_hosts": []}}}})
    with pytest.raises(SweepSpecError, match="above the sweep ceiling of \\$10.00"):
        build_app(context={"platform": {"sweep_schedule": SCHEDULE, "sweep_cost_ceiling_usd": 10}})
    with pytest.raises(PlatformConfigError, match="sweep_schedule takes 'expression', 'input' and 'enabled'"):
        PlatformConfig(sweep_schedule={"expression": SCHEDULE["expression"]})  # refused before any construct is made
    with pytest.raises(PlatformConfigError, match="enabled must be true or false"):
        PlatformConfig(sweep_schedule=SCHEDULE | {"enabled": "false"})  # a string would read as on


def test_allowed_input_buckets_are_the_ones_jobs_can_read(scheduled) -> None:
    """cdk.json's input_buckets join the datasets bucket: on the functions' allow-list and in the
    SageMaker role's read access, and nowhere else."""
    (function,) = [r for key, r in resources(scheduled, "AWS::Lambda::Function").items() if key.startswith("TrainingRunFunctionsValidateSpec")]
    allowed = json.dumps(function["Properties"]["Environment"]["Variables"]["INPUT_BUCKETS"])
    assert "team-datasets" in allowed and "BucketsDatasets" in allowed
    (role_policy,) = [r for key, r in resources(scheduled, "AWS::IAM::Policy").items() if key.startswith("SageMakerExecutionRoleDefaultPolicy")]
    reads = json.dumps([s["Resource"] for s in role_policy["Properties"]["PolicyDocument"]["Statement"] if "s3:GetObject*" in s["Action"]])
    assert ":s3:::team-datasets/*" in reads and "BucketsDatasets" in reads


def test_the_dashboard_and_the_alarm(scheduled) -> None:
    (dashboard,) = resources(scheduled, "AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for metric in ("BilledMsPerStep", "CostPer1kStepsUsd", "FailedConfigurations"):
        assert metric in body
    assert METRIC_NAMESPACE in body
    (alarm,) = [alarm for logical_id, alarm in resources(scheduled, "AWS::CloudWatch::Alarm").items() if logical_id.startswith("BenchmarkSweepFailedSweeps")]
    properties = alarm["Properties"]
    # Failed, timed out or aborted: each ends a sweep without its report.
    metrics = {m["MetricStat"]["Metric"]["MetricName"]: m["MetricStat"]["Metric"] for m in properties["Metrics"] if "MetricStat" in m}
    assert set(metrics) == {"ExecutionsFailed", "ExecutionsTimedOut", "ExecutionsAborted"}
    for metric in metrics.values():
        assert metric["Namespace"] == "AWS/States"
        assert metric["Dimensions"] == [{"Name": "StateMachineArn", "Value": {"Ref": state_machine_logical_id(scheduled, "BenchmarkSweep")}}]
    assert properties["Threshold"] == 1 and properties["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    # A schedule that could not start its sweep (events in the dead-letter queue) raises one too.
    (unstarted,) = [alarm for logical_id, alarm in resources(scheduled, "AWS::CloudWatch::Alarm").items()
                    if logical_id.startswith("BenchmarkSweepUnstartedSweeps")]
    assert unstarted["Properties"]["MetricName"] == "ApproximateNumberOfMessagesVisible" and unstarted["Properties"]["AlarmActions"]


def test_the_compare_function_may_price_and_publish_only_where_it_must(template_json) -> None:
    (compare,) = [key for key, r in resources(template_json, "AWS::Lambda::Function").items()
                  if r["Properties"]["Handler"] == "lambdas.compare_sweep.handler.handler"]
    role = template_json["Resources"][compare]["Properties"]["Role"]["Fn::GetAtt"][0]
    statements = [s for p in resources(template_json, "AWS::IAM::Policy").values()
                  if {"Ref": role} in p["Properties"]["Roles"] for s in p["Properties"]["PolicyDocument"]["Statement"]]
    (metrics,) = [s for s in statements if s["Action"] == "cloudwatch:PutMetricData"]
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}}
    assert any(s["Action"] == "pricing:GetProducts" for s in statements)
    writes = json.dumps([s for s in statements if "s3:PutObject" in json.dumps(s["Action"])])
    assert "/benchmarks/*" in writes and "/prices/*" in writes and "/results/*" not in writes  # results are only read
