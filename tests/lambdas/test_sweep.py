"""lambdas/core/sweep.py and chart.py: sweep inputs planned or refused by name, the comparison and its
recommendation, the markdown table and the PNG chart (decoded with Pillow and checked)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from lambdas.core.chart import BAR, BEST, FAILED, render_chart
from lambdas.core.job_spec import SpecPolicy
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.sweep import SweepSpecError, compare, plan_sweep, render_markdown, with_data_hosts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TF = json.loads((EXAMPLES / "tensorflow-heterogeneous.json").read_text())
PYTORCH = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
TRAINIUM = json.loads((EXAMPLES / "neuron-trn1-2xlarge.json").read_text())


def test_a_base_and_data_group_sizes_make_one_valid_configuration_each() -> None:
    plan = plan_sweep({"sweep_name": "resnet-weekly", "base": TF, "data_hosts": [0, 1, 2, 4]})
    names = [spec["run_name"] for spec in plan.configurations]
    assert names == ["resnet50-hetero-d0", "resnet50-hetero-d1", "resnet50-hetero-d2", "resnet50-hetero-d4"]
    alone, two = plan.configurations[0], plan.configurations[2]
    assert [g["role"] for g in alone["instance_groups"]] == ["dnn"] and "groups" not in alone["inputs"]["train"]
    assert two["instance_groups"][0] == {"name": "data_group", "role": "data", "instance_type": "ml.c5.18xlarge", "count": 2}
    assert two["inputs"]["train"]["groups"] == ["data_group"]
    assert plan.to_json()["configurations"][3]["index"] == 3


def test_extra_configurations_join_and_explicit_lists_are_taken_as_they_are() -> None:
    plan = plan_sweep({"sweep_name": "mixed", "base": PYTORCH, "data_hosts": [0, 1], "extra": [TRAINIUM]})
    assert [spec["variant"] for spec in plan.configurations] == ["pytorch", "pytorch", "neuron"]
    explicit = plan_sweep({"sweep_name": "two", "configurations": [PYTORCH, TF], "step_time_target_ms": 150})
    assert len(explicit.configurations) == 2 and explicit.step_time_target_ms == 150.0


BAD: list[tuple[str, Any, str]] = [
    ("not an object", [], "$"),
    ("unknown field", {"sweep_name": "s", "base": TF, "data_hosts": [0], "concurrency": 9}, "concurrency"),
    ("bad sweep name", {"sweep_name": "no spaces please", "configurations": [TF]}, "sweep_name"),
    ("both forms", {"sweep_name": "s", "configurations": [TF], "base": TF, "data_hosts": [0]}, "configurations"),
    ("neither form", {"sweep_name": "s"}, "configurations"),
    ("sizes not a list", {"sweep_name": "s", "base": TF, "data_hosts": 2}, "data_hosts"),
    ("negative size", {"sweep_name": "s", "base": TF, "data_hosts": [0, -1]}, "data_hosts"),
    ("repeated size", {"sweep_name": "s", "base": TF, "data_hosts": [1, 1]}, "data_hosts"),
    ("an invalid configuration", {"sweep_name": "s", "configurations": [TF, TF | {"variant": "jax"}]}, "configurations[1].variant"),
    ("run names collide", {"sweep_name": "s", "configurations": [TF, TF]}, "configurations"),
    ("GPU data hosts", {"sweep_name": "s", "base": TF, "data_hosts": [1], "data_instance_type": "ml.p3.2xlarge"},
     "configurations[0].instance_groups[0].instance_type"),
    ("target not positive", {"sweep_name": "s", "configurations": [TF], "step_time_target_ms": 0}, "step_time_target_ms"),
    ("too many", {"sweep_name": "s", "base": TF, "data_hosts": list(range(17))}, "configurations"),
    ("negative sweep ceiling", {"sweep_name": "s", "configurations": [TF], "max_cost_usd": -5}, "max_cost_usd"),
    ("infinite sweep ceiling", {"sweep_name": "s", "configurations": [TF], "max_cost_usd": float("inf")}, "max_cost_usd"),
    ("configurations a number", {"sweep_name": "s", "configurations": 5}, "configurations"),
    ("configurations null", {"sweep_name": "s", "configurations": None}, "configurations"),
    ("configurations a string", {"sweep_name": "s", "configurations": "TF"}, "configurations"),
    ("extra a number", {"sweep_name": "s", "configurations": [TF], "extra": 5}, "extra"),
    ("extra null", {"sweep_name": "s", "base": TF, "data_hosts": [0], "extra": None}, "extra"),
    ("NaN target", {"sweep_name": "s", "configurations": [TF], "step_time_target_ms": float("nan")}, "step_time_target_ms"),
    ("infinite target", {"sweep_name": "s", "configurations": [TF], "step_time_target_ms": float("inf")}, "step_time_target_ms"),
    ("spec_version true", {"sweep_name": "s", "configurations": [TF | {"spec_version": True}]}, "configurations[0].spec_version"),
]


@pytest.mark.parametrize(("raw", "field"), [(raw, field) for _, raw, field in BAD], ids=[name for name, _, _ in BAD])
def test_bad_sweep_inputs_are_refused_naming_the_field(raw: Any, field: str) -> None:
    with pytest.raises(SweepSpecError) as refused:
        plan_sweep(raw)
    assert refused.value.field == field and len(refused.value.problem) > 10


POLICY = SpecPolicy(input_buckets=frozenset({"datasets-bucket"}), run_cost_ceiling_usd=1000.0, sweep_cost_ceiling_usd=100.0,
                    prices_usd_per_hour={"ml.trn1.2xlarge": 1.5})


def test_a_sweep_whose_configurations_cost_too_much_together_is_refused_with_the_figure() -> None:
    # Each of 1× p4d + 0..4× c5.18xlarge for 1 h is under the $1,000 run ceiling; together
    # 5 × $37.688 + (0+1+2+3+4) × $3.672 = $225.16 is over the $100 sweep ceiling.
    base = TF | {"instance_groups": [TF["instance_groups"][0], TF["instance_groups"][1] | {"instance_type": "ml.p4d.24xlarge"}],
                 "max_runtime_s": 3600}
    with pytest.raises(SweepSpecError, match=r"may cost \$225.16 together.*sweep ceiling of \$100.00") as refused:
        plan_sweep({"sweep_name": "big", "base": base, "data_hosts": [0, 1, 2, 3, 4]}, POLICY)
    assert refused.value.field == "configurations"
    assert len(plan_sweep({"sweep_name": "small", "base": base, "data_hosts": [0, 1]}, POLICY).configurations) == 2
    with pytest.raises(SweepSpecError, match="a sweep can only lower it"):
        plan_sweep({"sweep_name": "small", "base": base, "data_hosts": [0], "max_cost_usd": 500}, POLICY)
    with pytest.raises(SweepSpecError, match="sweep ceiling of \\$50.00"):
        plan_sweep({"sweep_name": "small", "base": base, "data_hosts": [0, 1], "max_cost_usd": 50}, POLICY)


def test_each_configuration_meets_the_deployments_policy() -> None:
    elsewhere = PYTORCH | {"inputs": {"train": {"s3_uri": "s3://other-bucket/x/", "groups": ["data_group"]}}}
    with pytest.raises(SweepSpecError) as refused:
        plan_sweep({"sweep_name": "s", "configurations": [PYTORCH, elsewhere | {"run_name": "b"}]}, POLICY)
    assert refused.value.field == "configurations[1].inputs.train.s3_uri"


def result_of(billed: float, p50: float | None = None) -> dict[str, Any]:
    """result.json's step figures: the billed wall time per step, and the step-time distribution."""
    median = billed if p50 is None else p50
    return {"billed_ms_per_step": billed, "step_time_ms": {"p50": median, "p90": median, "mean": median}}


