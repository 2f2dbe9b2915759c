"""Benchmark sweeps: which configurations to run, and which one is cheapest per step. Pure.

A sweep's input (the "benchmark sweep" state machine's execution input, or the schedule's):

    {"sweep_name": "resnet-weekly",                       # letters, digits, hyphens
     "configurations": [<job spec>, ...]}                 # explicit, 1–16
  or
    {"sweep_name": "resnet-weekly",
     "base": <job spec>,                                  # its dnn group and hyperparameters
     "data_hosts": [0, 1, 2, 4],                          # one configuration per data-group size, or
     "advisor": {"samples_per_s_per_vcpu": 150,           # sizes around the sizing advisor's prediction
                 "train_ms_per_step": 80},                 #   (lambdas/core/sizing.py); or, instead of
                                                           #   images/s, "preprocess_ms_per_batch_per_vcpu"
     "data_instance_type": "ml.c5.9xlarge",               # default: the base's data group type, else this
     "extra": [<job spec>, ...],                          # e.g. Trainium configurations
     "step_time_target_ms": 150,                          # optional: only configurations this fast qualify
     "run_steps": 100000,                                 # optional: the length of the runs it sizes for
     "max_cost_usd": 400}                                 # optional: lowers the deployment's sweep ceiling

Each configuration is a full job spec, validated as a training run would be, with a run name of its own
(``<base run name>-d<n>`` for the generated ones). The comparison takes each run's result.json and the
day's prices: the steady-state cost per 1k steps (the billed time per step), improvement over the
baseline (the first configuration that succeeded; for generated sweeps that is the GPU alone), what each
run was billed in all (billed seconds, start-up included), and the recommended configuration: the
cheapest per 1k steps among those that succeeded within the step-time target, counting each one's
start-up (the billed seconds before its first batch) spread over ``run_steps`` steps, or over its own
steps without it. A long run is billed its steady state; a short one its start-up too, which a
steady-state figure alone leaves out (and so favours the configurations that start slowly: more data
hosts, bigger images). The report says which basis it used.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lambdas.core.catalog import instance_type
from lambdas.core.job_spec import (
    MAX_RUN_NAME,
    NO_POLICY,
    JobSpecError,
    SpecPolicy,
    ceiling_usd,
    is_script_workload,
    positive_usd,
    trainer_config,
    validate_job_spec,
    worst_case_cost_usd,
)
from lambdas.core.price_performance import Prices, cost_per_1k_steps, hourly_cost, improvement
from lambdas.core.results import billed_ms_per_step, configured_steps, with_startup
from lambdas.core.sizing import SizingError, SizingProfile, data_hosts_needed, ms_per_batch_per_vcpu
from training.variants import VARIANTS

# Where each sweep's figures go in CloudWatch (the dashboard reads them there).
METRIC_NAMESPACE = "HeterogeneousTraining/Sweeps"
SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,31}")
MAX_CONFIGURATIONS = 16
DEFAULT_DATA_INSTANCE_TYPE = "ml.c5.9xlarge"
SWEEP_KEYS = {"sweep_name", "configurations", "base", "data_hosts", "advisor", "data_instance_type", "extra", "step_time_target_ms",
              "run_steps", "max_cost_usd"}


class SweepSpecError(ValueError):
    """The sweep's input is not one the platform can run; names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class SweepPlan:
    sweep_name: str
    configurations: tuple[dict[str, Any], ...]  # job specs, each valid, run names unique
    step_time_target_ms: float | None
    run_steps: int | None = None  # the runs the recommendation is for; None: each configuration's own steps

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep_name": self.sweep_name,
            "configurations": [{"index": index, "name": spec["run_name"], "spec": spec} for index, spec in enumerate(self.configurations)],
            "step_time_target_ms": self.step_time_target_ms,
            "run_steps": self.run_steps,
        }


