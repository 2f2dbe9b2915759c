"""The suite's own cost accounting (tests/timing.py): what build/test-times.json holds, and the budget
check `make test` runs, which must fail a session that passes it and name what is slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import Budget, CpuSample, compare, machine_cpu_seconds, others_share, over_budget, summarise, table

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]


def test_times_add_up_per_file_and_the_slowest_come_first() -> None:
    times = summarise({"tests/a.py::one": 3.0, "tests/a.py::two": 1.0, "tests/b.py::three": 5.0}, wall_s=7.04, outcome_counts={"passed": 3})
    assert times["wall_s"] == 7.0 and times["test_s"] == 9.0 and times["tests"] == 3
    assert times["files"] == [{"file": "tests/b.py", "s": 5.0, "tests": 1}, {"file": "tests/a.py", "s": 4.0, "tests": 2}]
    assert [entry["test"] for entry in times["slowest"]] == ["tests/b.py::three", "tests/a.py::one", "tests/a.py::two"]
    assert "| `tests/b.py` | 1 | 5.0 |" in table(times)


def test_two_runs_compare_per_file_with_files_only_one_run_has() -> None:
    before = summarise({"tests/a.py::one": 30.0, "tests/gone.py::x": 4.0}, wall_s=40, outcome_counts={})
    after = summarise({"tests/a.py::one": 10.0, "tests/a.py::two": 1.0, "tests/new.py::y": 2.0}, wall_s=12, outcome_counts={})
    rows = compare(before, after).splitlines()
    assert "| tests | 2 | 3 |" in rows and "| wall time, s | 40 | 12 |" in rows
    files = [row for row in rows if row.startswith("| `")]
    assert files == ["| `tests/a.py` | 30.0 (1) | 11.0 (2) |", "| `tests/gone.py` | 4.0 (1) | – |", "| `tests/new.py` | – | 2.0 (1) |"]


def test_the_budget_names_the_slowest_files_and_every_test_past_its_limit() -> None:
    times = summarise({"tests/a.py::one": 30.0, "tests/b.py::two": 200.0}, wall_s=1600, outcome_counts={})
    assert over_budget(times, Budget(session_s=1700, test_s=250)) == []
    session, test = over_budget(times, Budget(session_s=1500, test_s=120))
    assert "1600 s, over its budget of 1500 s" in session and "tests/b.py 200 s, tests/a.py 30 s" in session
    assert test == "1 test(s) over the per-test limit of 120 s: tests/b.py::two 200 s"


def test_the_budget_is_checked_against_the_time_the_machines_other_load_left() -> None:
    """The same suite on a machine whose neighbours take a third of it fits the budget it fits when quiet,
    and one that is slow on its own does not."""
    times = summarise({"tests/a.py::one": 150.0}, wall_s=1800, outcome_counts={}, others=1 / 3)
    assert times["load_free_wall_s"] == 1200.0
    assert over_budget(times, Budget(session_s=1500, test_s=120)) == []
    quiet = summarise({"tests/a.py::one": 150.0}, wall_s=1800, outcome_counts={}, others=0.0)
    session, test = over_budget(quiet, Budget(session_s=1500, test_s=120))
    assert "1800 s, over its budget" in session and "tests/a.py::one 150 s" in test
    loaded = over_budget(summarise({"t.py::x": 1.0}, wall_s=2400, outcome_counts={}, others=0.25), Budget(session_s=1500, test_s=120))
    assert loaded == ["the suite took 1800 s (2400 s measured, 25% of the machine used by others), over its budget of 1500 s; "
                      "slowest files: t.py 1 s"]


def test_others_share_is_the_machines_busy_and_stolen_time_less_the_sessions_own() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    assert machine_cpu_seconds(f"cpu  {300 * tick} {10 * tick} {90 * tick} 5000 7 0 3 {20 * tick} 0 0\ncpu0 1 2 3\n") == (400.0, 20.0)
    start, end = CpuSample(busy_s=1000, stolen_s=50, own_s=10), CpuSample(busy_s=1150, stolen_s=70, own_s=110)
    assert others_share(start, end, wall_s=100, cpus=2) == pytest.approx((150 - 100 + 20) / 200)
    assert others_share(start, CpuSample(1050, 50, 110), wall_s=100, cpus=2) == 0.0  # own more than busy: counters' skew
    assert others_share(start, end, wall_s=0, cpus=2) == 0.0


def test_a_session_counts_its_workers_cpu_as_its_own_and_a_neighbours_as_others(pytester: pytest.Pytester,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under xdist, a test's reaped child's CPU reaches the controller as the session's own; a process
    outside the session (a busy loop this test starts) is others' load."""
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"
    pytester.makepyfile(test_burn=f"import subprocess, sys\n\ndef test_burn():\n    subprocess.run([sys.executable, '-c', {burn!r}], check=True)\n")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    times_file = pytester.path / "times.json"
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert pytester.runpytest_subprocess("-p", "tests.timing", "-n", "2", "--test-times", str(times_file)).ret == 0
    finally:
        neighbour.kill()
        neighbour.wait()
    times = json.loads(times_file.read_text())
    assert times["own_cpu_s"] >= 1.0
    assert times["others_share"] >= 0.25 and times["load_free_wall_s"] < times["wall_s"]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_session_past_its_budget_fails_and_writes_its_times(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]) -> None:
    """A real pytest run with the plugin: the times file holds every test (reported by xdist's workers to
    the controller), and --check-time-budget turns a passing session over budget into a failed one."""
    pytester.makepyfile(test_small="import time\n\ndef test_a():\n    time.sleep(0.2)\n\ndef test_b():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    times_file = pytester.path / "times.json"
    within = pytester.runpytest_subprocess("-p", "tests.timing", *workers, "--test-times", str(times_file), "--check-time-budget",
                                           "-o", "time_budget_s=600", "-o", "test_time_limit_s=60")
    assert within.ret == 0
    times = json.loads(times_file.read_text())
    assert times["tests"] == 2 and times["files"][0]["file"] == "test_small.py" and times["slowest"][0]["test"] == "test_small.py::test_a"
    assert times["slowest"][0]["s"] >= 0.2 and times["outcomes"] == {"passed": 2}
    over = pytester.runpytest_subprocess("-p", "tests.timing", *workers, "--test-times", str(times_file), "--check-time-budget",
                                         "-o", "time_budget_s=600", "-o", "test_time_limit_s=0.01")
    assert over.ret == 1
    over.stdout.fnmatch_lines(["*TIME BUDGET: * test(s) over the per-test limit of 0.01 s*: test_small.py::test_a*"])


def test_a_budget_check_without_the_budget_in_the_settings_is_refused_before_any_test(pytester: pytest.Pytester,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is written once, in pyproject.toml: a session told to check it where it is not set stops."""
    pytester.makepyfile(test_small="def test_a():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    refused = pytester.runpytest_subprocess("-p", "tests.timing", "--check-time-budget", "-o", "time_budget_s=600")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--check-time-budget needs test_time_limit_s in the pytest settings*"])
