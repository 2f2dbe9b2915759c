"""Run a job spec on an emulated heterogeneous cluster on this machine.

    python -m training.local run examples/pytorch-heterogeneous.json --channel train=build/demo-images
    python -m training.local run SPEC --channel train=DIR --cpus data_group=1 --set steps=20 --deadline-s 300
    python -m training.local run SPEC --channel train=DIR --cpu-quota data_group=0.25   # a quarter core per data host
    python -m training.local run SPEC --channel train=DIR --json                        # the summary alone on stdout

stdout carries the result alone: a short table (each host's group, role and exit; the job's figures and an
emulated cost), or with --json the chief DNN host's summary. Everything else goes to stderr: the plan,
every host's log lines prefixed "[host group]", and on a terminal a live progress line. The full logs and
every host's /opt/ml tree stay under --workdir, with result.json. Four outcomes, each its exit status: 0
Completed (every host exited 0, no orphan, within the deadline: the spec's max_runtime_s unless
--deadline-s), 1 Failed, 124 TimedOut, 130 or 143 Stopped (Ctrl-C or SIGTERM: SIGTERM to every host and
--stop-grace-s to save, as StopTrainingJob; a second Ctrl-C kills at once); 2 when the spec or an option
is refused. --resume-from carries a stopped run on. The options are defined once, in
training/local/options.py, which `hetero local` shows as its help.
"""

from __future__ import annotations

import glob
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from lambdas.core.catalog import PRICE_DATE
from lambdas.core.job_spec import JobSpec, JobSpecError, validate_job_spec
from lambdas.core.price_performance import FALLBACK_PRICES, cost_per_1k_steps, hourly_cost, with_given
from lambdas.core.results import billed_ms_per_step
from training.local.cluster import (
    ANSI,
    COMPLETED,
    EXIT_STATUS,
    STOPPED,
    ClusterResult,
    EmulatedCluster,
    EmulatedHost,
    EmulationError,
    EmulationOptions,
    check_channels,
)
from training.local.options import key_value, parser, run_parser
from training.stop_signals import Stopped, restore_stop_signals, stopped_by_signals

__all__ = ["key_value", "main", "parser", "resolve_code"]  # key_value: training/local/profile.py's too

STEP_LINE = re.compile(r"^step=(\d+)/(\d+)\b")


def resolve_code(raw: object, spec_path: Path) -> object:
    """A spec whose workload code is a folder relative to the spec file, with that folder's path as
    seen from here (as `hetero run` resolves it before packing). Pure."""
    if isinstance(raw, dict) and isinstance(raw.get("workload"), dict):
        code = raw["workload"].get("code")
        if isinstance(code, str) and not code.startswith("s3://") and not Path(code).expanduser().is_absolute():
            raw = {**raw, "workload": {**raw["workload"], "code": str(spec_path.parent / code)}}
        elif isinstance(code, str) and not code.startswith("s3://"):
            raw = {**raw, "workload": {**raw["workload"], "code": str(Path(code).expanduser())}}
    return raw


def progress_text(step: int, total: int, rate_steps_per_s: float | None) -> str:
    """The live line: steps done of the total and the time left at the rate so far. Pure."""
    if rate_steps_per_s is None or rate_steps_per_s <= 0:
        return f"step {step}/{total}, ETA –"
    left = max(0.0, (total - step) / rate_steps_per_s)
    return f"step {step}/{total}, ETA {int(left // 60)}:{int(left % 60):02d}"


class HostLines:
    """A line listener: every host's lines on ``stream`` prefixed "[host group]", and when ``live`` (stderr
    is a terminal) one progress line under them, redrawn in place: a pipe or a file gets the lines alone."""

    def __init__(self, stream: TextIO, live: bool, clock=time.monotonic) -> None:
        self.stream, self.live, self.clock = stream, live, clock
        self._lock = threading.Lock()
        self._progress = ""
        self._first: tuple[int, float] | None = None  # the first step seen, and when: the rate is measured from it

    def __call__(self, host: EmulatedHost, line: str) -> None:
        with self._lock:
            if self.live and self._progress:
                self.stream.write("\r\x1b[K")
            self.stream.write(f"[{host.label}] {ANSI.sub('', line)}\n")
            matched = STEP_LINE.match(line) if host.role == "dnn" else None
            if matched:
                step, total = int(matched.group(1)), int(matched.group(2))
                now = self.clock()
                if self._first is None:
                    self._first = (step, now)
                first_step, first_at = self._first
                rate = (step - first_step) / (now - first_at) if now > first_at and step > first_step else None
                self._progress = progress_text(step, total, rate)
            if self.live and self._progress:
                self.stream.write(self._progress)
            self.stream.flush()

    def finish(self) -> None:
        """Clear the progress line, so that what follows starts on a clean line."""
        with self._lock:
            if self.live and self._progress:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self._progress = ""