def outcomes(steps: dict[int, float | None], medians: dict[int, float] | None = None) -> list[dict[str, Any]]:
    rows = []
    for count, step in steps.items():
        spec = with_data_hosts(TF, count, "ml.c5.18xlarge")
        rows.append({
            "name": spec["run_name"], "spec": spec, "status": "SUCCEEDED" if step else "FAILED",
            "error": None if step else "TrainingJobFailed: AlgorithmError",
            "result": result_of(step, (medians or {}).get(count)) if step else None,
        })
    return rows


def test_the_public_resnet_table_picks_two_data_hosts_and_marks_the_failure() -> None:
    report = compare(outcomes({0: 192.0, 1: 120.0, 2: 86.0, 4: None}), FALLBACK_PRICES, None)
    rows = {row["name"]: row for row in report["configurations"]}
    assert report["baseline"] == "resnet50-hetero-d0" and report["recommended"] == "resnet50-hetero-d2"
    assert report["recommended_data_hosts"] == 2 and report["failed"] == ["resnet50-hetero-d4"]
    assert round(rows["resnet50-hetero-d2"]["improvement_vs_baseline"] * 100) == 46  # the public figure
    assert rows["resnet50-hetero-d4"]["status"] == "failed" and rows["resnet50-hetero-d4"]["cost_per_1k_steps_usd"] is None
    markdown = render_markdown(report, "resnet sweep")
    assert "| resnet50-hetero-d2 **(recommended)** |" in markdown and "46% cheaper" in markdown
    assert "FAILED: TrainingJobFailed: AlgorithmError" in markdown and FALLBACK_PRICES.date in markdown


