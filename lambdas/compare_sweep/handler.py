"""Compare a finished sweep: report.json, report.md and chart.png under benchmarks/<sweep id>/, one
CloudWatch datapoint per configuration, and the recommended configuration.

Event: {"sweep": <plan_sweep's output>, "outcomes": [{"index", "name", "execution_name", "status":
"SUCCEEDED"|"FAILED", "error"?, "cause"?}]}. Each configuration's figures come from the result.json its
training run wrote (results/<execution name>/result.json); prices from the Price List API, cached for the
day, or the dated fallback. Reports are never overwritten (If-None-Match).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from aws_lambda_powertools import Logger

from lambdas.clients import client, pricing_client, put_new_object, read_existing, read_object_or_none
from lambdas.core.chart import render_chart
from lambdas.core.pricing import prices_for
from lambdas.core.results import ResultExistsError
from lambdas.core.sweep import METRIC_NAMESPACE, compare, render_markdown

logger = Logger(service="compare-sweep")


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    sweep, bucket = event["sweep"], os.environ["RESULTS_BUCKET"]
    configurations = {item["index"]: item for item in sweep["configurations"]}
    outcomes = []
    for outcome in sorted(event["outcomes"], key=lambda item: item["index"]):
        configuration = configurations[outcome["index"]]
        outcomes.append({
            "name": configuration["name"],
            "spec": configuration["spec"],
            "status": outcome["status"],
            "error": _error(outcome),
            "result": _result(bucket, configuration["execution_name"]),
        })
    instance_types = {group["instance_type"] for item in configurations.values() for group in item["spec"]["instance_groups"]}
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    prices = prices_for(instance_types, region=os.environ["PRICING_REGION_CODE"], day=today, pricing=pricing_client(),
                        s3=client("s3"), bucket=bucket)
    report = compare(outcomes, prices, sweep.get("step_time_target_ms"), sweep.get("run_steps"))
    report |= {"sweep_id": sweep["sweep_id"], "sweep_name": sweep["sweep_name"], "date": today}
    title = f"{sweep['sweep_name']} {today}"
    prefix = f"benchmarks/{sweep['sweep_id']}"
    written = read_object_or_none(bucket, f"{prefix}/report.json")
    if written is not None:  # a retried compare: the report was complete (report.json is written last)
        logger.info("report written by an earlier attempt of this compare", extra={"sweep_id": sweep["sweep_id"]})
        return _reply(bucket, prefix, json.loads(written))
    # The chart and the markdown first, report.json last: its presence says the report is whole. A retry
    # after a partial attempt keeps what that attempt wrote (each object is written once).
    for name, body, content_type in (
        ("chart.png", render_chart(report, title), "image/png"),
        ("report.md", render_markdown(report, f"Benchmark sweep {title}").encode(), "text/markdown"),
    ):
        try:
            put_new_object(bucket, f"{prefix}/{name}", body, content_type)
        except ResultExistsError:
            logger.info("kept from an earlier attempt", extra={"key": f"{prefix}/{name}"})
    # Before report.json: a retry after it would skip them (a retry between the two publishes them twice).
    _publish_metrics(sweep["sweep_name"], report)
    try:
        put_new_object(bucket, f"{prefix}/report.json", json.dumps(report, indent=2).encode(), "application/json")
    except ResultExistsError:  # an overlapping attempt finished first: its report is the sweep's
        return _reply(bucket, prefix, json.loads(read_existing(bucket, f"{prefix}/report.json")))
    logger.info("sweep compared", extra={"sweep_id": sweep["sweep_id"], "recommended": report["recommended"], "failed": report["failed"]})
    return _reply(bucket, prefix, report)


def _reply(bucket: str, prefix: str, report: dict[str, Any]) -> dict[str, Any]:
    return {
        "report_uri": f"s3://{bucket}/{prefix}/report.json",
        "recommended": report["recommended"],
        "recommended_data_hosts": report["recommended_data_hosts"],
        "failed": report["failed"],
        "prices": report["prices"],
    }


def _error(outcome: dict[str, Any]) -> str | None:
    if outcome["status"] == "SUCCEEDED":
        return None
    cause = outcome.get("cause") or ""
    try:  # a failed child execution's cause is its own DescribeExecution, as JSON
        child = json.loads(cause)
        cause = f"{child.get('Error', '')}: {child.get('Cause', '')}".strip(": ") if isinstance(child, dict) else cause
    except json.JSONDecodeError:
        pass
    return f"{outcome.get('error') or 'Failed'}: {cause}"[:500]


def _result(bucket: str, run_id: str) -> dict[str, Any] | None:
    """The configuration's result.json; None when its run wrote none (e.g. refused before launch)."""
    document = read_object_or_none(bucket, f"results/{run_id}/result.json")
    return json.loads(document) if document is not None else None


def _publish_metrics(sweep_name: str, report: dict[str, Any]) -> None:
    data = []
    for row in report["configurations"]:
        dimensions = [{"Name": "Sweep", "Value": sweep_name}, {"Name": "Configuration", "Value": row["name"]}]
        if row["step_time_ms"] is not None:
            data.append({"MetricName": "BilledMsPerStep", "Dimensions": dimensions, "Value": row["step_time_ms"], "Unit": "Milliseconds"})
        if row["cost_per_1k_steps_usd"] is not None:
            data.append({"MetricName": "CostPer1kStepsUsd", "Dimensions": dimensions, "Value": row["cost_per_1k_steps_usd"], "Unit": "None"})
    data.append({"MetricName": "FailedConfigurations", "Dimensions": [{"Name": "Sweep", "Value": sweep_name}],
                 "Value": len(report["failed"]), "Unit": "Count"})
    for start in range(0, len(data), 1000):  # PutMetricData's limit per call
        client("cloudwatch").put_metric_data(Namespace=METRIC_NAMESPACE, MetricData=data[start:start + 1000])