def emulated_cost_per_1k_steps(spec: JobSpec, summary: Mapping[str, Any],
                               given: Mapping[str, float] | None = None) -> tuple[float | None, str]:
    """$ per 1k steps of this machine's step time at the catalog's fallback prices for the spec's instance
    types (``given``: the user's $/hour in their place, --price), and what it was computed from (or why
    not). Emulated: this machine's cores stand in for the instances, so the figure compares
    configurations on one machine, not a cloud bill. Pure."""
    step_ms = billed_ms_per_step(summary)
    if step_ms is None:
        return None, "no timed step"
    types = {group.instance_type for group in spec.instance_groups}
    try:
        usd_per_hour = hourly_cost([(group.instance_type, group.count) for group in spec.instance_groups], with_given(FALLBACK_PRICES, given or {}))
    except KeyError as error:
        return None, str(error.args[0]) + " (give one with --price TYPE=USD_PER_HOUR)"
    cluster = " + ".join(f"{group.count}× {group.instance_type}" for group in spec.instance_groups)
    mine = sorted(types & set(given or {}))
    source = f"your --price for {', '.join(mine)}" + (f", fallback prices of {PRICE_DATE} for the rest" if types - set(mine) else "") if mine \
        else f"fallback prices of {PRICE_DATE}"
    return cost_per_1k_steps(usd_per_hour, step_ms), f"{step_ms:.1f} ms per step at ${usd_per_hour:.3f}/h ({cluster}, {source})"


# One line under the figures that says what they are (docs/reference/glossary.md says more).
COLUMNS_LINE = ("p50: the median training step, its wait for input included; data wait: the part of a step spent waiting "
                "for its batch; $ per 1k steps: the billed time per step here × the spec's list prices (docs/reference/glossary.md)")


def job_table(result: ClusterResult, spec: JobSpec, summary: Mapping[str, Any] | None, workdir: Path,
              given: Mapping[str, float] | None = None) -> str:
    """stdout's result: the host table, then the job's figures, then where the logs are. Pure."""
    lines = [result.report()]
    if summary:
        step = summary.get("step_time_ms") or {}
        wait = summary.get("data_wait_ms") or {}
        samples = summary.get("samples_per_s")
        cost, basis = emulated_cost_per_1k_steps(spec, summary, given)
        lines += [
            f"{'step time p50':<24}{_number(step.get('p50'), 1, ' ms')}",
            f"{'samples/s':<24}{_number(samples, 1)}",
            f"{'data wait p50':<24}{_number(wait.get('p50') if isinstance(wait, Mapping) else wait, 1, ' ms')}",
            f"{'$ per 1k steps':<24}{'–' if cost is None else f'${cost:.4f}'} (emulated: {basis})",
            COLUMNS_LINE,
        ]
    else:
        lines.append("no summary: training did not get that far (see the hosts' logs)")
    lines.append(f"host trees and logs: {workdir} (logs/<host>.log)")
    return "\n".join(lines)


def _number(value: Any, digits: int, unit: str = "") -> str:
    return "–" if not isinstance(value, int | float) else f"{value:.{digits}f}{unit}"


def stopped_line(what: str, stopped: list[EmulatedHost], workdir: Path) -> str:
    """What a stop that could not wait killed, and where the logs are. Pure."""
    hosts = ", ".join(f"{host.name} ({host.group}, {host.role})" for host in stopped) or "no host was running"
    return f"{what}: killed the emulated cluster at once: {hosts}; host trees and logs: {workdir} (logs/<host>.log)"


