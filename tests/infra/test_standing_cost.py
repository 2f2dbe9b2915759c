"""What the stack costs idle, counted from the synthesized template: the deploying guide's table and the
README's figure are what infra/standing_cost.py computes from the stack as it is now."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from infra.standing_cost import render, scheduled_invocations_per_month, standing_cost

ROOT = Path(__file__).resolve().parents[2]


def test_the_guides_table_and_the_readmes_figure_are_the_stacks_own(template_json: dict[str, Any]) -> None:
    items = standing_cost(template_json)
    guide = (ROOT / "docs" / "guides" / "deploying.md").read_text()
    (block,) = re.findall(r"<!-- standing-cost -->\n(.*?)<!-- /standing-cost -->", guide, re.S)
    assert block == render(items), "run `.venv/bin/python -m infra.standing_cost` and paste its table into docs/guides/deploying.md"
    total = sum(item.usd_per_month for item in items)
    assert f"about **${total:.2f} a month**" in (ROOT / "README.md").read_text()
    counts = {item.resource: item.count for item in items}
    assert counts["KMS customer-managed keys"] >= 1 and counts["CloudWatch dashboard"] == 1


def test_an_alarm_bills_per_metric_and_a_rate_schedule_per_invocation() -> None:
    template = {"Resources": {
        "Key": {"Type": "AWS::KMS::Key", "Properties": {}},
        "Math": {"Type": "AWS::CloudWatch::Alarm", "Properties": {"Metrics": [{"Id": "a", "MetricStat": {}}, {"Id": "b", "MetricStat": {}},
                                                                               {"Id": "e", "Expression": "a+b"}]}},
        "Plain": {"Type": "AWS::CloudWatch::Alarm", "Properties": {"MetricName": "Errors"}},
        "Fn": {"Type": "AWS::Lambda::Function", "Properties": {"MemorySize": 1024}},
        "Tick": {"Type": "AWS::Events::Rule", "Properties": {"ScheduleExpression": "rate(15 minutes)",
                                                              "Targets": [{"Arn": {"Fn::GetAtt": ["Fn", "Arn"]}}]}},
        "Off": {"Type": "AWS::Events::Rule", "Properties": {"ScheduleExpression": "rate(1 minute)", "State": "DISABLED",
                                                             "Targets": [{"Arn": {"Fn::GetAtt": ["Fn", "Arn"]}}]}},
    }}
    items = {item.resource: item for item in standing_cost(template)}
    assert items["CloudWatch alarms"].count == 2 and round(items["CloudWatch alarms"].usd_per_month, 2) == 0.30
    assert items["scheduled Lambda invocations"].count == 2920 and items["KMS customer-managed keys"].usd_per_month == 1.0
    assert scheduled_invocations_per_month("rate(1 hour)") == 730 and scheduled_invocations_per_month("rate(2 days)") == 730 / 48
