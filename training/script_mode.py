"""Script mode: a user's existing SageMaker entry script, run as it is, with our launcher as PID 1 around it.

A team with a heterogeneous-cluster script of its own (the public samples' shape: one entry point that
reads ``SM_CURRENT_INSTANCE_GROUP``, serves its own data service on the CPU group and trains on the
accelerator group) runs it here without adopting the workload contract. On every host the launcher
unpacks the code channel (training/workload/host.py's ``unpack_on_host``: the archive's SHA-256 checked,
the requirements installed), computes what SageMaker's training toolkit would give the script
(training/script_env.py: every ``SM_*`` variable, the hyperparameters as ``--name value`` arguments) and
starts it once, in a process group of its own, in the code folder. Then it keeps the guarantees that need
no cooperation from the script:

* **SIGTERM** (StopTrainingJob, a spot interruption) goes to the script's process group at once; what is
  still running ``STOP_GRACE_S`` later is killed (SageMaker's SIGKILL comes 120 s after its SIGTERM). The
  toolkit does not forward it (its issues #125, #173).
* **No data host bills on.** The trainer group is the spec's "dnn" group. Each of its hosts' launchers
  keeps every other host told that it runs (keep-alives), and says when its script has ended (Shutdown,
  with the job's token). A data host's launcher ends its script (SIGTERM, then SIGKILL after
  ``SCRIPT_GRACE_S``) and exits 0 once every trainer host has ended or, heard from, went silent for
  ``data_idle_timeout_s`` (gone); a trainer host never heard from keeps it up to ``data_start_deadline_s``
  (then exit 3). A trainer host tells no data host when the job is being stopped (SageMaker signals every
  host), and gives up on one that answered before and answers no more.
* **Failures that name what failed.** A script that exits non-zero or dies of a signal fails its host with
  ``ScriptFailed: train.py on host algo-2 (instance group dnn_group) was killed by SIGKILL`` and its last
  lines. A data host's script that fails is reported to every trainer host, whose script is then ended:
  a trainer waiting on a dead data service would bill until MaxRuntime.
* **Step time from the script's own log.** Every line the script prints goes to the host's log as it is.
  On the trainer group's first host, the lines matching the step-time regex (the platform's
  ``step_time_ms=`` by default) become the run's summary (output/data/summary.json): p50/p90/mean past
  the warm-up steps and the wall time per step, which result.json, the cost per step and the sweeps use.

What needs the script's cooperation is not claimed: there are no stop votes, no exactly-once epochs, no
stall rule from progress marks (the launcher cannot tell a slow step from a hung one without them), and
its checkpoints are its own (the resume channel still seeds /opt/ml/checkpoints for a resumed run).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from training.cluster import Cluster
from training.data_service import data_service_pb2 as pb
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.auth import TokenAuth
from training.data_service.control import SENDER_METADATA
from training.data_service.server import SERVER_OPTIONS, StopReason, bind_port
from training.failure import write_failure
from training.host_environment import HostEnvironment
from training.hyperparameters import DNN, HyperparameterError, PlatformSettings
from training.metrics import METRIC_DEFINITIONS
from training.script_env import MachineFacts, script_environment
from training.trainers.loop import summarize

log = logging.getLogger("training.script")

# A data host's script, ended because the trainer group is done, gets this long after SIGTERM.
SCRIPT_GRACE_S = 10.0
# After SIGTERM to the job, the script's group gets this long before what is left is killed.
STOP_GRACE_S = 100.0
# A trainer host's script, ended because its data hosts failed, gets this long.
PEER_GRACE_S = 10.0
# A data host that answered keep-alives and no longer answers is gone after this long.
GONE_AFTER_S = 5.0
# The script's last lines kept for its failure reason (SageMaker's FailureReason holds 1,024 characters).
TAIL_LINES = 20
MAX_FAILURE_CHARS = 1000
SUMMARY_NAME = "summary.json"
# Where a script's own summary.json goes when the launcher writes the run's (results read summary.json).
SCRIPT_SUMMARY_NAME = "summary.script.json"
# The toolkit installs this file of the code whether or not the job names it.
DEFAULT_REQUIREMENTS = "requirements.txt"
# The toolkit waits this long for every host's name to resolve before it starts the entry point.
HOST_RESOLUTION_S = 900.0


class ScriptError(HyperparameterError):
    """The script cannot be started as the job names it (its entry point is not in the code)."""


# The environment and the command line ------------------------------------------------------------


def script_command(settings: PlatformSettings, code_dir: Path, arguments: Sequence[str], python: str = sys.executable) -> list[str]:
    """How the toolkit would start the entry point: a .py file with the image's python, a .sh file with sh,
    each with the hyperparameters as arguments; a command with sh -c, as written. Raises ScriptError."""
    if settings.script_command:
        return ["/bin/sh", "-c", settings.script_command]
    entry = code_dir / settings.script_entry_point
    if not entry.is_file():
        present = sorted(str(path.relative_to(code_dir)) for path in code_dir.rglob("*") if path.suffix in (".py", ".sh"))[:10]
        raise ScriptError(f"the entry point {settings.script_entry_point!r} is not in the code folder (it holds {present}): "
                          "fix the spec's workload.entry_point")
    if entry.suffix == ".py":
        return [python, str(entry), *arguments]
    # As the toolkit runs a shell entry point: made executable and run by sh, which honours its #! line
    # (a script without one runs in sh).
    entry.chmod(entry.stat().st_mode | 0o111)
    return ["/bin/sh", "-c", '"$0" "$@"', str(entry), *arguments]


def machine_facts() -> MachineFacts:
    """What the toolkit counts on the machine: this host's CPUs (its affinity: emulated hosts share a
    machine), GPUs and Neuron devices."""
    from training.processes import gpu_count

    neurons = len(list(Path("/dev").glob("neuron[0-9]*")))
    return MachineFacts(num_cpus=len(os.sched_getaffinity(0)), num_gpus=gpu_count(), num_neurons=neurons)


# Step times from the script's log ---------------------------------------------------------------


@dataclass(frozen=True)
class StepTiming:
    regex: str  # one group: a step's time
    unit: str = "ms"
    warmup_steps: int = 1

    @classmethod
    def of(cls, settings: PlatformSettings) -> StepTiming:
        return cls(settings.script_step_time_regex or METRIC_DEFINITIONS["step_time_ms"], settings.script_step_time_unit,
                   settings.script_warmup_steps)


def step_time_ms(line: str, timing: StepTiming) -> float | None:
    """A step's time in ms from one log line, as the job's MetricDefinition captures it; None when the
    line has none (or what it captured is no number). Pure."""
    match = re.search(timing.regex, line)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (TypeError, ValueError):
        return None
    return value * 1000 if timing.unit == "s" else value


@dataclass
class StepLog:
    """The step times a script printed, and when (monotonic seconds)."""

    timing: StepTiming
    started_at: float
    values_ms: list[float] = field(default_factory=list)
    seen_at: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, line: str, now: float) -> None:
        value = step_time_ms(line, self.timing)
        if value is not None:
            with self._lock:
                self.values_ms.append(value)
                self.seen_at.append(now)

    def summary(self, *, program: str, exit_code: int | None) -> dict[str, Any]:
        with self._lock:
            return script_summary(self.values_ms, self.seen_at, self.started_at, self.timing, program=program, exit_code=exit_code)


def script_summary(values_ms: Sequence[float], seen_at: Sequence[float], started_at: float, timing: StepTiming, *,
                   program: str, exit_code: int | None) -> dict[str, Any]:
    """The run's summary from the script's step lines: the steps past the warm-up, their p50/p90/mean,
    and the wall time per timed step, from the last warm-up line (or the script's start) to the last
    line, which holds whatever the script did between steps (as the trainers' own summary does). Pure."""
    warmup = min(timing.warmup_steps, len(values_ms))
    timed = list(values_ms[warmup:])
    since = seen_at[warmup - 1] if warmup else started_at
    wall = round((seen_at[-1] - since) * 1000 / len(timed), 3) if timed else None
    steps = summarize(timed)
    # Less wall time per line than a step takes: the lines are not one per step (every rank prints them).
    doubtful = wall is not None and steps is not None and wall < 0.9 * steps["p50"]
    return {
        "mode": "script",
        "program": program,
        "step_time_regex": timing.regex,
        "step_time_unit": timing.unit,
        "steps": len(values_ms),
        "start_step": 0,
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "step_time_ms": steps,
        "wall_ms_per_step": wall,
        "exit_code": exit_code,
        **({"warning": f"{wall:.1f} ms of wall time per step line, less than the median step ({steps['p50']:.1f} ms): the lines are "
                       "not one per step (does every process print them? print from rank 0 only); the figures are not the run's"}
           if doubtful else {}),
    }


# The script's process ---------------------------------------------------------------------------


def describe_exit(returncode: int) -> str:
    """'exited with code 3', 'was killed by SIGKILL', 'exited with code 137 (128 + SIGKILL: a process it
    ran was killed)'. Pure."""
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    if 128 < returncode < 128 + 65:
        return f"exited with code {returncode} (128 + {_signal_name(returncode - 128)}: a process it ran was killed)"
    return f"exited with code {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def within_failure_reason(text: str) -> str:
    """``text`` cut to MAX_FAILURE_CHARS, within SageMaker's FailureReason. Pure."""
    return text if len(text) <= MAX_FAILURE_CHARS else text[: MAX_FAILURE_CHARS - 1] + "…"


def script_failure(program: str, host: str, group: str, returncode: int, tail: Sequence[str]) -> str:
    """The failure reason of a host whose script failed, with its last lines, within SageMaker's
    FailureReason. Pure."""
    text = f"ScriptFailed: {program} on host {host} (instance group {group}) {describe_exit(returncode)}"
    last = [line for line in tail if line.strip()][-5:]
    if last:
        text += "; its last lines: " + " | ".join(last)
    return within_failure_reason(text)


def with_own_failure(reason: str, environ: Mapping[str, str] = os.environ) -> str:
    """The launcher's reason, with what the script wrote to /opt/ml/output/failure itself (SageMaker's
    convention for an algorithm's own reason), which it would otherwise overwrite."""
    from training.failure import failure_path

    path = failure_path(environ)
    own = path.read_text(errors="replace").strip() if path.is_file() else ""
    return within_failure_reason(f"{reason} (the script's own reason: {own})" if own else reason)


def wait_for_host_names(hosts: Sequence[str], bound_s: float = HOST_RESOLUTION_S, retry_s: float = 1.0) -> None:
    """As the toolkit does before the entry point: every host's name resolves (SageMaker's DNS can take a
    moment), or ScriptError after ``bound_s``."""
    import socket

    until = time.monotonic() + bound_s
    for host in hosts:
        while True:
            try:
                socket.gethostbyname(host)
                break
            except OSError as error:
                if time.monotonic() > until:
                    raise ScriptError(f"host {host!r} of this job does not resolve after {bound_s:.0f} s: {error}") from None
                time.sleep(retry_s)


def framework_environment(variant: str, env: Mapping[str, str]) -> dict[str, str]:
    """What the PyTorch container's toolkit (sagemaker-pytorch-training) sets before any entry point, so a
    multi-node script's env:// rendezvous finds its master: MASTER_ADDR (the first host), MASTER_PORT
    7777, and its NCCL settings. Other variants' toolkits set none. Pure."""
    if variant not in ("pytorch", "neuron"):
        return {}
    training = json.loads(env["SM_TRAINING_ENV"])
    return {"MASTER_ADDR": training["master_hostname"], "MASTER_PORT": "7777", "NCCL_SOCKET_IFNAME": training["network_interface_name"],
            "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}


class ScriptProcess:
    """The user's script in a process group of its own, its output copied to ours line by line."""

    def __init__(self, command: list[str], *, cwd: Path, env: Mapping[str, str], program: str,
                 on_line: Callable[[str, float], None] | None = None) -> None:
        self.command, self.cwd, self.env, self.program = command, cwd, dict(env), program
        self._on_line = on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None
        self.started_at = 0.0
        self._forwarded_at: float | None = None
        self._killed = False

    def start(self) -> None:
        log.info("starting the script: %s (in %s)", " ".join(self.command), self.cwd)
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", bufsize=1, start_new_session=True)
        self._pump = threading.Thread(target=self._copy, name="script-output", daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            text = line.rstrip("\n")
            self.tail.append(text)
            if self._on_line is not None:
                self._on_line(text, time.monotonic())

    def poll(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Signal the script's process group (what it started stays in it unless it left)."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def pass_on(self, stop: threading.Event) -> None:
        """The job's SIGTERM, once it came, to the script's group; what still runs STOP_GRACE_S later is killed."""
        if stop.is_set() and self._forwarded_at is None:
            log.warning("SIGTERM: passed to the script, which gets %.0f s", STOP_GRACE_S)
            self.signal(signal.SIGTERM)
            self._forwarded_at = time.monotonic()
        if self._forwarded_at is not None and not self._killed and time.monotonic() - self._forwarded_at > STOP_GRACE_S:
            log.error("the script did not end within %.0f s of SIGTERM: killed", STOP_GRACE_S)
            self._killed = True
            self.kill()

    def kill(self) -> None:
        """SIGKILL the group and every process of the script's tree (torchrun's ranks leave the group)."""
        from training.processes import kill_trees

        assert self.process is not None
        if self.process.poll() is None:
            kill_trees([self.process.pid])
        self.signal(signal.SIGKILL)

    def end(self, grace_s: float) -> int:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``; the script's return code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("the script did not end within %.0f s of SIGTERM: killed", grace_s)
                self.kill()
        return self.finish()

    def finish(self) -> int:
        """After the script's exit: its output read to the end, what it left in its group killed."""
        assert self.process is not None
        returncode = self.process.wait()
        self.signal(signal.SIGKILL)
        if self._pump is not None:
            self._pump.join(timeout=5)
        return returncode


# The data group's hosts -------------------------------------------------------------------------


def trainers_gone(started_at: float, heard: Mapping[str, float], ended: set[str], trainers: Sequence[str], now: float, *,
                  idle_timeout_s: float, start_deadline_s: float) -> StopReason | None:
    """Whether a data host's script may end, from what it heard of each trainer host: SHUTDOWN once every
    trainer host said its script ended; IDLE once each either said so or, heard from, went silent for
    ``idle_timeout_s`` (gone), and at least one was heard; START_DEADLINE when a trainer host was never
    heard from ``start_deadline_s`` after the start (none came). A trainer host still starting (pulling,
    installing) keeps the data hosts up until the start deadline. Pure."""
    if set(trainers) <= ended:
        return StopReason.SHUTDOWN
    waiting = [host for host in trainers if host not in ended]
    never = [host for host in waiting if host not in heard]
    if never:
        return StopReason.START_DEADLINE if now - started_at > start_deadline_s else None
    if all(now - heard[host] > idle_timeout_s for host in waiting):
        return StopReason.IDLE
    return None


class ScriptHostControl(pb_grpc.DataServiceServicer):
    """A data host's end of the control plane in script mode: each trainer host's keep-alives (Describe,
    naming their sender) and its word that its script ended (Shutdown). Every call carries the job's
    token (TokenAuth)."""

    def __init__(self, host: str, trainers: Sequence[str]) -> None:
        self.host, self.trainers = host, tuple(trainers)
        self.started_at = time.monotonic()
        self.heard: dict[str, float] = {}
        self.ended: set[str] = set()
        self._lock = threading.Lock()

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DatasetInfo:
        sender = dict(context.invocation_metadata() or ()).get(SENDER_METADATA, "")
        if sender in self.trainers:
            with self._lock:
                self.heard[sender] = time.monotonic()
        return pb.DatasetInfo(host=self.host)

    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownReply:
        with self._lock:
            if request.requester in self.trainers:
                self.ended.add(request.requester)
            left = [host for host in self.trainers if host not in self.ended]
        log.info("trainer host %s says its script ended; %s", request.requester or context.peer(),
                 f"waiting for {left}" if left else "every trainer host has ended")
        return pb.ShutdownReply(host=self.host)

    def verdict(self, idle_timeout_s: float, start_deadline_s: float) -> StopReason | None:
        with self._lock:
            return trainers_gone(self.started_at, dict(self.heard), set(self.ended), self.trainers, time.monotonic(),
                                 idle_timeout_s=idle_timeout_s, start_deadline_s=start_deadline_s)


def trainer_hosts(cluster: Cluster, settings: PlatformSettings) -> tuple[str, ...]:
    return cluster.group(settings.groups_with_role(DNN)[0]).hosts


def run_script_data_host(host: HostEnvironment, settings: PlatformSettings, script: ScriptProcess, stop: threading.Event) -> int:
    """Run the script on a host of a data group until the trainer group has ended (see the module's docstring)."""
    from training.data_host import fail_data_host
    from training.processes import CONFIG_ERROR_EXIT, exit_status

    cluster = host.cluster
    control = ScriptHostControl(cluster.current_host, trainer_hosts(cluster, settings))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="script-control"), options=SERVER_OPTIONS,
                         interceptors=[TokenAuth(settings.shutdown_token)])
    pb_grpc.add_DataServiceServicer_to_server(control, server)
    bind_port(server, f"{host.bind_address()}:{settings.data_service_port}")
    server.start()
    script.start()
    try:
        while (returncode := script.poll()) is None:
            script.pass_on(stop)
            verdict = control.verdict(settings.data_idle_timeout_s, settings.data_start_deadline_s)
            if verdict is StopReason.SHUTDOWN:
                log.info("every trainer host's script has ended: ending this data host's script")
                script.end(SCRIPT_GRACE_S)
                return 0
            if verdict is StopReason.IDLE:
                log.warning("no trainer host heard from for %.0f s (gone): ending the script", settings.data_idle_timeout_s)
                script.end(SCRIPT_GRACE_S)
                return 0
            if verdict is StopReason.START_DEADLINE:
                absent = [host for host in control.trainers if host not in control.heard]
                message = (f"ScriptHostUnused: trainer hosts {absent} never reached data host {cluster.current_host} "
                           f"within {settings.data_start_deadline_s:.0f} s: its script was ended")
                script.end(SCRIPT_GRACE_S)
                log.error("%s", message)
                write_failure(message)
                return StopReason.START_DEADLINE.exit_code
            time.sleep(0.2)
        script.finish()
        if returncode == 0 or stop.is_set():
            log.info("the script %s by itself", describe_exit(returncode))
            return exit_status(returncode)
        message = with_own_failure(script_failure(script.program, cluster.current_host, cluster.current_group, returncode, list(script.tail)))
        code = exit_status(returncode)
        return fail_data_host(host, settings, message, code if code else CONFIG_ERROR_EXIT, stop)
    finally:
        server.stop(grace=1.0).wait(timeout=3)


# The trainer group's hosts ----------------------------------------------------------------------


def tell_data_hosts(targets: Sequence[str], token: str, requester: str, *, deadline_s: float, retry_s: float = 1.0,
                    gone_after_s: float = 5.0, heard: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Tell every data host that this trainer host's script has ended, asking each again until it answers:
    a script may end before a data host's launcher is up (it unpacks and installs first), and a host that
    never heard would wait out its start deadline, billed; so one never heard from is asked for
    ``deadline_s``, one in ``heard`` (it answered keep-alives: it is gone now) for ``gone_after_s``.
    Returns the hosts told."""
    from training.data_service.control import request_shutdown

    def one(target: str) -> str | None:
        until = time.monotonic() + (gone_after_s if target in heard else deadline_s)
        while True:
            try:
                return request_shutdown(target, token, requester).host
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED or time.monotonic() + retry_s > until:
                    log.warning("data host %s did not hear that this host's script ended (%s)", target, error.code().name)
                    return None
            time.sleep(retry_s)

    with futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        return [host for host in pool.map(one, targets) if host]


def run_script_trainer_host(host: HostEnvironment, settings: PlatformSettings, script: ScriptProcess, stop: threading.Event,
                            steps: StepLog | None) -> int:
    """Run the script on a host of the trainer group; then tell every data host that it ended, and on the
    group's first host write the summary from the script's step lines."""
    from training.data_host import data_failure_verdict
    from training.data_service.control import FailureReports, KeepAlive
    from training.dnn_host import seed_checkpoints
    from training.processes import exit_status

    seed_checkpoints(host)
    cluster, addresses = host.cluster, host.addresses
    data_targets = settings.data_service_targets(cluster, addresses)
    abort: str | None = None
    heard: set[str] = set()
    with contextlib.ExitStack() as stack:
        reports, keepalive = None, None
        if data_targets:
            bind = f"{host.bind_address()}:{settings.job_control_port}"
            reports = stack.enter_context(FailureReports(bind, settings.shutdown_token))
            keepalive = stack.enter_context(KeepAlive(data_targets, settings.shutdown_token, interval_s=min(5.0, settings.data_idle_timeout_s / 3),
                                                      sender=cluster.current_host))
        script.start()
        if steps is not None:
            steps.started_at = script.started_at
        while (returncode := script.poll()) is None:
            script.pass_on(stop)
            if reports is not None and (abort := data_failure_verdict(reports.snapshot(), settings.data_hosts(cluster))):
                abort = f"DataHostFailed: {abort}"
                log.error("%s: ending the script", abort)
                returncode = script.end(PEER_GRACE_S)
                break
            time.sleep(0.1)
        returncode = script.finish()
        if keepalive is not None:
            heard = {target for target in data_targets if keepalive.answered(target)}
    if steps is not None:
        summary = steps.summary(program=script.program, exit_code=returncode)
        path = host.output_data_dir / SUMMARY_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():  # the script's own: kept beside the run's, never overwritten
            path.replace(path.with_name(SCRIPT_SUMMARY_NAME))
            log.info("the script wrote output/data/%s itself: kept as %s", SUMMARY_NAME, SCRIPT_SUMMARY_NAME)
        path.write_text(json.dumps(summary, indent=2))
        log.info("%d step lines of the script (%d timed past %d warm-up): %s", summary["steps"], summary["timed_steps"],
                 summary["warmup_steps"], summary["step_time_ms"])
    if data_targets and not stop.is_set():
        # The data hosts end once every trainer host has told them (SageMaker stops every host itself on
        # StopTrainingJob). One that answered before and is unreachable now is gone: it is asked for a few
        # seconds only; one never heard from may still be starting, and is asked until its start deadline.
        failed = reports.snapshot() if reports is not None else {}
        serving = [target for host, target in zip(settings.data_hosts(cluster), data_targets, strict=True) if host not in failed]
        tell_data_hosts(serving, settings.shutdown_token, cluster.current_host, deadline_s=settings.data_start_deadline_s,
                        gone_after_s=GONE_AFTER_S, heard=heard)
    if abort:
        write_failure(abort)
        return 1
    status = exit_status(returncode)
    if status and not stop.is_set():
        message = with_own_failure(script_failure(script.program, cluster.current_host, cluster.current_group, returncode, list(script.tail)))
        log.error("%s", message)
        write_failure(message)
    elif status:
        log.warning("the script %s after SIGTERM", describe_exit(returncode))
    return status


def run_script_host(host: HostEnvironment, settings: PlatformSettings, code_dir: Path, packages: Path | None,
                    stop: threading.Event) -> int:
    """A script job's host: the script started with the toolkit's environment, as a data or trainer host."""
    cluster = host.cluster
    environment, arguments = script_environment(host.hyperparameters, code_dir, packages, machine_facts())
    # The framework's variables where the job's environment has none of its own.
    environment = framework_environment(settings.variant, environment) | environment
    command = script_command(settings, code_dir, arguments)
    wait_for_host_names(cluster.hosts)
    program = settings.script_entry_point or settings.script_command
    role = settings.role_of(cluster.current_group)
    first_trainer = role == DNN and cluster.current_host == trainer_hosts(cluster, settings)[0]
    steps = StepLog(StepTiming.of(settings), started_at=time.monotonic()) if first_trainer else None
    script = ScriptProcess(command, cwd=code_dir, env=environment, program=program, on_line=steps.observe if steps else None)
    if role == DNN:
        return run_script_trainer_host(host, settings, script, stop, steps)
    return run_script_data_host(host, settings, script, stop)