def with_data_hosts(base: Mapping[str, Any], count: int, data_instance_type: str) -> dict[str, Any]:
    """The base spec with a data group of ``count`` hosts (0: the DNN group alone, preprocessing on its
    own CPUs), its channels assigned accordingly, and a run name that says so."""
    spec = copy.deepcopy(dict(base))
    dnn = [group for group in spec.get("instance_groups", []) if isinstance(group, dict) and group.get("role") == "dnn"]
    if len(dnn) != 1:
        raise SweepSpecError("base.instance_groups", "needs exactly one group with role 'dnn' to build configurations from")
    # The base name is cut, never the size: "<40 characters>-d1" and "-d2" cut to 40 would be one name.
    suffix = f"-d{count}"
    spec["run_name"] = str(spec.get("run_name", "sweep"))[:MAX_RUN_NAME - len(suffix)].rstrip("-") + suffix
    if count == 0:
        # The DNN group reads the channels itself, and its ranks need every file: a sharded channel is
        # replicated in this configuration (job_spec refuses a DNN group reading a sharded one).
        spec["instance_groups"] = dnn
        spec["inputs"] = {name: {key: value for key, value in channel.items() if key not in ("groups", "distribution")}
                          for name, channel in dict(spec.get("inputs", {})).items()}
    elif is_script_workload(spec.get("workload")):
        # A script names its groups and routes its channels itself: its data group keeps the base's name
        # (the script may read it, as the public samples do) and the channels keep their routing.
        named = [group.get("name") for group in spec.get("instance_groups", []) if isinstance(group, dict) and group.get("role") == "data"]
        spec["instance_groups"] = [{"name": named[0] if named else "data_group", "role": "data", "instance_type": data_instance_type,
                                    "count": count}, *dnn]
    else:
        spec["instance_groups"] = [{"name": "data_group", "role": "data", "instance_type": data_instance_type, "count": count}, *dnn]
        # The data group preprocesses the channels; a PyTorch workload's validation channel stays with the
        # DNN group, which validates on it (job_spec requires it there).
        variant = VARIANTS.get(str(spec.get("variant", "pytorch")))
        evaluation = spec.get("hyperparameters", {}).get("eval_channel") if variant is not None and variant.user_workloads else None
        spec["inputs"] = {name: dict(channel) | {"groups": [dnn[0].get("name")] if name == evaluation else ["data_group"]}
                          for name, channel in dict(spec.get("inputs", {})).items()}
    return spec


def plan_sweep(raw: Any, policy: SpecPolicy = NO_POLICY) -> SweepPlan:
    """The sweep's configurations, each validated as its training run will be (with the deployment's
    policy), and their worst-case costs together under the sweep's ceiling."""
    if not isinstance(raw, dict):
        raise SweepSpecError("$", "a sweep input is a JSON object")
    unknown = sorted(set(raw) - SWEEP_KEYS)
    if unknown:
        raise SweepSpecError(unknown[0], f"unknown field; a sweep takes {sorted(SWEEP_KEYS)}")
    name = raw.get("sweep_name")
    if not isinstance(name, str) or not SWEEP_NAME.fullmatch(name):
        raise SweepSpecError("sweep_name", f"{name!r} must be 1–32 letters, digits or hyphens")
    target = raw.get("step_time_target_ms")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int | float) or not math.isfinite(target) or target <= 0):
        raise SweepSpecError("step_time_target_ms", f"must be a positive number of milliseconds, got {target!r}")
    run_steps = raw.get("run_steps")
    if run_steps is not None and (isinstance(run_steps, bool) or not isinstance(run_steps, int) or run_steps < 1):
        raise SweepSpecError("run_steps", f"must be a whole number of steps (at least 1), got {run_steps!r}")
    if ("configurations" in raw) == ("base" in raw):
        raise SweepSpecError("configurations", "give either 'configurations' (job specs) or 'base' with 'data_hosts', not both or neither")
    specs = _spec_list(raw, "configurations") if "configurations" in raw else _generated(raw)
    specs += _spec_list(raw, "extra") if "extra" in raw else []
    if not 1 <= len(specs) <= MAX_CONFIGURATIONS:
        raise SweepSpecError("configurations", f"a sweep runs 1–{MAX_CONFIGURATIONS} configurations, got {len(specs)}")
    validated = []
    for index, spec in enumerate(specs):
        try:
            validated.append(validate_job_spec(spec, policy))
        except JobSpecError as error:
            raise SweepSpecError(f"configurations[{index}].{error.field}", error.problem) from None
    _check_total_cost(raw.get("max_cost_usd"), validated, policy)
    names = [spec["run_name"] for spec in specs]
    duplicates = sorted({run for run in names if names.count(run) > 1})
    if duplicates:
        raise SweepSpecError("configurations", f"run names must differ within a sweep: {duplicates} appear twice")
    return SweepPlan(name, tuple(specs), float(target) if target is not None else None, run_steps)


