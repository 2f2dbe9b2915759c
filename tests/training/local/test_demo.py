"""The demo's arithmetic, its guard against a busy machine, and the demo itself end to end at a small size."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from lambdas.core.job_spec import validate_job_spec
from training.local.demo import (
    BUSY_CORES,
    Comparison,
    RunFigures,
    combined,
    disturbance,
    interleaved,
    main,
    priced,
    render,
    write_report,
)
from training.local.profile import Profile

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def figures(label: str, spec_file: str, step_ms: float) -> RunFigures:
    return RunFigures(label, validate_job_spec(json.loads((EXAMPLES / spec_file).read_text())), step_ms, 32_000 / step_ms)


def test_ideal_step_is_the_slower_half_once_preprocessing_moves_out() -> None:
    profile = Profile(preprocess_ms_per_batch=60, train_ms_per_step=40)
    assert profile.ideal_step_ms(0) == 100  # same CPU: the halves add up
    assert profile.ideal_step_ms(1) == 60  # preprocessing-bound
    assert profile.ideal_step_ms(2) == 40  # two data hosts: training-bound


def test_comparison_figures_and_table() -> None:
    comparison = Comparison(
        Profile(60, 40),
        figures("homogeneous", "pytorch-homogeneous.json", 100),
        figures("heterogeneous", "pytorch-heterogeneous.json", 63),
    )
    assert comparison.speed_up == pytest.approx(100 / 63)
    assert comparison.ideal_speed_up == pytest.approx(100 / 60)
    assert comparison.offload_efficiency == pytest.approx(63 / 60)
    # $/h 3.825 vs 5.661 (+1× ml.c5.9xlarge): 0.10625 vs 0.09907 per 1k steps, 7% cheaper.
    assert comparison.homogeneous.cost_per_1k_steps == pytest.approx(3.825 * 0.1 / 3.6)
    table = render(comparison)
    assert "homogeneous: 1× ml.p3.2xlarge" in table and "1× ml.c5.9xlarge + 1× ml.p3.2xlarge" in table
    assert "7% lower cost per step" in table and "EMULATED" in table
    assert "heterogeneous median step / ideal step = 1.050" in table
    # Priced by the billed step (evaluations and checkpoints in it), compared with the ideal by its median.
    stalling = Comparison(Profile(60, 40), comparison.homogeneous, dataclasses.replace(comparison.heterogeneous, step_ms=70, p50_ms=61.5))
    assert stalling.offload_efficiency == pytest.approx(61.5 / 60)
    assert stalling.heterogeneous.cost_per_1k_steps > comparison.heterogeneous.cost_per_1k_steps
    # 60 ms for the example's batch of 64: what the sizing advisor takes as samples_per_s_per_vcpu.
    assert "(1067 samples/s per vCPU" in table


def test_the_demo_writes_the_sweep_report_with_emulated_prices(tmp_path: Path) -> None:
    comparison = Comparison(
        Profile(60, 40),
        figures("homogeneous", "pytorch-homogeneous.json", 1193),
        figures("heterogeneous", "pytorch-heterogeneous.json", 184),
    )
    report_json, report_md, chart, markdown = write_report(comparison, tmp_path / "report", "Emulated pytorch sweep")
    report = json.loads(report_json.read_text())
    assert report["recommended"] == "heterogeneous" and report["baseline"] == "homogeneous"
    assert round(report["configurations"][1]["improvement_vs_baseline"] * 100) == 77  # the same arithmetic as the cloud's
    assert report["prices"]["source"].startswith("EMULATED") and report_md.read_text() == markdown
    assert "| heterogeneous **(recommended)** | 1× ml.c5.9xlarge + 1× ml.p3.2xlarge |" in markdown
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_data_hosts_sharing_a_core_count_once_in_the_ideal() -> None:
    comparison = Comparison(
        Profile(60, 40),
        figures("homogeneous", "tensorflow-homogeneous.json", 100),
        figures("heterogeneous", "tensorflow-heterogeneous.json", 63),
        effective_data_hosts=1.0,  # the spec's 2 data hosts share one core here
    )
    assert comparison.heterogeneous.data_hosts == 2
    assert comparison.ideal_speed_up == pytest.approx(100 / 60)  # not 100 / 40, as 2 real hosts would give
    assert "with 1 data hosts' worth of CPUs" in render(comparison)


@pytest.mark.cluster
def test_the_tensorflow_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--variant", "tensorflow", "--workdir", str(tmp_path), "--steps", "16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "homogeneous: 1× ml.p4d.24xlarge" in out and "heterogeneous: 2× ml.c5.18xlarge + 1× ml.p4d.24xlarge" in out
    assert re.search(r"preprocessing \d+\.\d ms/batch", out) and "EMULATED" in out


def test_rounds_interleave_and_each_figure_is_the_median_rounds() -> None:
    assert interleaved(3) == [("homogeneous", 0), ("heterogeneous", 0), ("heterogeneous", 1), ("homogeneous", 1),
                              ("homogeneous", 2), ("heterogeneous", 2)]
    spec = figures("x", "pytorch-heterogeneous.json", 1).spec
    runs = [RunFigures("heterogeneous", spec, ms, 1000 / ms, ms - 1) for ms in (70.0, 50.0, 60.0)]
    figure = combined("heterogeneous", spec, runs)
    assert figure.step_ms == 60.0 and figure.p50_ms == 59.0 and figure.rounds_ms == (70.0, 50.0, 60.0)
    assert figure.spread == pytest.approx(20 / 60)


def test_a_busy_machine_or_rounds_that_disagree_give_no_recommendation(tmp_path: Path) -> None:
    steady = Comparison(Profile(60, 40), dataclasses.replace(figures("homogeneous", "pytorch-homogeneous.json", 100), rounds_ms=(99.0, 101.0)),
                        dataclasses.replace(figures("heterogeneous", "pytorch-heterogeneous.json", 23), rounds_ms=(23.0, 23.5)),
                        other_cores=0.05)
    assert disturbance(steady) is None
    *_, markdown = write_report(steady, tmp_path / "steady", "t")
    assert "**Recommended:** heterogeneous" in markdown
    busy = dataclasses.replace(steady, other_cores=BUSY_CORES + 0.5)
    assert "other programs used 0.75 CPUs" in disturbance(busy)
    drifting = dataclasses.replace(steady, heterogeneous=dataclasses.replace(steady.heterogeneous, rounds_ms=(23.0, 40.0)))
    assert "the heterogeneous rounds disagree by 54%" in disturbance(drifting)
    # The user's $/hour (--price) price both configurations, and the report says it.
    mine = priced(steady, {"ml.p3.2xlarge": 3.0})
    assert mine.homogeneous.usd_per_hour == 3.0 and mine.heterogeneous.usd_per_hour == pytest.approx(3.0 + 1.836)
    assert "given with --price for ml.p3.2xlarge" in render(mine)
    priced_json, *_ = write_report(mine, tmp_path / "priced", "t")
    assert "given with --price for ml.p3.2xlarge" in json.loads(priced_json.read_text())["prices"]["source"]
    report_json, _, _, markdown = write_report(busy, tmp_path / "busy", "t")
    report = json.loads(report_json.read_text())
    assert report["recommended"] is None and "other programs used" in report["disturbed"]
    assert report["measurement"]["other_cpus"] == 0.75 and "**No recommendation:** the measurement cannot back one: other programs used" in markdown
    assert "**Recommended:**" not in markdown and "spread" in render(busy)


@pytest.mark.cluster
def test_the_demo_runs_end_to_end_and_on_a_machine_that_others_load_says_it_is_too_busy(tmp_path: Path,
                                                                                        capsys: pytest.CaptureFixture) -> None:
    """The whole demo, one round of each configuration (the interleaving and the median of rounds:
    test_rounds_interleave_and_each_figure_is_the_median_rounds), while two programs outside its process
    tree spin on the CPUs: it prints every figure, validates the heterogeneous run's model, writes the
    report and chart, names the load and recommends nothing. What it recommends on a quiet machine is
    test_a_busy_machine_or_rounds_that_disagree_give_no_recommendation's steady case (a suite on 2 cores
    is never quiet enough to measure)."""
    import os
    import subprocess
    import sys

    # Double-forked (sh backgrounds them and exits): they are not the demo's descendants, as another user's job is not.
    # On the first CPUs, which the emulated DNN host and data host take (on a larger machine too).
    cpus = sorted(os.sched_getaffinity(0))[:2]
    spin = f"import os, time\nos.sched_setaffinity(0, {set(cpus)})\nend = time.time() + 600\nwhile time.time() < end: pass\n"
    marker = tmp_path / "spinners"
    subprocess.run(["sh", "-c", f"for i in 1 2; do {sys.executable} -c '{spin}' & echo $! >> {marker}; done"], check=True)
    try:
        assert main(["--workdir", str(tmp_path / "demo"), "--steps", "12", "--rounds", "1"]) == 0
    finally:
        for pid in marker.read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
    out = capsys.readouterr().out
    assert "homogeneous: 1× ml.p3.2xlarge" in out and "heterogeneous: 1× ml.c5.9xlarge" in out
    assert "preprocessing" in out and "EMULATED" in out
    assert re.search(r"validation accuracy of the heterogeneous run's model: \d\.\d{3}", out)  # the built-in validates too
    assert "TOO BUSY TO MEASURE: other programs used" in out and "No recommendation from this run" in out
    assert "**Recommended:**" not in out
    report = tmp_path / "demo" / "report"
    assert (report / "report.md").exists() and (report / "chart.png").read_bytes().startswith(b"\x89PNG")
    figures = json.loads((report / "report.json").read_text())
    assert figures["recommended"] is None and figures["measurement"]["other_cpus"] > BUSY_CORES
