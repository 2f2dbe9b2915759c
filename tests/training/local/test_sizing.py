"""The sizing advisor against the emulated cluster (training/local/sizing.py), and the CPU quotas it
relies on (training/local/cpu_quota.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdas.core.job_spec import validate_job_spec
from training.local.cluster import EmulationError, EmulationOptions, plan_hosts
from training.local.cpu_quota import available as quotas_available
from training.local.sizing import CheckScale, base_spec, run_check

needs_quotas = pytest.mark.skipif(not quotas_available(), reason="needs a writable cgroup CPU controller")


def test_quotas_are_planned_per_group_and_bad_ones_refused(tmp_path: Path) -> None:
    spec = validate_job_spec(base_spec(CheckScale(steps=10)))
    hosts = plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"data_group": 0.25}), [0, 1], 5)
    assert {host.role: host.cpu_quota for host in hosts} == {"data": 0.25, "dnn": None}
    with pytest.raises(EmulationError, match="--cpu-quota names groups \\['gpu_group'\\]"):
        plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"gpu_group": 0.5}), [0, 1], 5)
    with pytest.raises(EmulationError, match="between 0.01 and the group's CPUs"):
        plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"data_group": 1.5}), [0, 1], 5)


@needs_quotas
@pytest.mark.cluster
def test_the_sizing_check_runs_the_predicted_count_and_the_one_below(tmp_path: Path) -> None:
    """The check's plumbing, end to end: profile, quota, prediction, and a measured run per count. Whether
    the measurement agrees with the prediction depends on this machine's load, so that comparison is a
    benchmark (`make bench` runs `python -m training.local.sizing`), not a test."""
    # The plumbing, not a steady figure: 6 timed steps a run, of small batches. The quota throttles a data
    # host's start (its imports, its workers') as much as its batches, so the test keeps the quota high
    # (~0.35 core: large source images make each batch's preprocessing heavy next to the small batch's
    # step); at ~0.1 core the hosts' start alone took a minute a run.
    check = run_check(tmp_path, CheckScale(steps=10, batch_size=8, source_image_size=640, images_per_class=8, profile_batches=4))
    print(check.render())  # the figures, for the record (pytest -s)
    assert check.predicted >= 1 and 0.05 <= check.quota_cores <= 0.45
    counts = [measurement.data_hosts for measurement in check.measurements]
    assert counts == sorted({max(1, check.predicted - 1), check.predicted})
    for measurement in check.measurements:
        assert measurement.step_ms > 0 and 0 <= measurement.data_wait_ms <= measurement.step_ms
        assert measurement.input_bound == (measurement.data_wait_ms > 0.15 * measurement.step_ms)
    assert f"the advisor predicts {check.predicted} data hosts" in check.render()