def _spec_list(raw: Mapping[str, Any], key: str) -> list[Any]:
    """``raw[key]``, which must be a list (of job specs, each validated after)."""
    value = raw[key]
    if not isinstance(value, list):
        raise SweepSpecError(key, f"must be a list of job specs, got {type(value).__name__}")
    return list(value)


def sweep_ceiling_usd(own_ceiling: Any, policy: SpecPolicy) -> float | None:
    """The ceiling on a sweep's configurations together: the deployment's, lowered by the sweep's own
    ``max_cost_usd``; None when neither is set."""
    try:
        return ceiling_usd(positive_usd(own_ceiling), policy.sweep_cost_ceiling_usd, "sweep ceiling", "a sweep")
    except JobSpecError as error:
        raise SweepSpecError(error.field, error.problem) from None


def _check_total_cost(own_ceiling: Any, specs: Sequence[Any], policy: SpecPolicy) -> None:
    ceiling = sweep_ceiling_usd(own_ceiling, policy)
    if ceiling is None:
        return
    try:
        total = sum(worst_case_cost_usd(spec, policy) for spec in specs)
    except JobSpecError as error:
        raise SweepSpecError(f"configurations.{error.field}", error.problem) from None
    if total > ceiling:
        raise SweepSpecError("configurations", f"the {len(specs)} configurations may cost ${total:,.2f} together (each for its whole "
                                               f"max_runtime_s), above the sweep ceiling of ${ceiling:,.2f}: fewer "
                                               "configurations or shorter runtimes")


def _generated(raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    base = raw["base"]
    if not isinstance(base, dict):
        raise SweepSpecError("base", "must be a job spec (a JSON object)")
    data_groups = [group for group in base.get("instance_groups", []) if isinstance(group, dict) and group.get("role") == "data"]
    instance = raw.get("data_instance_type") or (data_groups[0].get("instance_type") if data_groups else DEFAULT_DATA_INSTANCE_TYPE)
    if ("data_hosts" in raw) == ("advisor" in raw):
        raise SweepSpecError("data_hosts", "with 'base', give either 'data_hosts' (sizes) or 'advisor' (a profile to size from)")
    counts = _advised_sizes(raw["advisor"], instance, base) if "advisor" in raw else raw.get("data_hosts")
    if not isinstance(counts, list) or not counts or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 20 for n in counts):
        raise SweepSpecError("data_hosts", f"must be a non-empty list of data-group sizes 0–20, got {counts!r}")
    if len(set(counts)) != len(counts):
        raise SweepSpecError("data_hosts", f"sizes must differ, got {counts}")
    return [with_data_hosts(base, count, instance) for count in counts]


# The preprocessing figure per sample: samples/s per vCPU (what `hetero profile` prints), or its earlier
# name images_per_s_per_vcpu, still accepted (a sample need not be an image).
PER_SAMPLE_KEYS = ("samples_per_s_per_vcpu", "images_per_s_per_vcpu")