def test_a_step_time_target_can_exclude_the_cheapest() -> None:
    steps = {0: 192.0, 1: 80.0, 2: 75.0}  # per 1k steps: d1 41.36 $/h × 80 ms = $0.919, d2 45.03 $/h × 75 ms = $0.938
    assert compare(outcomes(steps), FALLBACK_PRICES, None)["recommended"] == "resnet50-hetero-d1"
    report = compare(outcomes(steps), FALLBACK_PRICES, step_time_target_ms=78)
    assert report["recommended"] == "resnet50-hetero-d2"  # d1 is cheaper but misses the target
    too_strict = compare(outcomes({0: 192.0, 1: 90.0}), FALLBACK_PRICES, step_time_target_ms=50)
    assert too_strict["recommended"] is None and "No recommendation" in render_markdown(too_strict, "t")


def test_a_faster_median_with_periodic_stalls_is_not_recommended() -> None:
    """d2's median step is the fastest (70 ms: $0.875 per 1k steps against d1's $0.919), but it stalls every
    N steps (a slow data host's epoch turn, an evaluation): billed 95 ms per step over its timed steps."""
    report = compare(outcomes({0: 192.0, 1: 80.0, 2: 95.0}, medians={2: 70.0}), FALLBACK_PRICES, None)
    rows = {row["name"]: row for row in report["configurations"]}
    assert report["recommended"] == "resnet50-hetero-d1"
    assert rows["resnet50-hetero-d2"]["step_p50_ms"] == 70.0 and rows["resnet50-hetero-d2"]["billed_ms_per_step"] == 95.0
    assert rows["resnet50-hetero-d2"]["cost_per_1k_steps_usd"] == pytest.approx(45.03 * 0.095 / 3.6, rel=1e-3)
    by_median = compare(outcomes({0: 192.0, 1: 80.0, 2: 70.0}), FALLBACK_PRICES, None)
    assert by_median["recommended"] == "resnet50-hetero-d2"  # what ranking by the median would have said
    markdown = render_markdown(report, "stalls")
    assert "| resnet50-hetero-d2 | " in markdown and "| 95.0 | 70.0 / 70.0 |" in markdown and "ms per step (billed)" in markdown
    # A result written before the billed figure was recorded: its mean step (stalls inside steps) prices it.
    legacy = outcomes({0: 192.0})
    legacy[0]["result"] = {"step_time_ms": {"p50": 150.0, "p90": 200.0, "mean": 192.0}}
    assert compare(legacy, FALLBACK_PRICES, None)["configurations"][0]["billed_ms_per_step"] == 192.0


