"""The platform's settings (infra/config.py): what a deployment may set, refused by name when it cannot
work, and the training run's timeout, which must outlast the longest run the platform accepts."""

from __future__ import annotations

import pytest

from infra.config import PlatformConfig, PlatformConfigError
from lambdas.core.deadlines import (
    DECIDE_RELAUNCH_RETRY,
    LAMBDA_SERVICE_RETRY,
    LAMBDA_TIMEOUT_S,
    LAUNCH_RETRIES,
    POLL_RETRY,
    STOP_POLL_RETRY,
    STOP_RETRY,
    lambda_task_s,
    launch_retry_s,
    poll_plan,
    worst_case_run_s,
)
from lambdas.core.job_spec import MAX_RUNTIME_S
from tests.infra.conftest import state_machine_definition


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
    # 120 h of runtime, 2 h to start, grace, every poll retried, 4 launches each retried to its last attempt,
    # the collect and the failure's record each retried to their last
    assert PlatformConfig().run_timeout_s / 3600 == 156
    with pytest.raises(PlatformConfigError, match="run_timeout_h 122 is shorter than the longest run"):
        PlatformConfig(run_timeout_h=122)
    assert PlatformConfig(run_timeout_h=200).run_timeout_s == 200 * 3600


def test_worst_case_counts_every_relaunch_and_retry() -> None:
    base = dict(max_runtime_s=3600, grace_s=900, poll_interval_s=60, start_timeout_s=7200, first_backoff_s=120)
    per_relaunch = worst_case_run_s(**base, relaunches=1) - worst_case_run_s(**base, relaunches=0)
    poll = 60 + 10 * 3 + POLL_RETRY.longest_wait_s() + 10  # the poll that finds the job failed, retried
    assert per_relaunch == poll + lambda_task_s(4) + DECIDE_RELAUNCH_RETRY.longest_wait_s() + 120 + launch_retry_s()
    assert launch_retry_s() > 10 * 63 + 300 * 15  # the retries' waits, and the invocations besides


def test_the_timeout_counts_the_retries_the_definition_has(template_json) -> None:
    """The schedules the worst case adds up are the ones the synthesized definition retries with."""
    states = state_machine_definition(template_json)["States"]

    def schedule_of(state: dict, errors: list[str]) -> tuple:
        (retry,) = [r for r in state["Retry"] if r["ErrorEquals"] == errors]
        return retry["IntervalSeconds"], retry["MaxAttempts"], retry.get("MaxDelaySeconds", 0)

    for name, schedule in (("Describe job", POLL_RETRY), ("Stop job", STOP_RETRY), ("Describe stopping job", STOP_POLL_RETRY),
                           ("Decide relaunch", DECIDE_RELAUNCH_RETRY), *(("Launch job", s) for s in LAUNCH_RETRIES),
                           *(("Relaunch job", s) for s in LAUNCH_RETRIES)):
        assert schedule_of(states[name], list(schedule.errors)) == (schedule.interval_s, schedule.attempts, schedule.max_delay_s), name
    lambda_retries = [r for r in states["Launch job"]["Retry"] if "Lambda.ServiceException" in r["ErrorEquals"]]
    assert [(r["IntervalSeconds"], r["MaxAttempts"]) for r in lambda_retries] == [(LAMBDA_SERVICE_RETRY.interval_s, LAMBDA_SERVICE_RETRY.attempts)]
    timeouts = [r["Properties"]["Timeout"] for r in template_json["Resources"].values() if r["Type"] == "AWS::Lambda::Function"
                and r["Properties"]["Handler"].split(".")[1] in ("validate_spec", "launch_job", "stop_job", "collect_results")]
    assert max(timeouts) == LAMBDA_TIMEOUT_S


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