def _advised_sizes(advisor: Any, data_instance_type: str, base: Mapping[str, Any]) -> list[int]:
    """None, and the sizes around the advisor's prediction for this data instance type. The
    preprocessing figure comes per step, or per sample (samples/s per vCPU, as `hetero profile` and
    bench/preprocess.py measure it), then costed at the samples the base's step takes."""
    fields = {"preprocess_ms_per_batch_per_vcpu", *PER_SAMPLE_KEYS, "train_ms_per_step", "dnn_spare_vcpus", "efficiency"}
    if not isinstance(advisor, dict) or set(advisor) - fields:
        raise SweepSpecError("advisor", f"must be an object with {sorted(fields)}, got {advisor!r}")
    given = [key for key in (*PER_SAMPLE_KEYS, "preprocess_ms_per_batch_per_vcpu") if key in advisor]
    if len(given) != 1:
        raise SweepSpecError("advisor", "give the preprocessing cost once: samples_per_s_per_vcpu (or its earlier name "
                                        "images_per_s_per_vcpu) or preprocess_ms_per_batch_per_vcpu")
    per_sample = given[0] in PER_SAMPLE_KEYS
    samples = images_per_step(base) if per_sample else 0  # a bad base is named as the base
    try:
        figures = {key: float(value) for key, value in advisor.items()}
        if per_sample:
            figures["preprocess_ms_per_batch_per_vcpu"] = ms_per_batch_per_vcpu(figures.pop(given[0]), samples)
        profile = SizingProfile(**figures)
        vcpus = instance_type(data_instance_type).vcpus
    except (SizingError, TypeError, ValueError, KeyError) as error:
        raise SweepSpecError("advisor", str(error).strip("'\"")) from None
    needed = data_hosts_needed(profile, vcpus)
    return sorted({0, max(needed - 1, 0), needed, needed + 1})


def images_per_step(base: Mapping[str, Any]) -> int:
    """The images one training step of the base takes from its data hosts: the batch of each trainer
    process (its hyperparameter as the trainer reads it, else its default) × the trainer processes (one
    per GPU or NeuronCore of every DNN host, one on a CPU host), as the launcher starts them."""
    try:
        spec = validate_job_spec(base)
    except JobSpecError as error:
        raise SweepSpecError(f"base.{error.field}", error.problem) from None
    if spec.is_script:
        raise SweepSpecError("advisor", "sizes data groups from the platform trainer's batch size, which a script keeps to itself: "
                                        "list the sizes to run in data_hosts")
    dnn = instance_type(spec.dnn_group.instance_type)
    return trainer_config(spec).batch_size * spec.dnn_group.count * (dnn.neuron_cores or dnn.accelerators or 1)


# Comparison -------------------------------------------------------------------------------------------


def data_host_count(spec: Mapping[str, Any]) -> int:
    return sum(group["count"] for group in spec["instance_groups"] if group.get("role") == "data")


def describe_cluster(spec: Mapping[str, Any]) -> str:
    return " + ".join(f"{group['count']}× {group['instance_type']}" for group in spec["instance_groups"])