def stopping_line(what: str, running: list[EmulatedHost], grace_s: float) -> str:
    """What a first stop does, as StopTrainingJob does it. Pure."""
    hosts = ", ".join(f"{host.name} ({host.group}, {host.role})" for host in running) or "no host was running"
    return (f"{what}: stopping the emulated cluster as StopTrainingJob does: SIGTERM to {hosts}; the DNN hosts save a checkpoint "
            f"and the model, SIGKILL after {grace_s:g} s (Ctrl-C again: kill now)")


def dnn_reason(result: ClusterResult) -> str | None:
    """The first DNN host's failure file (TrainingStopped's line after a stop), the job's FailureReason. Pure."""
    return next((outcome.failure for outcome in result.outcomes if outcome.host.role == "dnn" and outcome.failure), None)


def resume_line(result: ClusterResult, workdir: Path, spec: Path) -> str:
    """How to carry on a stopped run. Pure."""
    saved = f"{reason}; " if (reason := dnn_reason(result)) else ""
    return f"run stopped ({result.stopped_by}): {saved}carry on with `hetero local {spec} ... --workdir NEW --resume-from {workdir}`"


def write_result(path: Path, result: ClusterResult, summary: Mapping[str, Any] | None, status: str, reason: str | None,
                 exit_status: int) -> None:
    """result.json beside the host trees: the job's outcome (Completed, Failed, Stopped, TimedOut) as the
    cloud's result.json records a run's, with the exit status this command gives it."""
    reasons = {outcome.host.name: outcome.failure for outcome in result.outcomes if outcome.failure}
    document = {
        "status": status, "stopped_by": result.stopped_by, "exit_status": exit_status,
        "reason": reason or (dnn_reason(result) if status != COMPLETED else None), "elapsed_s": round(result.elapsed_s, 1),
        "hosts": [{"host": outcome.host.name, "group": outcome.host.group, "role": outcome.host.role, "exit_code": outcome.exit_code,
                   "orphaned": outcome.orphaned, "failure": reasons.get(outcome.host.name)} for outcome in result.outcomes],
        "summary": summary,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


# Marks a work folder this command made itself (no --workdir): only those are ever pruned.
TEMPORARY_MARK = ".hetero-local-workdir"


def temporary_workdir(run_name: str, parent: Path | None = None) -> Path:
    """A new temporary work folder for ``run_name``, marked as made by this command for that run name."""
    folder = Path(tempfile.mkdtemp(prefix=f"{run_name}-", dir=parent or Path(tempfile.gettempdir())))
    (folder / TEMPORARY_MARK).write_text(run_name + "\n")
    return folder


def is_temporary_workdir_of(folder: Path, run_name: str) -> bool:
    """Whether ``folder`` is one this command made for exactly ``run_name`` (not for a run name that only
    starts the same: ``vision`` and ``vision-hetero``), its mark still there."""
    if not re.fullmatch(re.escape(run_name) + r"-[A-Za-z0-9_]{8}", folder.name):
        return False
    try:
        return (folder / TEMPORARY_MARK).read_text().strip() == run_name
    except OSError:
        return False


def prune_temporary_workdirs(run_name: str, keep: int, parent: Path | None = None, spare: tuple[Path, ...] = ()) -> list[Path]:
    """Remove the oldest work folders this command made for ``run_name`` so that ``keep`` remain, never one
    in ``spare`` (this run's, the one it resumes from); the folders removed."""
    parent = parent or Path(tempfile.gettempdir())
    spared = {folder.resolve() for folder in spare}
    ours = [folder for folder in parent.glob(f"{glob.escape(run_name)}-*") if is_temporary_workdir_of(folder, run_name)]
    others = sorted((folder for folder in ours if folder.resolve() not in spared), key=lambda folder: (folder / TEMPORARY_MARK).stat().st_mtime)
    room = keep - (len(ours) - len(others))  # the spared ones of ours count against keep first
    removed = others[:max(0, len(others) - max(0, room))]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python -m training.local run SPEC ...``; with ``prog`` (``hetero local``), the run command's own
    arguments under that name, so that its usage and errors name the command the user typed."""
    restore_stop_signals()  # Ctrl-C and a stop alike, whether the shell started this in the foreground or not
    args = run_parser(prog).parse_args(argv) if prog else parser().parse_args(argv)
    made: Path | None = None  # the temporary work folder this run made (no --workdir)
    try:
        raw = resolve_code(json.loads(args.spec.read_text()), args.spec)
        if args.set and isinstance(raw, dict):
            raw["hyperparameters"] = {**raw.get("hyperparameters", {}), **dict(args.set)}
        # The platform's own validation: what it would refuse to launch is refused here too.
        spec = validate_job_spec(raw)
        channels = {name: Path(folder) for name, folder in args.channel}
        check_channels([channel.name for channel in spec.inputs], channels)  # before any host is planned or started
        if args.keep_runs < 1:
            raise ValueError(f"--keep-runs must be at least 1 (this run's folder), got {args.keep_runs}")
        if args.workdir is None:
            made = temporary_workdir(spec.run_name)
        else:  # a folder the user names is theirs, never pruned: even one this command made earlier
            (args.workdir / TEMPORARY_MARK).unlink(missing_ok=True)
        options = EmulationOptions(
            # Absolute: every host runs from its own folder, and a relative tree would be looked for there.
            workdir=(args.workdir or made).resolve(),
            channels=channels,
            deadline_s=args.deadline_s,
            orphan_grace_s=args.orphan_grace_s,
            cpus_per_host={group: int(count) for group, count in args.cpus},
            cpu_quota={group: float(cores) for group, cores in args.cpu_quota},
            processes_per_host=args.processes_per_host,
            code_dir=args.code,
            stop_grace_s=args.stop_grace_s,
            resume_from=args.resume_from.resolve() if args.resume_from else None,
        )
        lines = HostLines(sys.stderr, live=sys.stderr.isatty())
        cluster = EmulatedCluster(spec, options, on_line=lines)
        cluster.resume_source()  # a --resume-from without checkpoints, refused before any host starts
    except (OSError, json.JSONDecodeError, JobSpecError, EmulationError, ValueError) as error:
        if made is not None:  # a refused run leaves no folder behind to count against --keep-runs
            shutil.rmtree(made, ignore_errors=True)
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    if made is not None:  # the run is going ahead: the oldest of this run name's earlier folders go
        prune_temporary_workdirs(spec.run_name, args.keep_runs, made.parent,
                                 spare=(made, *((args.resume_from,) if args.resume_from else ())))
    print(cluster.plan_report(), file=sys.stderr, flush=True)
    print(f"deadline {cluster.deadline_s:g} s; host logs: {options.workdir / 'logs'}", file=sys.stderr, flush=True)
    stop_code: int | None = None
    try:
        with stopped_by_signals():
            try:
                cluster.start()
                try:
                    result = cluster.wait()
                except Stopped as stop:
                    # The first: StopTrainingJob's, emulated (the trainers save); the second kills (below).
                    lines.finish()
                    print(stopping_line(stop.what, cluster.running_hosts(), options.stop_grace_s), file=sys.stderr, flush=True)
                    stop_code = stop.exit_code
                    cluster.stop(stop.what)
                    result = cluster.wait()
            finally:
                cluster.close()
    except EmulationError as error:
        lines.finish()
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as again:  # before the hosts started, or a second one while they were stopping
        what, code = (again.what, again.exit_code) if isinstance(again, Stopped) else ("Ctrl-C", 130)
        lines.finish()
        print(stopped_line(what, cluster.hosts, options.workdir), file=sys.stderr, flush=True)
        return stop_code or code
    lines.finish()
    summary = cluster.summary()
    status, reason = result.status, None
    if summary and summary.get("mode") == "script" and result.ok:
        # What the platform would record for this run in the cloud (result.json), said here too.
        from lambdas.core.results import run_verdict

        status, reason = run_verdict(COMPLETED, summary, None)
    exit_status = (stop_code or 128 + 15) if status == STOPPED else EXIT_STATUS[status]
    write_result(options.workdir / "result.json", result, summary, status, reason, exit_status)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        print(job_table(result, cluster.spec, summary, options.workdir, dict(args.price)), flush=True)
    if reason:
        print(f"the platform would record this run as {status}: {reason}", file=sys.stderr)
    if args.json:
        print(f"host trees and logs: {options.workdir}", file=sys.stderr)
    if status == STOPPED:
        print(resume_line(result, options.workdir, args.spec), file=sys.stderr)
    return exit_status


if __name__ == "__main__":
    sys.exit(main())
