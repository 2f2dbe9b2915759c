"""What the deployed stack costs a month while no run is going: itemised from the synthesized template.

    .venv/bin/python -m infra.standing_cost     # synthesizes the stack, prints the table the deploying guide holds

Only what bills by the month whatever runs is counted: customer-managed KMS keys (at their steady state,
after the two rotations that add to a key's price), the dashboard, the alarms, the reconciler's schedule,
and the training images' ECR storage (an estimate: their size is known only once built). Buckets, queues,
state machines, Lambda functions, rules and log groups bill by use (storage, requests, transitions,
invocations, ingestion) and cost nothing when idle. Prices are AWS's public list prices for us-east-1 at PRICE_DATE, before any free tier (an
account's first 10 alarms and 3 dashboards are free): check them in the AWS Pricing Calculator.

``standing_cost`` is pure (a template's JSON in, items out); ``main`` synthesizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PRICE_DATE = "2026-12-01"
PRICE_SOURCE = "AWS public list prices, us-east-1"
KMS_KEY_MONTH = 1.00  # a customer-managed key
# Each automatic (yearly) rotation adds $1 a month for a key's first two rotations, and those stay: $3 from
# the third year on.
KMS_ROTATIONS_BILLED = 2
DASHBOARD_MONTH = 3.00
STANDARD_ALARM_MONTH = 0.10  # per metric an alarm evaluates at standard resolution
LAMBDA_REQUEST = 0.20 / 1_000_000
LAMBDA_GB_SECOND = 0.0000166667
ECR_GB_MONTH = 0.10
# The three training images as ECR stores them (compressed layers), most of it the Deep Learning Container
# bases: an estimate, to be read off `aws ecr describe-images` once deployed.
IMAGES_GB_ESTIMATE = 20
# They are pushed into the CDK bootstrap's repository (no repository of the stack's own to count in the
# template): one per variant, as infra/constructs/training_images.py builds them.
IMAGES = ("pytorch", "tensorflow", "neuron")
HOURS_PER_MONTH = 730
# What one scheduled invocation of the reconciler uses (it lists a page of jobs and executions): measured
# under moto it returns in well under a second; a second at its memory is the bound counted here.
RECONCILER_SECONDS = 1.0


@dataclass(frozen=True)
class Item:
    resource: str
    count: int
    usd_per_month: float
    why: str


def resources(template: Mapping[str, Any], kind: str) -> list[tuple[str, Mapping[str, Any]]]:
    return [(key, value.get("Properties", {})) for key, value in template["Resources"].items() if value["Type"] == kind]


def metrics_of(alarm: Mapping[str, Any]) -> int:
    """An alarm bills per metric it evaluates: one, or each metric of its math expression."""
    return sum(1 for query in alarm.get("Metrics", []) if "MetricStat" in query) or 1


def scheduled_invocations_per_month(expression: str) -> float:
    """Invocations a month of an EventBridge ``rate(...)`` schedule (a cron is counted as hourly)."""
    if expression.startswith("rate("):
        amount, unit = expression[5:-1].split()
        minutes = {"minute": 1, "minutes": 1, "hour": 60, "hours": 60, "day": 1440, "days": 1440}[unit]
        return HOURS_PER_MONTH * 60 / (int(amount) * minutes)
    return HOURS_PER_MONTH


def scheduled_functions(template: Mapping[str, Any]) -> Iterable[tuple[float, float]]:
    """(invocations a month, memory in GB) of each function a schedule rule calls."""
    functions = dict(resources(template, "AWS::Lambda::Function"))
    for _, rule in resources(template, "AWS::Events::Rule"):
        expression = rule.get("ScheduleExpression")
        if not expression or rule.get("State") == "DISABLED":
            continue
        for target in rule.get("Targets", []):
            arn = target.get("Arn", {})
            name = arn.get("Fn::GetAtt", [None])[0] if isinstance(arn, Mapping) else None
            if name in functions:
                yield scheduled_invocations_per_month(expression), functions[name].get("MemorySize", 128) / 1024


def standing_cost(template: Mapping[str, Any]) -> list[Item]:
    keys = resources(template, "AWS::KMS::Key")
    rotating = sum(1 for _, key in keys if key.get("EnableKeyRotation"))
    dashboards = resources(template, "AWS::CloudWatch::Dashboard")
    alarms = resources(template, "AWS::CloudWatch::Alarm")
    alarm_metrics = sum(metrics_of(alarm) for _, alarm in alarms)
    schedules = list(scheduled_functions(template))
    invocations = sum(count for count, _ in schedules)
    lambda_usd = sum(count * (LAMBDA_REQUEST + RECONCILER_SECONDS * memory * LAMBDA_GB_SECOND) for count, memory in schedules)
    return [
        Item("KMS customer-managed keys", len(keys), len(keys) * KMS_KEY_MONTH + rotating * KMS_ROTATIONS_BILLED * KMS_KEY_MONTH,
             "encrypt the log groups and the alarm topic; rotated yearly: $1 a key in the first year, $3 from the third"),
        Item("CloudWatch dashboard", len(dashboards), len(dashboards) * DASHBOARD_MONTH, "the benchmarks dashboard (3 per account are free)"),
        Item("CloudWatch alarms", len(alarms), alarm_metrics * STANDARD_ALARM_MONTH, f"{alarm_metrics} metrics watched (10 per account are free)"),
        Item("scheduled Lambda invocations", round(invocations), lambda_usd, "the reconciler that stops jobs whose run is gone"),
        Item("ECR image storage (estimate)", len(IMAGES), IMAGES_GB_ESTIMATE * ECR_GB_MONTH,
             f"the pytorch, tensorflow and neuron images, about {IMAGES_GB_ESTIMATE} GB compressed in all"),
    ]


def render(items: list[Item]) -> str:
    lines = ["| resource | count | $ / month | what it is |", "|---|---|---|---|"]
    lines += [f"| {item.resource} | {item.count:,} | {item.usd_per_month:.2f} | {item.why} |" for item in items]
    total = sum(item.usd_per_month for item in items)
    lines.append(f"| **standing total** | | **{total:.2f}** | {PRICE_SOURCE}, {PRICE_DATE}, steady state, before free tiers |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from aws_cdk.assertions import Template

    from app import build_app  # the repository's CDK app

    _, stack = build_app()
    print(render(standing_cost(Template.from_stack(stack).to_json())), end="")


if __name__ == "__main__":
    main()