def compare(outcomes: Sequence[Mapping[str, Any]], prices: Prices, step_time_target_ms: float | None,
            run_steps: int | None = None) -> dict[str, Any]:
    """The report: one row per configuration, in sweep order, and the recommendation.

    ``outcomes``: per configuration, {"name", "spec", "status": "SUCCEEDED"|"FAILED", "error"?, "result"?: result.json}.
    ``run_steps``: the length of the runs the recommendation is for (None: each configuration's own steps).
    """
    rows: list[dict[str, Any]] = []
    costs: list[float | None] = []
    amortised: list[float | None] = []
    for outcome in outcomes:
        spec, result = outcome["spec"], outcome.get("result") or {}
        # What a step was billed for (result.json's billed_ms_per_step, or, for a result written before it
        # was recorded, from its summary's figures): the cost, the target and the recommendation use it;
        # p50 and p90 are shown beside it as step-time statistics.
        stats = result.get("step_time_ms") or {}
        step = result.get("billed_ms_per_step") or billed_ms_per_step({"step_time_ms": stats})
        succeeded = outcome["status"] == "SUCCEEDED" and step is not None
        billable = result.get("billable_seconds")
        row: dict[str, Any] = {
            "name": outcome["name"],
            "cluster": describe_cluster(spec),
            "variant": spec["variant"],
            "data_hosts": data_host_count(spec),
            "status": "succeeded" if succeeded else "failed",
            "error": None if succeeded else (outcome.get("error") or result.get("failure_reason") or "no step time in the result"),
            "billed_ms_per_step": round(step, 3) if succeeded else None,
            "step_time_ms": step if succeeded else None,  # the billed figure too (the dashboard's BilledMsPerStep)
            "step_p50_ms": stats.get("p50") if succeeded else None,
            "step_p90_ms": stats.get("p90") if succeeded else None,
            "usd_per_hour": None,
            "cost_per_1k_steps_usd": None,
            "price_note": None,
            # Billed seconds before the first batch (result.json's startup).
            "first_batch_s": (result.get("startup") or {}).get("billed_to_first_batch_s") if succeeded else None,
            # What the run was billed in all, start-up included (a failed one too: it was billed).
            "billable_seconds": billable if isinstance(billable, int | float) and not isinstance(billable, bool) else None,
            "run_cost_usd": None,
            "spec_steps": configured_steps(spec),
            "steps_trained": result.get("steps_trained") if succeeded else None,
            "billed_overhead_s": result.get("billed_overhead_s") if succeeded else None,
            "cost_per_1k_steps_with_startup_usd": None,
        }
        cost, whole = None, None  # unrounded, for the comparisons; the report shows them rounded
        try:
            usd_per_hour = hourly_cost([(g["instance_type"], g["count"]) for g in spec["instance_groups"]], prices)
            row["usd_per_hour"] = round(usd_per_hour, 4)
            if row["billable_seconds"] is not None:
                row["run_cost_usd"] = round(row["billable_seconds"] / 3600 * usd_per_hour, 4)
            if succeeded:
                cost = cost_per_1k_steps(usd_per_hour, step)
                row["cost_per_1k_steps_usd"] = round(cost, 6)
                whole = startup_cost(cost, row, usd_per_hour, run_steps)
                if whole is not None:
                    row["cost_per_1k_steps_with_startup_usd"] = round(whole, 6)
        except KeyError as error:
            row["price_note"] = str(error).strip("'\"")
        rows.append(row)
        costs.append(cost)
        amortised.append(whole)
    priced = [index for index, cost in enumerate(costs) if cost is not None]
    baseline = rows[priced[0]] if priced else None
    for row, cost in zip(rows, costs, strict=True):
        row["improvement_vs_baseline"] = (
            improvement(cost, costs[priced[0]]) if baseline and cost is not None else None
        )
        row["meets_target"] = row["step_time_ms"] is not None and (step_time_target_ms is None or row["step_time_ms"] <= step_time_target_ms)
    eligible = [index for index in priced if rows[index]["meets_target"]]
    # With every eligible configuration's whole bill known, the cost of runs of that length; else the steady
    # state alone for all of them (one basis for every configuration compared), naming the ones without it.
    lacking = [rows[index]["name"] for index in eligible if amortised[index] is None]
    with_start = bool(eligible) and not lacking
    basis = amortised if with_start else costs
    recommended = rows[min(eligible, key=lambda index: basis[index])] if eligible else None
    return {
        "configurations": rows,
        "baseline": baseline["name"] if baseline else None,
        "recommended": recommended["name"] if recommended else None,
        "recommended_data_hosts": recommended["data_hosts"] if recommended else None,
        "recommendation_basis": recommendation_basis(with_start, run_steps, lacking) if eligible else None,
        "run_steps": run_steps,
        "step_time_target_ms": step_time_target_ms,
        "failed": [row["name"] for row in rows if row["status"] == "failed"],
        "prices": {"source": prices.source, "date": prices.date},
    }


def startup_cost(steady: float, row: Mapping[str, Any], usd_per_hour: float, run_steps: int | None) -> float | None:
    """A configuration's cost per 1k steps with what its run was billed beyond its timed steps: for runs of
    ``run_steps`` steps, the steady state plus that overhead spread over them; without it, the whole bill
    over the steps the run trained. None when the result lacks the figures. Pure."""
    if run_steps:
        return None if row["billed_overhead_s"] is None else with_startup(steady, row["billed_overhead_s"], usd_per_hour, run_steps)
    if row["billable_seconds"] is None or not row["steps_trained"]:
        return None
    return row["billable_seconds"] / 3600 * usd_per_hour * 1000 / row["steps_trained"]


