"""Step Functions fails an execution at 25,000 history events. The training run's worst case, computed
from the synthesized definition for the longest runtime SageMaker allows, with every poll retried to
the last attempt, stays far below it; and the model of events per state is checked against a real run
in moto's interpreter."""

from __future__ import annotations

from lambdas.core.deadlines import MAX_POLLS, poll_plan
from tests.infra.conftest import state_machine_definition
from tests.workflows.conftest import SPEC, Scenario

HISTORY_LIMIT = 25_000
# Events a state adds to the history: entered and exited, and for a task its scheduled, started and
# succeeded (each retried attempt: scheduled, started, failed).
EVENTS = {"Task": 5, "Wait": 2, "Choice": 2, "Pass": 2, "Succeed": 2, "Fail": 1}
ATTEMPT_EVENTS = 3
POLL_LOOP = ("Wait", "Describe job", "Poll failed", "Job finished?", "Count down")
START_POLL = "Count down the start"  # instead of "Count down" while the job starts
STOP_LOOP = ("Wait for stop", "Describe stopping job", "Stopped yet?", "Count down the stop")
# One capacity relaunch: the failed job's reason, the decision, the backoff, the relaunch.
RELAUNCH = ("Decide relaunch", "Capacity to retry?", "Back off", "Relaunch job")
RELAUNCHES = 5  # the most infra/config.py allows
LONGEST_RUNTIME_S = 28 * 24 * 3600  # SageMaker's longest MaxRuntimeInSeconds (the validator allows 5 days)


def worst_events(state: dict) -> int:
    retries = sum(retrier.get("MaxAttempts", 3) for retrier in state.get("Retry", []))
    return EVENTS[state["Type"]] + ATTEMPT_EVENTS * retries


def test_the_worst_case_history_of_the_longest_run_stays_far_below_the_limit(platform) -> None:
    states = state_machine_definition(platform)["States"]
    per_poll = sum(worst_events(states[name]) for name in POLL_LOOP)
    assert worst_events(states[START_POLL]) == worst_events(states["Count down"])
    stop_polls = states["Await stop"]["Parameters"]["polls_left"]
    stopping = sum(worst_events(states[name]) for name in STOP_LOOP) * stop_polls
    relaunches = sum(worst_events(states[name]) for name in RELAUNCH) * RELAUNCHES
    outside = stopping + relaunches + sum(
        worst_events(state) for name, state in states.items() if name not in POLL_LOOP + STOP_LOOP + RELAUNCH + (START_POLL,)
    )
    # Poll budgets are the run's, carried over by every relaunch: their sum bounds the polls.
    _, polls, start_polls = poll_plan(LONGEST_RUNTIME_S, 900, 1, 24 * 3600)
    assert polls + start_polls <= MAX_POLLS
    worst = 2 + outside + per_poll * (polls + start_polls)  # + ExecutionStarted and its end
    print(f"\n[history] worst case {worst} events ({per_poll} per poll × {polls + start_polls} polls + {outside}); limit {HISTORY_LIMIT}")
    assert worst < 0.8 * HISTORY_LIMIT


def test_the_event_model_matches_a_real_run(run, platform) -> None:
    harness = run(Scenario(runs_for_s=12, summary={"timed_steps": 100, "step_time_ms": {"p50": 90.0, "p90": 95.0, "mean": 91.0}}))
    execution_arn = harness.start(SPEC, "run-history")  # polls every second
    assert harness.wait(execution_arn, timeout_s=120)["status"] == "SUCCEEDED"
    events = harness.sfn.get_execution_history(executionArn=execution_arn, maxResults=1000)["events"]
    polls = sum(1 for event in events if event["type"] == "WaitStateEntered")
    states = state_machine_definition(platform)["States"]
    normal_poll = sum(EVENTS[states[name]["Type"]] for name in ("Wait", "Describe job", "Job finished?", "Count down"))
    path = ("Validate spec", "Launch job", "Collect results", "Figures usable?", "Succeeded")
    modelled = 2 + sum(EVENTS[states[name]["Type"]] for name in path) + normal_poll * polls - EVENTS["Pass"]  # the last poll counts down no more
    assert polls >= 3 and len(events) <= modelled, (len(events), modelled, polls, [e["type"] for e in events])
    assert len(events) == modelled  # the model is exact on the path it takes
