"""The sizing advisor against the emulated cluster (training/local/sizing.py), and the CPU quotas it
relies on (training/local/cpu_quota.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdas.core.job_spec import validate_job_spec
from training.local.cluster import EmulationError, EmulationOptions, plan_hosts
from training.local.cpu_quota import available as quotas_available
from training.local.sizing import base_spec, run_check

needs_quotas = pytest.mark.skipif(not quotas_available(), reason="needs a writable cgroup CPU controller")


def test_quotas_are_planned_per_group_and_bad_ones_refused(tmp_path: Path) -> None:
    spec = validate_job_spec(base_spec(steps=10))
    hosts = plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"data_group": 0.25}), [0, 1], 5)
    assert {host.role: host.cpu_quota for host in hosts} == {"data": 0.25, "dnn": None}
    with pytest.raises(EmulationError, match="--cpu-quota names groups \\['gpu_group'\\]"):
        plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"gpu_group": 0.5}), [0, 1], 5)
    with pytest.raises(EmulationError, match="between 0.01 and the group's CPUs"):
        plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}, cpu_quota={"data_group": 1.5}), [0, 1], 5)


@needs_quotas
@pytest.mark.cluster
def test_the_advisor_predicts_the_data_hosts_the_emulated_cluster_needs(tmp_path: Path) -> None:
    check = run_check(tmp_path, steps=70)
    print(check.render())  # the figures, for the record (pytest -s)
    fewer, predicted = check.measurements[0], check.measurements[-1]
    assert predicted.data_hosts == check.predicted and not predicted.input_bound
    if fewer.data_hosts < predicted.data_hosts:
        assert fewer.input_bound  # one host fewer than predicted cannot keep up
    assert check.measured == check.predicted
