"""The result of a training run: what the job cost and how fast it stepped. Pure.

``result.json`` (results/<run id>/result.json) holds the spec, the job's name and status, the earlier
launch attempts that failed for want of capacity, the failure reason, billable seconds, the step time
statistics (p50/p90/mean) from the trainer's summary, the wall time per step, samples/s, the job's final
metrics, $/hour of its instances, cost per 1k steps and of the whole run, the prices used with their
source and date, and the start-up: how long billed time ran before training's first batch (startup_times).

The cost per 1k steps is $/hour × the wall time per step (``billed_ms_per_step``): the timed steps'
whole wall time divided by their number, with the evaluations, checkpoints, recompiles, epoch turns and
slow ranks between them, all of which the job is billed for, and which the median step leaves out (in
three measured runs the wall time per step was 1.20×, 1.34× and 1.64× the median). The job's start-up
(image pull, download, imports: ``startup``) and its final save are one-off costs of the run, not of a
step: they are in ``run_cost_usd`` and left out of the per-step figure, which is what compares
configurations that run for different lengths.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from lambdas.core.job_spec import is_script_workload, split_s3_uri, trainer_config, validate_job_spec
from lambdas.core.price_performance import Prices, cost_per_1k_steps, hourly_cost

SUMMARY_NAME = "summary.json"
MAX_SUMMARY_BYTES = 1 << 20
# The collect function reads the job's output.tar.gz into its memory: a larger one is not read at all.
MAX_ARCHIVE_BYTES = 64 << 20
# ... and inflates at most this much of it looking for the summary: gzip inflates ~150 MB/s on a whole
# core, and the function's 256 MB get ~0.14 of one (Lambda gives a vCPU per 1,769 MB): about 13 s, well
# inside its 60 s timeout. 64 MiB of zeros inflate to tens of GiB: minutes that would time the function
# out (26.9 s per 4 GiB on a whole core).
MAX_INFLATED_BYTES = 256 << 20


class ResultExistsError(RuntimeError):
    """results/<run id>/result.json exists already; results are never overwritten."""


class WriteConflict(RuntimeError):
    """S3 answered 409 ConditionalRequestConflict: another conditional write of the key is in progress, or
    one just finished. Its outcome is unknown yet: retried (S3's guidance), never taken as 'exists'."""


class SummaryUnreadable(ValueError):
    """The job's output holds no summary the platform can read (corrupt, oversized, not JSON)."""


def summary_from_output_archive(archive: bytes) -> dict[str, Any] | None:
    """The trainer's summary.json from SageMaker's output.tar.gz (every host's /opt/ml/output/data,
    merged), or None when the job wrote none. Raises SummaryUnreadable for an archive or a summary that
    cannot be read."""
    try:
        # As a stream, member by member, to the first summary, inflating no more than MAX_INFLATED_BYTES.
        inflated = _Bounded(gzip.GzipFile(fileobj=io.BytesIO(archive)), MAX_INFLATED_BYTES)
        with tarfile.open(fileobj=inflated, mode="r|") as tar:
            for member in tar:
                if member.isfile() and member.name.rsplit("/", 1)[-1] == SUMMARY_NAME:
                    if member.size > MAX_SUMMARY_BYTES:
                        raise SummaryUnreadable(f"{member.name} is {member.size} bytes, more than {MAX_SUMMARY_BYTES}")
                    handle = tar.extractfile(member)
                    summary = json.loads(handle.read()) if handle else None
                    if not isinstance(summary, dict):
                        raise SummaryUnreadable(f"{member.name} holds no JSON object")
                    return summary
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SummaryUnreadable(f"output.tar.gz cannot be read: {type(error).__name__}: {error}") from None
    return None


class _Bounded(io.RawIOBase):
    """A read-only stream that refuses (SummaryUnreadable) to give more than ``limit`` bytes of ``inner``."""

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner, self._left, self._limit = inner, limit, limit

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(self._left + 1 if size is None or size < 0 else min(size, self._left + 1))
        self._left -= len(data)
        if self._left < 0:
            raise SummaryUnreadable(f"output.tar.gz inflates to more than {self._limit} bytes before its {SUMMARY_NAME}; "
                                    "the platform reads no further")
        return data


def read_summary(describe: Mapping[str, Any], size_of: Callable[[str, str], int | None],
                 read: Callable[[str, str], bytes | None]) -> tuple[dict[str, Any] | None, str | None]:
    """(the trainer's summary or None, why it could not be read or None) of a described job, from its
    output.tar.gz; ``size_of`` and ``read`` (bucket, key) are the caller's S3 (None: no such object)."""
    output = describe.get("OutputDataConfig", {}).get("S3OutputPath", "").rstrip("/")
    if not output.startswith("s3://"):
        return None, None
    bucket, prefix = split_s3_uri(output)
    key = "/".join(part for part in (prefix, describe["TrainingJobName"], "output", "output.tar.gz") if part)
    size = size_of(bucket, key)
    if size is None:
        return None, None
    if size > MAX_ARCHIVE_BYTES:
        return None, f"output.tar.gz is {size} bytes, more than the {MAX_ARCHIVE_BYTES} the platform reads"
    archive = read(bucket, key)
    if archive is None:
        return None, None
    try:
        return summary_from_output_archive(archive), None
    except SummaryUnreadable as error:
        return None, str(error)


def run_verdict(job_status: str, summary: Mapping[str, Any] | None, summary_problem: str | None) -> tuple[str, str | None]:
    """(the run's status, why it failed) for a job SageMaker reports ``job_status``. A job that completed
    but timed no step (it resumed a finished checkpoint, or its steps were all warm-up) is no success with
    empty figures: it failed, with that reason. Pure."""
    if job_status != "Completed":
        return job_status, None
    if summary_problem:
        return "Failed", f"SummaryUnreadable: {summary_problem}"
    if summary is None:
        return "Failed", "NoSummary: the job completed without writing summary.json"
    if summary.get("mode") == "script" and summary.get("warning"):
        return "Failed", f"StepLinesNotPerStep: {summary['warning']}"
    if summary.get("mode") == "script" and not summary.get("timed_steps"):
        return "Failed", (f"NoStepsTimed: the script printed {summary.get('steps', 0)} lines matching its step-time regex "
                          f"{summary.get('step_time_regex')!r}, none past its {summary.get('warmup_steps', 0)} warm-up steps: print "
                          "step_time_ms=<ms> once per step, or give the spec's workload.step_time_regex")
    if not summary.get("timed_steps") or not summary.get("step_time_ms"):
        return "Failed", (f"NoStepsTimed: the job trained no step past its warm-up (start_step {summary.get('start_step')}, "
                          f"steps {summary.get('steps')}): a resumed run that had finished, or warmup_steps too close to steps")
    return "Completed", None


def startup_times(describe: Mapping[str, Any], summary: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Where a job's billed time went before its first batch, in seconds (None where unknown). Pure.

    * ``billed_to_first_batch_s``: from TrainingStartTime, when billing starts, to the first batch of the
      trainer's last rank (the summary's ``first_batch_at``): the figure to compare input modes and
      distributions by;
    * ``downloading_s``: the File-mode input copy in it (the job's ``Downloading`` secondary status;
      FastFile channels skip it);
    * ``billed_before_container_s``: from TrainingStartTime to the container's start (the summary's
      ``container_started_at``): the download, the training image's pull, the container's creation;
    * ``container_to_first_batch_s``: the rest (imports, the data hosts' start, a FastFile channel's
      first reads).

    The instants are the DNN host's clock against SageMaker's (both NTP-synced): seconds, not milliseconds.
    """
    summary = summary or {}
    transitions = [item for item in describe.get("SecondaryStatusTransitions") or [] if isinstance(item.get("StartTime"), datetime)]
    downloads = [(item["EndTime"] - item["StartTime"]).total_seconds() for item in transitions
                 if item.get("Status") == "Downloading" and isinstance(item.get("EndTime"), datetime)]
    billed_start = describe.get("TrainingStartTime")
    billed_at = billed_start.timestamp() if isinstance(billed_start, datetime) else None

    def since_billing(key: str) -> float | None:
        instant = _seconds(summary.get(key))
        return None if instant is None or billed_at is None else round(max(0.0, instant - billed_at), 3)

    return {
        "billed_to_first_batch_s": since_billing("first_batch_at"),
        "downloading_s": round(sum(downloads), 3) if downloads else None,
        "billed_before_container_s": since_billing("container_started_at"),
        "container_to_first_batch_s": _seconds(summary.get("time_to_first_batch_s")),
    }


def billed_ms_per_step(summary: Mapping[str, Any] | None) -> float | None:
    """What one step of the run was billed for, in milliseconds: the summary's wall time per timed step
    (see the module's docstring); for a summary of a trainer that did not record it, the mean step time
    (stalls inside steps included, evaluations and checkpoints not). None when no step was timed. Pure."""
    summary = summary or {}
    wall = _seconds(summary.get("wall_ms_per_step"))
    if wall is not None and wall > 0:
        return wall
    mean = _seconds((summary.get("step_time_ms") or {}).get("mean"))
    return mean if mean is not None and mean > 0 else None


def configured_steps(spec: Mapping[str, Any]) -> int | None:
    """The steps a configuration's run trains (its trainer's ``steps``, default included); None for a
    script job, whose steps are the script's own. Pure."""
    if is_script_workload(spec.get("workload")):
        return None
    try:
        return int(trainer_config(validate_job_spec(spec)).steps)
    except ValueError:  # JobSpecError, HyperparameterError: a spec the sweep could not have run
        return None


