"""What the suite costs: each test file's and the slowest tests' wall times, and the budget they must fit.

A pytest plugin (registered in pyproject.toml's addopts) that adds up every test's setup, call and
teardown time as its report arrives (in the controller when pytest-xdist runs the suite) and, at the
session's end, writes ``build/test-times.json``: the session's wall time, the summed test time, the
number of tests, each file's total, the 30 slowest tests and every test's time. With
``--check-time-budget`` (``make test`` passes it) the session fails when its wall time passes ``time_budget_s`` or one test passes
``test_time_limit_s`` (both in pyproject.toml's pytest settings, the one place they are written), naming
the slowest files and tests, so a change that doubles a test's cost is seen at the stop it lands, not at
CI's 5,400 s cliff.

The budget is for the suite's own cost, not the machine's neighbours': the same commit took 1,353 s of
pytest time at one CI run and 2,057 s at the next. So the session also measures the CPU the machine
gave others while it ran (from /proc/stat: every CPU's user, nice and system time less this session's
own, xdist's reaped workers and their reaped children included, plus the time a hypervisor stole) and the budget is
checked against the wall time that load leaves (``wall × (1 − others' share)``): a quiet machine is
checked as measured, a machine whose neighbours took a third of it is granted a third more.

``python -m tests.timing [build/test-times.json]`` prints a run's table, and ``python -m tests.timing
--compare before.json after.json`` the before/after table docs/reference/development.md shows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TIMES_FILE = Path("build/test-times.json")
SLOWEST = 30


@dataclass(frozen=True)
class Budget:
    session_s: float  # the pytest session's wall time
    test_s: float  # any one test's setup + call + teardown


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds of the whole machine (user, nice and system on every CPU), stolen from it by
    its hypervisor, and spent by this session's own processes."""

    busy_s: float
    stolen_s: float
    own_s: float


def machine_cpu_seconds(stat: str) -> tuple[float, float]:
    """(busy, stolen) seconds from /proc/stat's aggregate ``cpu`` line. Pure."""
    fields = stat.splitlines()[0].split()
    assert fields[0] == "cpu", f"not /proc/stat: {stat[:40]!r}"
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (int(value) for value in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system) / tick, steal / tick


def own_cpu_seconds() -> float:
    """This process's CPU seconds and those of every child it reaped (a test's servers and hosts)."""
    mine = os.times()
    return mine.user + mine.system + mine.children_user + mine.children_system


def others_share(start: CpuSample, end: CpuSample, wall_s: float, cpus: int) -> float:
    """The fraction of the machine's CPU time others used or a hypervisor stole over ``wall_s``. Pure.

    A process this session started and did not reap (orphaned) counts as another's: the error is on the
    lenient side, and a quiet machine's share, measured, is ~0.01."""
    if wall_s <= 0 or cpus <= 0:
        return 0.0
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s) + (end.stolen_s - start.stolen_s)
    return min(0.9, max(0.0, others / (wall_s * cpus)))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def summarise(durations: dict[str, float], wall_s: float, outcome_counts: dict[str, int], others: float = 0.0,
              own_cpu_s: float = 0.0) -> dict[str, Any]:
    """The figures build/test-times.json holds, from each test's summed phase durations and the share of
    the machine others used meanwhile. Pure."""
    per_file: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    for nodeid, seconds in durations.items():
        per_file[file_of(nodeid)] += seconds
        tests[file_of(nodeid)] += 1
    files = sorted(per_file, key=per_file.__getitem__, reverse=True)
    slowest = sorted(durations, key=durations.__getitem__, reverse=True)[:SLOWEST]
    return {
        "wall_s": round(wall_s, 1),
        "own_cpu_s": round(own_cpu_s, 1),
        "others_share": round(others, 3),
        "load_free_wall_s": round(wall_s * (1 - others), 1),
        "test_s": round(sum(durations.values()), 1),
        "tests": len(durations),
        "outcomes": dict(sorted(outcome_counts.items())),
        "files": [{"file": name, "s": round(per_file[name], 1), "tests": tests[name]} for name in files],
        "slowest": [{"test": nodeid, "s": round(durations[nodeid], 1)} for nodeid in slowest],
        "every_test_s": {nodeid: round(seconds, 2) for nodeid, seconds in sorted(durations.items())},
    }


def over_budget(times: dict[str, Any], budget: Budget) -> list[str]:
    """What passes the budget, each as a line naming the cost's biggest parts; empty when it fits. Pure."""
    problems = []
    kept = 1 - times.get("others_share", 0.0)  # what the machine's other load left this session
    load = f" ({times['wall_s']:.0f} s measured, {times['others_share']:.0%} of the machine used by others)" if kept < 0.99 else ""
    if times["load_free_wall_s"] > budget.session_s:
        top = ", ".join(f"{entry['file']} {entry['s']:.0f} s" for entry in times["files"][:5])
        problems.append(f"the suite took {times['load_free_wall_s']:.0f} s{load}, over its budget of {budget.session_s:g} s; "
                        f"slowest files: {top}")
    slow = [entry for entry in times["slowest"] if entry["s"] * kept > budget.test_s]
    if slow:
        named = ", ".join(f"{entry['test']} {entry['s'] * kept:.0f} s" for entry in slow)
        problems.append(f"{len(slow)} test(s) over the per-test limit of {budget.test_s:g} s{load}: {named}")
    return problems


