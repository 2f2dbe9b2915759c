"""How long a training run may take, and how it spends its polls. Pure.

A run polls DescribeTrainingJob with two budgets (lambdas/launch_job/handler.py): polls while the job
starts (the start window) and polls once it trains (the spec's max_runtime_s plus a grace period for
SageMaker to stop the job itself). Both together are bounded by MAX_POLLS, whatever the runtime: Step
Functions fails an execution at 25,000 history events, and each poll costs some, so a long runtime gets
a longer interval instead of more polls. Capacity relaunches carry the budgets over and wait a doubling
backoff in between.

``worst_case_run_s`` adds it all up for the longest spec: the training-run state machine's own timeout
must not cut short a run the platform accepts (its timed-out execution would write no result).
"""

from __future__ import annotations

import math

# Polls one run may make, whatever its runtime and however many capacity relaunches: with the worst case
# of every poll retried and caught (tests/workflows/test_history.py), far below 25,000 events.
MAX_POLLS = 700
# Each capacity relaunch waits twice as long as the one before, up to this.
RELAUNCH_BACKOFF_CAP_S = 1800
# What a launch (and a relaunch) retries, by error: (first interval in seconds, attempts), doubling.
LAUNCH_RETRIES = {"LaunchThrottled": (10, 6), "CapacityUnavailable": (300, 4)}
# After stopping a job: up to STOP_POLLS checks, a poll interval apart, for a terminal status (SageMaker
# gives the container 120 s after SIGTERM, then uploads its outputs: 12 minutes at the default 60 s).
STOP_POLLS = 12


def launch_retry_s() -> int:
    """The longest one launch's retries wait, all of them failing but the last."""
    return sum(interval * (2**attempts - 1) for interval, attempts in LAUNCH_RETRIES.values())


def poll_plan(max_runtime_s: int, grace_s: int, poll_interval_s: int, start_timeout_s: int = 0) -> tuple[int, int, int]:
    """(seconds between polls, polls once training, polls before it): the configured interval, or a
    longer one when both windows together would take more than MAX_POLLS. Rounded up: a deadline only
    ever errs late."""
    window = max_runtime_s + grace_s
    interval = max(poll_interval_s, math.ceil((window + start_timeout_s) / (MAX_POLLS - 1)))
    return interval, math.ceil(window / interval), math.ceil(start_timeout_s / interval)


def relaunch_backoffs_s(first_backoff_s: int, relaunches: int) -> list[int]:
    """The wait before each capacity relaunch."""
    return [min(first_backoff_s * 2**attempt, RELAUNCH_BACKOFF_CAP_S) for attempt in range(relaunches)]


def worst_case_run_s(
    *, max_runtime_s: int, grace_s: int, poll_interval_s: int, start_timeout_s: int, relaunches: int, first_backoff_s: int,
    tasks_s: int = 1800,
) -> int:
    """The longest a run can take end to end: every poll of both budgets (plus, per launch, the poll that
    finds its job failed), every relaunch's backoff, every launch's retries, the wait for a stopped job,
    and ``tasks_s`` for the Lambda tasks and their retries."""
    interval, polls, start_polls = poll_plan(max_runtime_s, grace_s, poll_interval_s, start_timeout_s)
    polling = (polls + start_polls + 1 + relaunches) * interval
    return (polling + sum(relaunch_backoffs_s(first_backoff_s, relaunches)) + launch_retry_s() * (1 + relaunches)
            + (STOP_POLLS + 1) * poll_interval_s + tasks_s)
