"""The platform's settings (infra/config.py): what a deployment may set, refused by name when it cannot
work, and the training run's timeout, which must outlast the longest run the platform accepts."""

from __future__ import annotations

import pytest

from infra.config import PlatformConfig, PlatformConfigError
from lambdas.core.deadlines import poll_plan, worst_case_run_s
from lambdas.core.job_spec import MAX_RUNTIME_S


def test_the_run_timeout_outlasts_the_longest_run_the_platform_accepts() -> None:
    """A 5-day spec whose job takes the whole start window, relaunched for capacity as often as allowed,
    every launch retried to its last attempt, then stopped: its execution must still end on its own (a
    timed-out execution writes no result)."""
    for settings in ({}, {"start_timeout_s": 24 * 3600, "capacity_relaunches": 5, "capacity_backoff_s": 1800}, {"poll_interval_s": 3600}):
        config = PlatformConfig(**settings)
        interval, polls, start_polls = poll_plan(MAX_RUNTIME_S, config.deadline_grace_s, config.poll_interval_s, config.start_timeout_s)
        polling = (polls + start_polls) * interval
        assert polling >= MAX_RUNTIME_S + config.deadline_grace_s + config.start_timeout_s  # the budgets cover their windows
        assert config.run_timeout_s >= config.worst_case_run_s() > polling
    assert PlatformConfig().run_timeout_s / 3600 == 130  # 120 h of runtime, 2 h to start, grace, 4 launches retried ~1.4 h each
    with pytest.raises(PlatformConfigError, match="run_timeout_h 122 is shorter than the longest run"):
        PlatformConfig(run_timeout_h=122)
    assert PlatformConfig(run_timeout_h=200).run_timeout_s == 200 * 3600


def test_worst_case_counts_every_relaunch_and_retry() -> None:
    base = dict(max_runtime_s=3600, grace_s=900, poll_interval_s=60, start_timeout_s=7200, first_backoff_s=120)
    assert worst_case_run_s(**base, relaunches=3) - worst_case_run_s(**base, relaunches=0) == (
        3 * 60 + (120 + 240 + 480) + 3 * (10 * 63 + 300 * 15)  # a failed poll, a backoff and a launch's retries each
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"input_buckets": "my-bucket"}, "input_buckets must be a list of S3 bucket names"),
        ({"input_buckets": ["Not_A_Bucket"]}, "input_buckets must be a list of S3 bucket names"),
        ({"run_cost_ceiling_usd": 0}, "run_cost_ceiling_usd must be a positive number"),
        ({"start_timeout_s": 60}, "start_timeout_s must be in 600..86400"),
        ({"capacity_relaunches": 9}, "capacity_relaunches must be in 0..5"),
        ({"ceiling_prices_usd_per_hour": {"ml.trn2.48xlarge": -1}}, "ceiling_prices_usd_per_hour must map"),
        ({"poll_intervall_s": 60}, "unknown platform settings"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(raw: dict, message: str) -> None:
    with pytest.raises(PlatformConfigError, match=message):
        PlatformConfig.from_context(raw)


def test_configured_ceiling_prices_add_to_the_defaults() -> None:
    config = PlatformConfig.from_context({"ceiling_prices_usd_per_hour": {"ml.trn2.48xlarge": 50.0}})
    assert config.ceiling_prices_usd_per_hour == {"ml.trn1.2xlarge": 1.5484, "ml.trn1.32xlarge": 24.7726, "ml.trn2.48xlarge": 50.0}
    assert PlatformConfig.from_context({"input_buckets": ["team-datasets"]}).input_buckets == ("team-datasets",)
