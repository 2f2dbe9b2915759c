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
from dataclasses import dataclass

# Polls one run may make, whatever its runtime and however many capacity relaunches: with the worst case
# of every poll retried and caught (tests/workflows/test_history.py), far below 25,000 events.
MAX_POLLS = 700
# Each capacity relaunch waits twice as long as the one before, up to this.
RELAUNCH_BACKOFF_CAP_S = 1800


@dataclass(frozen=True)
class RetrySchedule:
    """A state's Retry (infra/constructs/training_workflow.py builds it from this), doubling each time."""

    errors: tuple[str, ...]
    interval_s: int
    attempts: int
    max_delay_s: int = 0  # 0: no cap

    def longest_wait_s(self) -> int:
        """All the waits of a state that fails every retried attempt."""
        waits = (self.interval_s * 2**attempt for attempt in range(self.attempts))
        return sum(min(wait, self.max_delay_s) if self.max_delay_s else wait for wait in waits)


# A launch (and a relaunch) retries throttling, and the capacity or quota errors CreateTrainingJob returns.
LAUNCH_RETRIES = (RetrySchedule(("LaunchThrottled",), 10, 6), RetrySchedule(("CapacityUnavailable",), 300, 4))
# A poll retries anything, briefly (each attempt costs history events), then counts as a failed poll.
POLL_RETRY = RetrySchedule(("States.ALL",), 5, 3, max_delay_s=60)
STOP_RETRY = RetrySchedule(("States.ALL",), 2, 4, max_delay_s=30)
STOP_POLL_RETRY = RetrySchedule(("States.ALL",), 5, 2)
DECIDE_RELAUNCH_RETRY = RetrySchedule(("States.ALL",), 5, 3, max_delay_s=60)
# Collecting a finished job's result is retried on anything but the two errors no retry can mend (another
# run's result at our key; a spec that cannot be read): a throttled Describe, an S3 5xx past botocore's own
# retries, a dropped connection or the function's timeout must not turn a paid run into a write-once
# "Failed" result. Four and a half minutes of waits in all.
COLLECT_FINAL_ERRORS = ("ResultExistsError", "JobSpecError")
COLLECT_RETRY = RetrySchedule(("States.ALL",), 10, 5, max_delay_s=120)
# After stopping a job: up to STOP_POLLS checks, a poll interval apart, for a terminal status (SageMaker
# gives the container 120 s after SIGTERM, then uploads its outputs: 12 minutes at the default 60 s).
STOP_POLLS = 12
# Every Lambda task of the run: the longest function timeout (collect's) and the Lambda service-error
# retries CDK adds to each (2 s doubling, 6 attempts: 126 s of waits, 7 invocations).
LAMBDA_TIMEOUT_S = 60
LAMBDA_SERVICE_RETRY = RetrySchedule(("Lambda.ServiceException",), 2, 6)
# A Task's own call (DescribeTrainingJob, a Lambda invoke), at most.
CALL_S = 10


def lambda_task_s(attempts: int = 1) -> int:
    """The longest a Lambda task state takes, over ``attempts`` of its own Retry's attempts."""
    return attempts * ((1 + LAMBDA_SERVICE_RETRY.attempts) * LAMBDA_TIMEOUT_S + LAMBDA_SERVICE_RETRY.longest_wait_s())


def launch_retry_s() -> int:
    """The longest one launch takes, every retried attempt failing but the last."""
    attempts = 1 + sum(schedule.attempts for schedule in LAUNCH_RETRIES)
    return sum(schedule.longest_wait_s() for schedule in LAUNCH_RETRIES) + lambda_task_s(attempts)


def poll_plan(max_runtime_s: int, grace_s: int, poll_interval_s: int, start_timeout_s: int = 0) -> tuple[int, int, int]:
    """(seconds between polls, polls once training, polls before it): the configured interval, or a
    longer one when both windows together would take more than MAX_POLLS. Rounded up: a deadline only
    ever errs late."""
    window = max_runtime_s + grace_s
    interval = max(poll_interval_s, math.ceil((window + start_timeout_s) / (MAX_POLLS - 1)))
    return interval, math.ceil(window / interval), math.ceil(start_timeout_s / interval)


def next_backoff_s(backoff_s: int) -> int:
    """The wait before the relaunch after one that waited ``backoff_s``."""
    return min(backoff_s * 2, RELAUNCH_BACKOFF_CAP_S)


def relaunch_backoffs_s(first_backoff_s: int, relaunches: int) -> list[int]:
    """The wait before each capacity relaunch."""
    waits = [first_backoff_s] if relaunches else []
    while len(waits) < relaunches:
        waits.append(next_backoff_s(waits[-1]))
    return waits


def worst_case_run_s(
    *, max_runtime_s: int, grace_s: int, poll_interval_s: int, start_timeout_s: int, relaunches: int, first_backoff_s: int,
) -> int:
    """The longest a run can take end to end, every retry of every state taken to its last attempt: every
    poll of both budgets (plus, per launch, the poll that finds its job failed) with its retries, every
    relaunch's decision and backoff, every launch's retries, validation, the stop and the wait for the
    stopped job, and the collect with its retries followed by the failure's record with its own."""
    interval, polls, start_polls = poll_plan(max_runtime_s, grace_s, poll_interval_s, start_timeout_s)
    poll_s = interval + CALL_S * POLL_RETRY.attempts + POLL_RETRY.longest_wait_s() + CALL_S
    polling = (polls + start_polls + 1 + relaunches) * poll_s
    deciding = relaunches * (lambda_task_s(1 + DECIDE_RELAUNCH_RETRY.attempts) + DECIDE_RELAUNCH_RETRY.longest_wait_s())
    stopping = (lambda_task_s(1 + STOP_RETRY.attempts) + STOP_RETRY.longest_wait_s()
                + (STOP_POLLS + 1) * (poll_interval_s + CALL_S * (1 + STOP_POLL_RETRY.attempts) + STOP_POLL_RETRY.longest_wait_s()))
    collecting = lambda_task_s(1 + COLLECT_RETRY.attempts) + COLLECT_RETRY.longest_wait_s()
    return (lambda_task_s() + polling + deciding + sum(relaunch_backoffs_s(first_backoff_s, relaunches))
            + launch_retry_s() * (1 + relaunches) + stopping + 2 * collecting)