def table(times: dict[str, Any], files: int = 60) -> str:
    """A markdown table of the files' times and the slowest tests. Pure."""
    lines = [
        f"{times['tests']} tests, {times['wall_s']:.0f} s of wall time, {times['test_s']:.0f} s of test time, "
        f"{times.get('others_share', 0.0):.0%} of the machine used by others meanwhile",
        "",
        "| file | tests | s |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{entry['file']}` | {entry['tests']} | {entry['s']:.1f} |" for entry in times["files"][:files]]
    lines += ["", "| slowest tests | s |", "|---|---:|"]
    lines += [f"| `{entry['test']}` | {entry['s']:.1f} |" for entry in times["slowest"]]
    return "\n".join(lines)


def compare(before: dict[str, Any], after: dict[str, Any], files: int = 25) -> str:
    """A markdown table of two runs' totals and per-file times, biggest first by the earlier run. Pure."""
    old = {entry["file"]: entry for entry in before["files"]}
    new = {entry["file"]: entry for entry in after["files"]}
    names = sorted(old.keys() | new.keys(), key=lambda name: old.get(name, new.get(name, {"s": 0}))["s"], reverse=True)

    def cell(entry: dict[str, Any] | None) -> str:
        return f"{entry['s']:.1f} ({entry['tests']})" if entry else "–"

    lines = [
        "| | before | after |",
        "|---|---:|---:|",
        f"| tests | {before['tests']} | {after['tests']} |",
        f"| wall time, s | {before['wall_s']:.0f} | {after['wall_s']:.0f} |",
        f"| summed test time, s | {before['test_s']:.0f} | {after['test_s']:.0f} |",
        "",
        "| file | before, s (tests) | after, s (tests) |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{name}` | {cell(old.get(name))} | {cell(new.get(name))} |" for name in names[:files]]
    return "\n".join(lines)


def pytest_addoption(parser: pytest.Parser) -> None:
    # No defaults: the budget is written once, in pyproject.toml (a second copy here drifted from it).
    parser.addini("time_budget_s", "the suite's wall-time budget in seconds (--check-time-budget)", default="")
    parser.addini("test_time_limit_s", "one test's limit in seconds (--check-time-budget)", default="")
    parser.addoption("--check-time-budget", action="store_true", help="fail the session when it passes its time budget")
    parser.addoption("--test-times", default=str(TIMES_FILE), help="where to write the suite's times (default %(default)s)")


def configured_budget(config: pytest.Config) -> Budget:
    """The budget pyproject.toml sets; a session asked to check one without it is a usage error."""
    values = {name: config.getini(name) for name in ("time_budget_s", "test_time_limit_s")}
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise pytest.UsageError(f"--check-time-budget needs {' and '.join(missing)} in the pytest settings (pyproject.toml)")
    return Budget(float(values["time_budget_s"]), float(values["test_time_limit_s"]))


def cpu_sample(own_s: float) -> CpuSample | None:
    """The machine's counters now, or None where there is no /proc/stat to read them from."""
    try:
        busy, stolen = machine_cpu_seconds(Path("/proc/stat").read_text())
    except OSError:
        return None
    return CpuSample(busy, stolen, own_s)


class WorkerCpu:
    """In each xdist worker: hands the controller the worker's CPU seconds (its own and its reaped children's)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_sessionfinish(self) -> None:
        self.config.workeroutput["cpu_s"] = own_cpu_seconds()  # type: ignore[attr-defined]


class Recorder:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.start_cpu = cpu_sample(own_cpu_seconds())
        self.workers_cpu_s = 0.0
        self.durations: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, int] = defaultdict(int)
        # Read at the start, so that a session asked to check a budget it lacks stops before it runs.
        self.budget = configured_budget(config) if config.getoption("--check-time-budget") else None

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (a worker ended); absent where xdist is
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        self.workers_cpu_s += float(getattr(node, "workeroutput", {}).get("cpu_s", 0.0))

    def cpu(self, wall_s: float) -> tuple[float, float]:
        """(this session's CPU seconds, others' share of the machine) since the session started."""
        # xdist's workers are this process's children: once reaped (by now, as a rule) their whole lives are
        # in its children fields; what each reported at its session's end is the floor if one is not yet.
        mine = os.times()
        own = mine.user + mine.system + max(mine.children_user + mine.children_system, self.workers_cpu_s)
        end = cpu_sample(own)
        if self.start_cpu is None or end is None:
            return 0.0, 0.0
        return own - self.start_cpu.own_s, others_share(self.start_cpu, end, wall_s, os.cpu_count() or 1)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.outcome] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.durations:
            return
        wall_s = time.monotonic() - self.started
        own_cpu_s, others = self.cpu(wall_s)
        times = summarise(self.durations, wall_s, self.outcomes, others, own_cpu_s)
        path = Path(self.config.getoption("--test-times"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(times, indent=1) + "\n")
        if self.budget is not None:
            problems = over_budget(times, self.budget)
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            for line in problems:
                if reporter is not None:
                    reporter.write_line(f"TIME BUDGET: {line}", red=True)
            if problems and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker reports its tests and, at its end, its CPU time
        config.pluginmanager.register(WorkerCpu(config), "test-times-worker-cpu")
    else:  # the controller (or a plain run) records
        config.pluginmanager.register(Recorder(config), "test-times-recorder")


def main(argv: list[str]) -> int:
    """``python -m tests.timing [times.json]``: the table; ``--compare before.json after.json``: two runs."""
    if argv[:1] == ["--compare"] and len(argv) == 3:
        print(compare(json.loads(Path(argv[1]).read_text()), json.loads(Path(argv[2]).read_text())))
        return 0
    path = Path(argv[0]) if argv else TIMES_FILE
    print(table(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
