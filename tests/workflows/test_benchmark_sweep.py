"""The synthesized "benchmark sweep" state machine, executed by moto's Step Functions interpreter: each
configuration runs as a nested execution of the real training-run state machine, every Lambda task is
our real handler, and the Price List API is answered (or made to fail) at the network boundary."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from PIL import Image

from lambdas.clients import pricing_client
from lambdas.core.price_performance import FALLBACK_PRICES
from tests.lambdas.conftest import RESULTS_BUCKET
from tests.workflows.conftest import SPEC, Scenario

# The public PyTorch table: 1× ml.p3.2xlarge alone 1193 ms/step; with 1× ml.c5.9xlarge 184 ms/step.
SUMMARIES = {
    "vision-hetero-d0": {"timed_steps": 100, "step_time_ms": {"p50": 1193.0, "p90": 1210.0, "mean": 1195.0}},
    "vision-hetero-d1": {"timed_steps": 100, "step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 186.0}},
    "vision-hetero-d2": {"timed_steps": 100, "step_time_ms": {"p50": 180.0, "p90": 185.0, "mean": 181.0}},
}
API_PRICES = {"ml.p3.2xlarge": "3.825", "ml.c5.9xlarge": "1.836"}


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any):
        yield self._data


def price_list_endpoint(status: int = 200, error_code: str = ""):
    """A stand-in for api.pricing.us-east-1.amazonaws.com: answers GetProducts from API_PRICES, or with an error."""

    def answer(request, **_: Any) -> AWSResponse:
        if status != 200:
            body = json.dumps({"__type": error_code, "message": "Rate exceeded"}).encode()
            return AWSResponse(request.url, status, {"x-amzn-requestid": "1"}, _Body(body))
        filters = {item["Field"]: item["Value"] for item in json.loads(request.body)["Filters"]}
        name = filters["instanceName"]
        products = [json.dumps({
            "product": {"attributes": {"instanceName": name, "regionCode": filters["regionCode"], "usagetype": f"USE1-Train:{name}"}},
            "terms": {"OnDemand": {"T": {"priceDimensions": {"D": {"unit": "Hrs", "pricePerUnit": {"USD": API_PRICES[name]}}}}}},
        })] if name in API_PRICES else []
        return AWSResponse(request.url, 200, {"x-amzn-requestid": "1"}, _Body(json.dumps({"PriceList": products, "FormatVersion": "aws_v1"}).encode()))

    return answer


@pytest.fixture
def prices_answer():
    """Install a Price List API stand-in on the handlers' pricing client (ahead of moto, which lacks it)."""
    installed = []

    def install(handler) -> None:
        pricing_client().meta.events.register_first("before-send.pricing.GetProducts", handler)
        installed.append(handler)

    yield install
    for handler in installed:
        pricing_client().meta.events.unregister("before-send.pricing.GetProducts", handler)


def report_files(harness, sweep_id: str) -> tuple[dict, str, bytes]:
    def read(name: str) -> bytes:
        return harness.s3.get_object(Bucket=RESULTS_BUCKET, Key=f"benchmarks/{sweep_id}/{name}")["Body"].read()

    return json.loads(read("report.json")), read("report.md").decode(), read("chart.png")


def test_a_sweep_over_data_group_sizes_recommends_the_cheapest_and_publishes_it(run, prices_answer) -> None:
    harness = run(Scenario(runs_for_s=1.0))
    prices_answer(price_list_endpoint())
    sweep = {"sweep_name": "mnist-weekly", "base": SPEC, "data_hosts": [0, 1]}
    execution = harness.wait(harness.start_sweep(sweep, "sweep-ok", SUMMARIES), timeout_s=120)
    assert execution["status"] == "SUCCEEDED", execution
    output = json.loads(execution["output"])
    assert output["report"]["recommended"] == "vision-hetero-d1" and output["report"]["failed"] == []
    report, markdown, png = report_files(harness, "sweep-ok")
    rows = {row["name"]: row for row in report["configurations"]}
    assert round(rows["vision-hetero-d1"]["improvement_vs_baseline"] * 100) == 77  # the public figure, from live prices
    assert report["prices"]["source"].startswith("AWS Price List API") and report["prices"]["date"] != FALLBACK_PRICES.date
    assert "| vision-hetero-d1 **(recommended)** |" in markdown and "77% cheaper" in markdown
    assert Image.open(io.BytesIO(png)).size[0] >= 900
    # Each configuration ran as its own training run, with its own result.
    assert {harness.result(f"sweep-ok-{index}")["status"] for index in (0, 1)} == {"Completed"}
    metrics = harness.cloudwatch.list_metrics(Namespace="HeterogeneousTraining/Sweeps")["Metrics"]
    assert {(m["MetricName"], d["Value"]) for m in metrics for d in m["Dimensions"] if d["Name"] == "Configuration"} >= {
        ("BilledMsPerStep", "vision-hetero-d0"), ("CostPer1kStepsUsd", "vision-hetero-d1"),
    }