def test_unpriced_configurations_are_reported_but_not_recommended() -> None:
    trainium = {"name": "bert-trn1", "spec": TRAINIUM, "status": "SUCCEEDED", "result": result_of(10.0)}
    report = compare([*outcomes({0: 192.0}), trainium], FALLBACK_PRICES, None)
    (row,) = [r for r in report["configurations"] if r["name"] == "bert-trn1"]
    assert row["cost_per_1k_steps_usd"] is None and "ml.trn1.2xlarge" in row["price_note"]
    assert report["recommended"] == "resnet50-hetero-d0"


def test_the_chart_is_a_png_with_a_bar_per_configuration(tmp_path: Path) -> None:
    report = compare(outcomes({0: 192.0, 1: 120.0, 2: 86.0, 4: None}), FALLBACK_PRICES, None)
    png = render_chart(report, "resnet-weekly 2026-11-29")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.format is None or image.size[0] >= 900
    colours = {colour for _, colour in image.getcolors(maxcolors=1 << 16)}
    assert {BAR, BEST, FAILED} <= colours  # ordinary bars, the recommended one, the failed stub
    # The tallest bar (192 ms, the GPU alone) stands higher than the recommended one (86 ms).
    columns = [x for x in range(image.size[0] // 2) if image.getpixel((x, 390)) == BAR]
    best = [x for x in range(image.size[0] // 2) if image.getpixel((x, 390)) == BEST]
    tallest = min(y for y in range(480) if image.getpixel((columns[0], y)) == BAR)
    shortest = min(y for y in range(480) if image.getpixel((best[0], y)) == BEST)
    assert tallest < shortest
    (tmp_path / "chart.png").write_bytes(png)


def test_a_sharded_base_channel_is_replicated_for_the_dnn_group_alone() -> None:
    """Data hosts serve their shards; without them the DNN group's ranks need every file."""
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    base["inputs"]["train"] |= {"distribution": "sharded", "input_mode": "fastfile"}
    plan = plan_sweep({"sweep_name": "sharded", "base": base, "data_hosts": [0, 2]})
    alone, with_hosts = plan.configurations
    assert "distribution" not in alone["inputs"]["train"] and alone["inputs"]["train"]["input_mode"] == "fastfile"
    assert with_hosts["inputs"]["train"]["distribution"] == "sharded"


def test_the_report_shows_each_configurations_billed_time_to_first_batch() -> None:
    rows = outcomes({0: 192.0, 2: 86.0, 4: None})
    rows[0]["result"]["startup"] = {"billed_to_first_batch_s": 212.5, "container_to_first_batch_s": 31.0}
    rows[1]["result"]["startup"] = {"billed_to_first_batch_s": None, "container_to_first_batch_s": 40.25}  # no billing start
    report = compare(rows, FALLBACK_PRICES, None)
    assert [row["first_batch_s"] for row in report["configurations"]] == [212.5, None, None]  # one measure, or none
    markdown = render_markdown(report, "t")
    assert "| first batch (s) |" in markdown and "| 192.0 / 192.0 | 212.5 |" in markdown and "| 86.0 / 86.0 | – |" in markdown


def test_a_long_base_run_name_is_cut_before_its_size_so_configurations_keep_distinct_names() -> None:
    plan = plan_sweep({"sweep_name": "s", "base": TF | {"run_name": "r" * 40}, "data_hosts": [0, 1, 12]})
    names = [spec["run_name"] for spec in plan.configurations]
    assert names == ["r" * 37 + "-d0", "r" * 37 + "-d1", "r" * 36 + "-d12"] and all(len(name) == 40 for name in names)


def test_a_user_workloads_sweep_keeps_its_validation_channel_on_the_dnn_group() -> None:
    """Each configuration of a user workload with a validation channel is one its run accepts: the data
    group preprocesses the training channel, the DNN group validates on its own channel."""
    base = json.loads((EXAMPLES / "workloads" / "augmented_cnn" / "heterogeneous.json").read_text())
    base["workload"] = {"code": f"s3://platform-results/code/{'a' * 64}/sourcedir.tar.gz", "sha256": "a" * 64}
    plan = plan_sweep({"sweep_name": "my-cnn", "base": base, "data_hosts": [0, 1, 2]},
                      SpecPolicy(code_bucket="platform-results"))
    alone, one, two = plan.configurations
    assert "groups" not in alone["inputs"]["validation"] and "groups" not in alone["inputs"]["train"]
    for configuration in (one, two):
        assert configuration["inputs"]["train"]["groups"] == ["data_group"]
        assert configuration["inputs"]["validation"]["groups"] == ["dnn_group"]
        assert configuration["workload"] == base["workload"]


def test_each_runs_whole_billed_cost_is_beside_the_steady_state_and_the_recommendation_names_its_basis() -> None:
    """A short sweep's runs are mostly start-up: the steady state alone would recommend the slow starter
    (two data hosts start later); the whole bill over the steps trained, or over run_steps, counts it."""
    def sweep(run_steps: int | None = None) -> dict[str, Any]:
        rows = outcomes({0: 192.0, 2: 86.0})
        for row, (billable, overhead) in zip(rows, ((400, 304.0), (900, 857.0)), strict=True):
            row["result"] |= {"billable_seconds": billable, "steps_trained": 500, "billed_overhead_s": overhead}
        return compare(rows, FALLBACK_PRICES, None, run_steps)

    short = sweep()
    alone, hosts = short["configurations"]
    assert alone["spec_steps"] == hosts["spec_steps"] == TF["hyperparameters"]["steps"] and hosts["steps_trained"] == 500
    assert (alone["billable_seconds"], hosts["billable_seconds"]) == (400, 900)
    assert hosts["run_cost_usd"] == pytest.approx(900 / 3600 * hosts["usd_per_hour"], abs=1e-4)
    # Its own run: the whole bill over the 500 steps it trained.
    assert hosts["cost_per_1k_steps_with_startup_usd"] == pytest.approx(900 / 3600 * hosts["usd_per_hour"] * 1000 / 500, rel=1e-5)
    assert hosts["cost_per_1k_steps_usd"] < alone["cost_per_1k_steps_usd"]  # the steady state favours the data hosts
    assert short["recommended"] == "resnet50-hetero-d0" and "each configuration's own run" in short["recommendation_basis"]
    long = sweep(run_steps=1_000_000)  # a long run: the overhead hardly counts
    (_, long_hosts) = long["configurations"]
    expected = long_hosts["cost_per_1k_steps_usd"] + 857 / 3600 * long_hosts["usd_per_hour"] * 1000 / 1_000_000
    assert long_hosts["cost_per_1k_steps_with_startup_usd"] == pytest.approx(expected, rel=1e-5)
    assert long["recommended"] == "resnet50-hetero-d2" and "1,000,000-step runs" in long["recommendation_basis"]
    markdown = render_markdown(long, "t")
    assert "| billed s | run $ | $ per 1k steps with start-up |" in markdown and "Compared by the cost per 1k steps of 1,000,000-step" in markdown
    unknown = outcomes({0: 192.0, 2: 86.0})  # no whole bill in the results: the steady state, naming them
    report = compare(unknown, FALLBACK_PRICES, None)
    assert report["recommended"] == "resnet50-hetero-d2" and report["recommendation_basis"].startswith("the steady-state cost per 1k steps")
    assert "resnet50-hetero-d0, resnet50-hetero-d2 has no whole bill" in report["recommendation_basis"]
    with pytest.raises(SweepSpecError, match="run_steps: must be a whole number"):
        plan_sweep({"sweep_name": "s", "base": TF, "data_hosts": [0], "run_steps": 0})
    assert plan_sweep({"sweep_name": "s", "base": TF, "data_hosts": [0], "run_steps": 5000}).to_json()["run_steps"] == 5000