def recommendation_basis(with_start: bool, run_steps: int | None, lacking: Sequence[str] = ()) -> str:
    """Which cost the recommendation compared, and why, in a sentence. Pure."""
    if not with_start:
        return (f"the steady-state cost per 1k steps: {', '.join(lacking)} has no whole bill in its result (billable seconds, "
                "steps trained), so every configuration is compared as a long run is billed, its start-up left out")
    if run_steps:
        return (f"the cost per 1k steps of {run_steps:,}-step runs (run_steps): the steady state plus each run's billed seconds "
                "beyond its timed steps (start-up, warm-up and compilation, saves, upload) spread over them")
    return ("the cost per 1k steps of each configuration's own run: its whole bill over the steps it trained; a long run's "
            "tends to the steady state, a short one's is mostly start-up")


def render_markdown(report: Mapping[str, Any], title: str) -> str:
    lines = [f"# {title}", ""]
    target = report["step_time_target_ms"]
    lines += [
        "| configuration | cluster | data hosts | status | ms per step (billed) | p50 / p90 ms | first batch (s) | $/hour | $ per 1k steps | vs baseline | billed s | run $ | $ per 1k steps with start-up |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["configurations"]:
        mark = " **(recommended)**" if row["name"] == report["recommended"] else ""
        status = row["status"] if row["status"] == "succeeded" else f"FAILED: {row['error']}"
        lines.append(
            f"| {row['name']}{mark} | {row['cluster']} | {row['data_hosts']} | {status} | {_number(row['step_time_ms'], 1)} | "
            f"{_number(row.get('step_p50_ms'), 1)} / {_number(row.get('step_p90_ms'), 1)} | {_number(row['first_batch_s'], 1)} | {_number(row['usd_per_hour'], 3)} | {_number(row['cost_per_1k_steps_usd'], 4)} | {_percent(row['improvement_vs_baseline'])} | "
            f"{_number(row.get('billable_seconds'), 0)} | {_number(row.get('run_cost_usd'), 2)} | {_number(row.get('cost_per_1k_steps_with_startup_usd'), 4)} |"
        )
    lines.append("")
    if report.get("disturbed"):  # an emulated sweep measured on a busy machine (training/local/demo.py)
        lines.append(f"**No recommendation:** the measurement cannot back one: {report['disturbed']}.")
    elif report["recommended"]:
        rule = f"within the {target:g} ms step-time target" if target else "with no step-time target"
        lines.append(f"**Recommended:** {report['recommended']} ({report['recommended_data_hosts']} data hosts): the lowest cost per step {rule}.")
        if report.get("recommendation_basis"):
            lines.append(f"Compared by {report['recommendation_basis']}.")
    else:
        lines.append("**No recommendation:** no configuration succeeded" + (f" within the {target:g} ms step-time target." if target else "."))
    if report["baseline"]:
        lines.append(f"Baseline: {report['baseline']} (the first configuration that succeeded).")
    if report["failed"]:
        lines.append(f"Failed: {', '.join(report['failed'])}.")
    prices = report["prices"]
    lines += ["", "ms per step (billed): the timed steps' wall time per step, with the evaluations, checkpoints and stalls "
              "between them (what the job is billed for); the cost per step and the recommendation use it. p50 / p90: "
              "the step-time distribution, which leaves those out. $ per 1k steps: the steady state (billed time per step); "
              "billed s and run $: what each run was billed in all, start-up included; $ per 1k steps with start-up: the "
              "steady state plus the billed seconds before the first batch spread over the run's steps.",
              "", f"Prices: {prices['source']}, {prices['date']}."]
    notes = sorted({row["price_note"] for row in report["configurations"] if row["price_note"]})
    lines += [f"Not priced: {note}." for note in notes]
    return "\n".join(lines) + "\n"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    """An improvement as readers say it: 0.46 → "46% cheaper", −0.1 → "10% dearer"."""
    if value is None:
        return "–"
    if abs(value) < 0.005:
        return "±0%"
    return f"{value:.0%} cheaper" if value > 0 else f"{-value:.0%} dearer"