def test_a_failed_configuration_is_marked_and_the_sweep_goes_on_with_fallback_prices(run, prices_answer) -> None:
    harness = run(Scenario(runs_for_s=1.0, failing_runs=frozenset({"vision-hetero-d2"})))
    prices_answer(price_list_endpoint(status=400, error_code="ThrottlingException"))
    sweep = {"sweep_name": "mnist-weekly", "base": SPEC, "data_hosts": [0, 1, 2]}
    execution = harness.wait(harness.start_sweep(sweep, "sweep-partial", SUMMARIES), timeout_s=120)
    assert execution["status"] == "SUCCEEDED", execution
    report, markdown, _ = report_files(harness, "sweep-partial")
    assert report["failed"] == ["vision-hetero-d2"] and report["recommended"] == "vision-hetero-d1"
    (failed,) = [row for row in report["configurations"] if row["status"] == "failed"]
    assert "TrainingJobFailed" in failed["error"] and failed["cost_per_1k_steps_usd"] is None
    assert "FAILED: " in markdown
    assert "live prices unavailable: ThrottlingException" in report["prices"]["source"]
    assert report["prices"]["date"] == FALLBACK_PRICES.date


def test_an_invalid_sweep_fails_naming_the_field_and_launches_nothing(run) -> None:
    harness = run(Scenario())
    execution = harness.wait(harness.start_sweep({"sweep_name": "bad", "base": SPEC, "data_hosts": [1, 1]}, "sweep-bad"))
    assert execution["status"] == "FAILED" and execution["error"] == "InvalidSweep"
    assert "data_hosts" in execution["cause"] and harness.training_jobs() == []


def test_a_sweep_whose_compare_fails_once_is_retried_and_keeps_one_report(run, prices_answer, monkeypatch) -> None:
    """PutMetricData refused once after the chart and markdown are written: the compare is retried, keeps
    what the first attempt wrote (each object once), writes report.json last, and the sweep succeeds."""
    from moto.cloudwatch.exceptions import InvalidParameterValue
    from moto.cloudwatch.models import CloudWatchBackend

    original, refused = CloudWatchBackend.put_metric_data, []

    def put_metric_data(self, *args, **kwargs):
        if not refused:
            refused.append(True)
            raise InvalidParameterValue("CloudWatch refused the call once")  # a 400: botocore retries it not
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CloudWatchBackend, "put_metric_data", put_metric_data)
    harness = run(Scenario(runs_for_s=1.0))
    prices_answer(price_list_endpoint())
    sweep = {"sweep_name": "mnist-weekly", "base": SPEC, "data_hosts": [0, 1]}
    execution = harness.wait(harness.start_sweep(sweep, "sweep-compare-retried", SUMMARIES), timeout_s=240)
    assert execution["status"] == "SUCCEEDED", execution
    assert refused == [True]
    report, markdown, png = report_files(harness, "sweep-compare-retried")
    assert report["recommended"] == "vision-hetero-d1" and "(recommended)" in markdown and png[:4] == b"\x89PNG"
    versions = harness.s3.list_object_versions(Bucket=RESULTS_BUCKET, Prefix="benchmarks/sweep-compare-retried/")["Versions"]
    assert sorted(v["Key"].rsplit("/", 1)[-1] for v in versions) == ["chart.png", "report.json", "report.md"]  # each once