def with_startup(cost_per_1k: float, overhead_s: float, usd_per_hour: float, steps: int) -> float:
    """The cost per 1k steps of a run of ``steps`` steps: the steady state plus the run's billed seconds
    that were no timed step (start-up, the warm-up steps and their compilation, the final save and upload)
    spread over them. Pure."""
    return cost_per_1k + overhead_s / 3600 * usd_per_hour * 1000 / steps


def steps_trained(summary: Mapping[str, Any] | None) -> int | None:
    """The steps this job trained (a resumed one's from its start step), from the trainer's summary;
    None without one. Pure."""
    summary = summary or {}
    steps, start = summary.get("steps"), summary.get("start_step", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or not isinstance(start, int) or steps - start < 1:
        return None
    return steps - start


def billed_overhead_s(billable: Any, summary: Mapping[str, Any] | None, billed_step_ms: float | None) -> float | None:
    """The run's billed seconds that were no timed step: its billable seconds less the timed steps' wall
    time (start-up, warm-up steps, evaluations and saves outside the timed steps, upload). Pure."""
    timed = (summary or {}).get("timed_steps")
    if _seconds(billable) is None or billed_step_ms is None or not isinstance(timed, int) or isinstance(timed, bool):
        return None
    return round(max(0.0, float(billable) - timed * billed_step_ms / 1000), 3)


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def result_document(
    *,  # groups: (instance type, count) of each instance group, what the run is billed for
    run_id: str,
    groups: Sequence[tuple[str, int]],
    raw_spec: Mapping[str, Any] | None,
    job_name: str | None,
    describe: Mapping[str, Any] | None,
    summary: Mapping[str, Any] | None,
    prices: Prices,
    failure: str | None = None,
    summary_problem: str | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    describe = describe or {}
    job_status = describe.get("TrainingJobStatus", "NotStarted")
    status, verdict = run_verdict(job_status, summary, summary_problem)
    try:
        usd_per_hour: float | None = hourly_cost(groups, prices)
        price_note = None
    except KeyError as error:
        usd_per_hour, price_note = None, str(error).strip("'\"")
    step = (summary or {}).get("step_time_ms")
    billed_step_ms = billed_ms_per_step(summary)
    final_metrics = {item["MetricName"]: item["Value"] for item in describe.get("FinalMetricDataList", [])}
    billable = describe.get("BillableTimeInSeconds")
    startup = startup_times(describe, summary)
    steady = cost_per_1k_steps(usd_per_hour, billed_step_ms) if usd_per_hour is not None and billed_step_ms else None
    trained = steps_trained(summary)
    run_cost = billable / 3600 * usd_per_hour if usd_per_hour is not None and _seconds(billable) else None
    return {
        "run_id": run_id,
        "job_name": job_name,
        "spec": dict(raw_spec) if raw_spec is not None else None,
        "status": status,
        "job_status": job_status,
        # Earlier launch attempts of this run that failed for want of capacity: {job_name, failure_reason}.
        "capacity_attempts": list(attempts or []),
        "failure_reason": failure or describe.get("FailureReason") or verdict,
        "billable_seconds": billable,
        "training_seconds": describe.get("TrainingTimeInSeconds"),
        "step_time_ms": step,
        "billed_ms_per_step": billed_step_ms,
        "samples_per_s": (summary or {}).get("samples_per_s"),
        "final_metrics": final_metrics,
        "usd_per_hour": usd_per_hour,
        # The steady state (billed time per step); beside it what the run was billed in all, start-up
        # included, the steps it trained, and the whole bill per 1k of them.
        "cost_per_1k_steps_usd": round(steady, 6) if steady is not None else None,
        "run_cost_usd": round(run_cost, 4) if run_cost is not None else None,
        "spec_steps": configured_steps(raw_spec) if raw_spec is not None else None,
        "steps_trained": trained,
        "billed_overhead_s": billed_overhead_s(billable, summary, billed_step_ms),
        "cost_per_1k_steps_with_startup_usd": round(run_cost * 1000 / trained, 6) if run_cost is not None and trained else None,
        "startup": startup,
        "prices": {
            "source": prices.source,
            "date": prices.date,
            "usd_per_hour": {name: prices.usd_per_hour.get(name) for name, _ in groups},
            "note": price_note,
        },
    }
