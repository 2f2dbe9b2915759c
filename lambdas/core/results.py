"""The result of a training run: what the job cost and how fast it stepped. Pure.

``result.json`` (results/<run id>/result.json) holds the spec, the job's name and status, the failure
reason, billable seconds, step time p50/p90 from the trainer's summary, samples/s, the job's final
metrics, $/hour of its instances, cost per 1k steps and of the whole run, and the prices used with their
source and date.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Mapping
from typing import Any

from lambdas.core.job_spec import JobSpec
from lambdas.core.price_performance import Prices, cost_per_1k_steps, hourly_cost

SUMMARY_NAME = "summary.json"
MAX_SUMMARY_BYTES = 1 << 20


class ResultExistsError(RuntimeError):
    """results/<run id>/result.json exists already; results are never overwritten."""


def summary_from_output_archive(archive: bytes) -> dict[str, Any] | None:
    """The trainer's summary.json from SageMaker's output.tar.gz (every host's /opt/ml/output/data,
    merged), or None when the job wrote none."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.rsplit("/", 1)[-1] == SUMMARY_NAME and member.size <= MAX_SUMMARY_BYTES:
                handle = tar.extractfile(member)
                return json.loads(handle.read()) if handle else None
    return None


def result_document(
    *,
    run_id: str,
    spec: JobSpec,
    raw_spec: Mapping[str, Any],
    job_name: str | None,
    describe: Mapping[str, Any] | None,
    summary: Mapping[str, Any] | None,
    prices: Prices,
    failure: str | None = None,
) -> dict[str, Any]:
    describe = describe or {}
    groups = [(group.instance_type, group.count) for group in spec.instance_groups]
    try:
        usd_per_hour: float | None = hourly_cost(groups, prices)
        price_note = None
    except KeyError as error:
        usd_per_hour, price_note = None, str(error).strip("'\"")
    step = (summary or {}).get("step_time_ms")
    final_metrics = {item["MetricName"]: item["Value"] for item in describe.get("FinalMetricDataList", [])}
    billable = describe.get("BillableTimeInSeconds")
    return {
        "run_id": run_id,
        "job_name": job_name,
        "spec": dict(raw_spec),
        "status": describe.get("TrainingJobStatus", "NotStarted"),
        "failure_reason": failure or describe.get("FailureReason"),
        "billable_seconds": billable,
        "training_seconds": describe.get("TrainingTimeInSeconds"),
        "step_time_ms": step,
        "samples_per_s": (summary or {}).get("samples_per_s"),
        "final_metrics": final_metrics,
        "usd_per_hour": usd_per_hour,
        "cost_per_1k_steps_usd": round(cost_per_1k_steps(usd_per_hour, step["p50"]), 6) if usd_per_hour is not None and step else None,
        "run_cost_usd": round(billable / 3600 * usd_per_hour, 4) if usd_per_hour is not None and billable else None,
        "prices": {
            "source": prices.source,
            "date": prices.date,
            "usd_per_hour": {name: prices.usd_per_hour.get(name) for name, _ in groups},
            "note": price_note,
        },
    }
