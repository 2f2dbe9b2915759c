"""An emulated heterogeneous SageMaker cluster on one machine: every host a real process tree.

SageMaker's local mode refuses heterogeneous jobs; this runs them. From the same job spec the platform
takes, it plans one host per instance, and for each host:

* a fake ``/opt/ml`` tree (resourceconfig.json, hyperparameters.json, inputdataconfig.json, the channels
  assigned to its group, model/output/checkpoint folders), found through ``SAGEMAKER_BASE_DIR``;
* its own loopback address (127.0.<subnet>.<n>), which its servers bind to, and a host name → address map
  standing in for SageMaker's DNS;
* a CPU set standing in for its instance's vCPUs (DNN hosts get their own cores first, data hosts share
  the rest), so that preprocessing moved to a data host really leaves the DNN host's cores;
* the real entrypoint, ``python -m training.launcher``, in its own session so it can be killed whole,
  supervised as on SageMaker: its first process runs the launcher as a child and watches its heartbeat
  (training.supervisor.supervise), so a frozen launcher is killed here as it would be there.

Every process a host starts carries the host's tag in its environment (``EMULATED_HOST``), so the
host's processes are found even after they left its process tree (torchrun starts its workers in
sessions of their own; a killed parent's children are reparented to PID 1). A host ends as a container
does: when its launcher exits, whatever it left running is killed, and its log is complete.

A script-mode job's hosts (the user's own SageMaker script, training/script_mode.py) also get host names
that resolve as on SageMaker: each runs in a mount and UTS namespace of its own (``unshare``), with a
hosts file of the job's bind-mounted over /etc/hosts (``algo-1`` → its loopback address, for every host
of the job), its host name set to its own and its tree at /opt/ml, as SageMaker's fixed paths are there
(ENTER_NAMESPACES); nothing outside the namespaces changes. The namespaces need
root or unprivileged user namespaces (``namespace_command``); the hosts still share the machine's network
stack, so two hosts of one emulated job cannot both listen on one port of the wildcard address (bind
the host's own name, as SM_CURRENT_HOST gives it).

Every log line is prefixed with host and group (on stderr by default). The run fails (non-zero) if any
host fails, if the deadline passes (the spec's max_runtime_s, SageMaker's MaxRuntimeInSeconds, unless
given), or if a host is still running ``orphan_grace_s`` after the DNN group ended: on SageMaker that host
would keep billing, so here it is killed and reported as an orphan. A data host whose DNN group ended
before its first step may never have had a client, and such a host stops on its own at its start deadline
(exit 3): it is given that long too, then the grace, before it counts as one (``orphan_deadline``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lambdas.core.catalog import CATALOG
from lambdas.core.job_spec import DISTRIBUTIONS, INPUT_MODES, JobSpec
from lambdas.core.training_request import container_hyperparameters, platform_settings
from training.cluster import BASE_DIR_ENV, HOMOGENEOUS_GROUP, HOST_ADDRESSES_ENV
from training.host_environment import CONTAINER_STARTED_ENV
from training.hyperparameters import CODE_CHANNEL, PLATFORM_CHANNEL, RESUME_CHANNEL, TOKEN_FILE
from training.local.cpu_quota import ClusterQuotas, CpuQuotaUnavailableError
from training.local.cpu_quota import enter as enter_quota

# process_tree: also a container's first process's (every process of a host, across sessions)
from training.processes import process_tree
from training.supervisor import SUPERVISE_ENV
from training.workload.code import ARCHIVE_NAME, CodeError, PackedCode, pack_code

REPO_ROOT = Path(__file__).resolve().parents[2]
# Every process of an emulated host carries "<cluster id>/<host name>" in this variable.
HOST_TAG_ENV = "EMULATED_HOST"
LineCallback = Callable[["EmulatedHost", str], None]


class EmulationError(RuntimeError):
    """The emulated cluster cannot be set up as asked."""


@dataclass(frozen=True)
class EmulatedHost:
    name: str  # algo-1, algo-2, ... as SageMaker names them
    group: str  # the group SageMaker reports (homogeneousCluster for a single-group spec)
    spec_group: str  # the group's name in the job spec
    role: str
    instance_type: str
    address: str
    cpus: tuple[int, ...]
    base_dir: Path
    cpu_quota: float | None = None  # cores (a fraction of its CPU set) when quotas are set for its group

    @property
    def label(self) -> str:
        return f"{self.name} {self.group}"


@dataclass
class HostOutcome:
    host: EmulatedHost
    exit_code: int | None = None
    ended_at: float | None = None
    orphaned: bool = False  # still running after the DNN group ended; killed
    killed_at_deadline: bool = False
    killed_on_request: bool = False
    killed_after_stop_grace: bool = False  # still running when a stop's grace ran out (StopTrainingJob's SIGKILL)
    leftovers: int = 0  # processes still running when its launcher exited (killed, as a container's would be)
    failure: str = ""  # what the host left in /opt/ml/output/failure (the job's FailureReason on SageMaker)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.orphaned and not self.killed_at_deadline


# How an emulated job ended, as SageMaker's job statuses name it (a deadline is its own: SageMaker stops a
# job at MaxRuntimeInSeconds), each with the exit status `hetero local` gives it (stopped: 128 + the signal).
COMPLETED, FAILED, STOPPED, TIMED_OUT = "Completed", "Failed", "Stopped", "TimedOut"
EXIT_STATUS = {COMPLETED: 0, FAILED: 1, TIMED_OUT: 124}


@dataclass
class ClusterResult:
    outcomes: list[HostOutcome]
    elapsed_s: float
    deadline_exceeded: bool = False
    stopped_by: str | None = None  # "Ctrl-C" or "SIGTERM" when a stop (StopTrainingJob's, emulated) ended the job

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED

    @property
    def status(self) -> str:
        """Completed, Failed, Stopped or TimedOut: a stop or a deadline decides it whatever the hosts exited."""
        if self.stopped_by is not None:
            return STOPPED
        if self.deadline_exceeded:
            return TIMED_OUT
        return COMPLETED if all(outcome.ok for outcome in self.outcomes) else FAILED

    @property
    def orphans(self) -> list[str]:
        return [outcome.host.name for outcome in self.outcomes if outcome.orphaned]

    def outcome(self, host: str) -> HostOutcome:
        return next(outcome for outcome in self.outcomes if outcome.host.name == host)

    def report(self) -> str:
        lines = [f"{'host':<8} {'group':<20} {'role':<5} {'exit':>5}  note"]
        for outcome in self.outcomes:
            notes = []
            if outcome.orphaned:
                notes.append("ORPHAN: still running after the DNN group ended; killed")
            if outcome.killed_at_deadline:
                notes.append("killed at the deadline")
            if outcome.killed_on_request:
                notes.append("killed on request")
            if outcome.killed_after_stop_grace:
                notes.append("still running when the stop's grace ran out; killed")
            if outcome.leftovers:
                notes.append(f"{outcome.leftovers} processes outlived its launcher; killed")
            if outcome.exit_code not in (0, None) and outcome.failure:
                notes.append(outcome.failure if len(outcome.failure) <= 300 else outcome.failure[:299] + "…")
            host = outcome.host
            lines.append(f"{host.name:<8} {host.group:<20} {host.role:<5} {str(outcome.exit_code):>5}  {'; '.join(notes)}")
        verdict = {COMPLETED: "succeeded", FAILED: "FAILED", STOPPED: f"STOPPED ({self.stopped_by})", TIMED_OUT: "TIMED OUT (its deadline)"}
        lines.append(f"cluster {verdict[self.status]} in {self.elapsed_s:.1f} s")
        return "\n".join(lines)


@dataclass(frozen=True)
class EmulationOptions:
    workdir: Path
    channels: dict[str, Path]  # channel name → local folder standing in for its S3 prefix
    # None: the spec's max_runtime_s, after which SageMaker stops the job.
    deadline_s: float | None = None
    orphan_grace_s: float = 30.0
    # A stop (Ctrl-C, SIGTERM) as StopTrainingJob's: SIGTERM to every host, this long to save, then SIGKILL.
    stop_grace_s: float = 120.0
    # An earlier run's work folder: its chief DNN host's checkpoints become this run's resume channel.
    resume_from: Path | None = None
    # Platform settings the launch Lambda would choose; short here so a dead trainer is noticed fast.
    data_idle_timeout_s: float = 15.0
    data_start_deadline_s: float = 120.0
    data_connect_timeout_s: float = 60.0
    data_batch_timeout_s: float = 20.0
    dispatcher_silence_s: float = 15.0
    trainer_stall_timeout_s: float = 120.0
    trainer_first_step_timeout_s: float = 300.0
    trainer_exit_timeout_s: float = 30.0
    launcher_heartbeat_timeout_s: float = 60.0
    # Trainer processes per DNN host (torchrun's nproc-per-node); 0: one per GPU, or one without GPUs.
    processes_per_host: int = 0
    # CPUs per host of a group (group name → count); default one each.
    cpus_per_host: dict[str, int] = field(default_factory=dict)
    # A fraction of a core per host of a group (group name → cores, e.g. 0.25), enforced with cgroups on
    # top of the CPU set: 1, 2 or 4 data hosts of a known size then fit on a small machine.
    cpu_quota: dict[str, float] = field(default_factory=dict)
    subnet: int | None = None  # the third octet of the hosts' addresses; random when None
    # A user workload's code folder (the spec's own local "code", or this in place of an s3:// one).
    code_dir: Path | None = None


def check_channels(inputs: list[str], channels: dict[str, Path]) -> None:
    """Refuse, before any host starts, local folders that do not match the spec's inputs: one missing for a
    channel, one for a channel the spec lacks (naming the nearest it has), or a folder that does not exist."""
    # A misspelt name first: it also leaves its channel without a folder, and the nearest name is the fix.
    unknown = sorted(set(channels) - set(inputs))
    if unknown:
        nearest = difflib.get_close_matches(unknown[0], inputs, n=1, cutoff=0.5)
        hint = f"did you mean --channel {nearest[0]}={channels[unknown[0]]}? " if nearest else ""
        raise EmulationError(f"--channel {unknown[0]}: the spec has no such input ({hint}it has {sorted(inputs)})")
    missing = sorted(set(inputs) - set(channels))
    if missing:
        raise EmulationError(f"channels {missing} need a local folder: --channel {missing[0]}=PATH")
    for name, folder in sorted(channels.items()):
        if not Path(folder).exists():
            where = "" if Path(folder).is_absolute() else f" (relative to {Path.cwd()})"
            raise EmulationError(f"--channel {name}={folder}: the folder {Path(folder).absolute()} does not exist{where}")
        if not Path(folder).is_dir():
            raise EmulationError(f"--channel {name}={folder}: {Path(folder).absolute()} is a file, not a folder")


def orphan_deadline(dnn_ended_at: float, options: EmulationOptions, trained: bool) -> float:
    """When a host still running after the DNN group ended becomes an orphan: ``orphan_grace_s`` after that
    end. A DNN group that ended before its first step (``trained`` false) may have left a data host without
    any client, and such a host keeps waiting for one until its start deadline (``data_start_deadline_s``
    from its server's start; then it exits 3, training/data_service/server.py): it is given that long from
    the DNN group's end (its clock started before, or later by no more than its setup), then the grace. Pure."""
    return dnn_ended_at + options.orphan_grace_s + (0.0 if trained else options.data_start_deadline_s)


def assign_cpus(roles: list[str], cpus_wanted: list[int], available: list[int]) -> list[tuple[int, ...]]:
    """CPU sets per host: DNN hosts take cores of their own first; data hosts share the rest round-robin
    (all cores, if the DNN hosts took every one). Pure."""
    if not available:
        raise EmulationError("no CPU is available to this process")
    sets: list[tuple[int, ...]] = [()] * len(roles)
    free = list(available)
    for index, role in enumerate(roles):
        if role == "dnn":
            wanted = min(cpus_wanted[index], len(available))
            if len(free) >= wanted:
                sets[index], free = tuple(free[:wanted]), free[wanted:]
            else:  # more DNN cores asked for than exist: share
                sets[index] = tuple(available[:wanted])
    pool = free or list(available)
    cursor = 0
    for index, role in enumerate(roles):
        if role != "dnn":
            count = min(cpus_wanted[index], len(pool))
            sets[index] = tuple(pool[(cursor + offset) % len(pool)] for offset in range(count))
            cursor += count
    return sets


def plan_hosts(spec: JobSpec, options: EmulationOptions, available_cpus: list[int], subnet: int) -> list[EmulatedHost]:
    """One EmulatedHost per instance of the spec, named and ordered as SageMaker would. Pure."""
    rows = []
    for group in spec.instance_groups:
        reported = group.name if spec.is_heterogeneous else HOMOGENEOUS_GROUP
        for _ in range(group.count):
            rows.append((reported, group.name, group.role, group.instance_type, options.cpus_per_host.get(group.name, 1)))
    for option, values in (("--cpus", options.cpus_per_host), ("--cpu-quota", options.cpu_quota)):
        unknown = sorted(set(values) - {group.name for group in spec.instance_groups})
        if unknown:
            raise EmulationError(f"{option} names groups {unknown} that the spec does not have")
    bad = {group: cores for group, cores in options.cpu_quota.items() if not 0.01 <= cores <= options.cpus_per_host.get(group, 1)}
    if bad:
        raise EmulationError(f"--cpu-quota must be between 0.01 and the group's CPUs, got {bad}")
    cpu_sets = assign_cpus([row[2] for row in rows], [row[4] for row in rows], available_cpus)
    hosts = []
    for index, ((group, spec_group, role, instance_type, _), cpus) in enumerate(zip(rows, cpu_sets, strict=True), start=1):
        name = f"algo-{index}"
        address = f"127.0.{subnet}.{index + 1}"
        hosts.append(EmulatedHost(
            name, group, spec_group, role, instance_type, address, cpus, options.workdir / name / "opt" / "ml",
            cpu_quota=options.cpu_quota.get(spec_group),
        ))
    return hosts


def resource_config(host: EmulatedHost, hosts: list[EmulatedHost]) -> dict[str, Any]:
    groups: dict[str, list[EmulatedHost]] = {}
    for other in hosts:
        groups.setdefault(other.group, []).append(other)
    return {
        "current_host": host.name,
        "current_instance_type": host.instance_type,
        "current_group_name": host.group,
        "hosts": [other.name for other in hosts],
        "instance_groups": [
            {"instance_group_name": name, "instance_type": members[0].instance_type, "hosts": [m.name for m in members]}
            for name, members in groups.items()
        ],
        "network_interface_name": "lo",
    }


def emulated_hyperparameters(spec: JobSpec, options: EmulationOptions, ports: tuple[int, int, int], tf_ports: tuple[int, int]) -> dict[str, str]:
    """What the launch Lambda writes into HyperParameters, with this emulation's ports and timeouts.

    tf.data.service binds every interface, so the emulated hosts (and any other emulated cluster on this
    machine) share its ports: each cluster gets free ones of its own."""
    platform = platform_settings(
        spec,
        data_service_port=ports[0],
        master_port=ports[1],
        job_control_port=ports[2],
        tf_dispatcher_port=tf_ports[0],
        tf_worker_port=tf_ports[1],
        data_idle_timeout_s=options.data_idle_timeout_s,
        data_start_deadline_s=options.data_start_deadline_s,
        data_connect_timeout_s=options.data_connect_timeout_s,
        data_batch_timeout_s=options.data_batch_timeout_s,
        dispatcher_silence_s=options.dispatcher_silence_s,
        trainer_stall_timeout_s=options.trainer_stall_timeout_s,
        trainer_first_step_timeout_s=options.trainer_first_step_timeout_s,
        trainer_exit_timeout_s=options.trainer_exit_timeout_s,
        launcher_heartbeat_timeout_s=options.launcher_heartbeat_timeout_s,
        processes_per_host=options.processes_per_host,
    )
    return container_hyperparameters(spec, platform)


def shard_keys(keys: list[str], index: int, hosts: int) -> list[str]:
    """The objects host ``index`` of ``hosts`` gets of a ShardedByS3Key channel, as the emulation deals
    them: round-robin over the sorted keys (SageMaker promises about 1/n each, not which). Pure."""
    return sorted(keys)[index::hosts]


def write_shard(source: Path, folder: Path, index: int, hosts: int) -> None:
    """A host's copy of a sharded channel: links to its share of the files under ``source``, at the
    same relative paths (the class folders stay)."""
    keys = [str(path.relative_to(source)) for path in source.rglob("*") if path.is_file()]
    folder.mkdir(parents=True)
    for key in shard_keys(keys, index, hosts):
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).symlink_to(source / key)


def hosts_file(hosts: list[EmulatedHost], machine: str) -> str:
    """The job's /etc/hosts: every emulated host's name at its address, first (the first match wins, over
    an algo-1 the machine may name), then the machine's own lines. Pure."""
    own = "\n".join(f"{host.address}\t{host.name}" for host in hosts)
    return f"# the emulated cluster's hosts\n{own}\n{machine.rstrip()}\n"


# In the host's own mount and UTS namespaces: the job's hosts file over /etc/hosts, the host's name, its
# tree at /opt/ml (scripts write SageMaker's fixed paths, /opt/ml/checkpoints): over the machine's /opt/ml
# where there is one, else in a tmpfs over /opt that holds the machine's /opt entries, bound back, and ml.
# Then the launcher. $1: the hosts file, $2: the host name, $3: its tree, $4: an empty folder, the rest:
# the command. Nothing outside the namespaces changes.
ENTER_NAMESPACES = """set -e
mount --bind "$1" /etc/hosts
hostname "$2"
if [ -d /opt/ml ]; then
  mount --rbind "$3" /opt/ml
elif [ -d /opt ]; then
  mount --rbind /opt "$4"
  mount -t tmpfs -o mode=755 hetero-opt /opt
  for entry in "$4"/* "$4"/.[!.]*; do
    [ -e "$entry" ] || [ -L "$entry" ] || continue
    name=${entry##*/}
    if [ -L "$entry" ]; then cp -P "$entry" /opt/
    elif [ -d "$entry" ]; then mkdir "/opt/$name" && mount --rbind "$entry" "/opt/$name"
    else touch "/opt/$name" && mount --bind "$entry" "/opt/$name"
    fi
  done
  mkdir /opt/ml
  mount --rbind "$3" /opt/ml
fi
shift 4
exec "$@"
"""


def namespace_command(hosts_path: Path, name: str, tree: Path, scratch: Path, command: list[str], *, root: bool) -> list[str]:
    """``command`` in mount and UTS namespaces of its own with the job's hosts file, the host's name and
    its tree at /opt/ml (as root; otherwise in a user namespace that maps this user to root). Pure."""
    user = [] if root else ["--map-root-user"]
    return ["unshare", "--mount", "--uts", *user, "--", "/bin/sh", "-c", ENTER_NAMESPACES, "enter-host", str(hosts_path), name,
            str(tree), str(scratch), *command]


def check_namespaces(root: bool, scratch: Path) -> None:
    """Raise EmulationError when this machine cannot give an emulated host namespaces of its own."""
    scratch.mkdir(parents=True, exist_ok=True)
    probe = namespace_command(Path("/etc/hosts"), "probe", scratch, scratch, ["true"], root=root)
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EmulationError(f"a script job's emulated hosts need `unshare` (util-linux) for their host names: {error}") from None
    if result.returncode != 0:
        raise EmulationError("a script job's emulated hosts resolve each other's names (algo-1, ...) in mount namespaces of their own, "
                             f"which this machine refused ({result.stderr.strip()[:200]}): run as root, or enable unprivileged user "
                             "namespaces (sysctl kernel.unprivileged_userns_clone=1)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_range(count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive ports free on every interface (tf.data.service's workers bind
    the wildcard address, one port per data host)."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65535:
            continue
        probes = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise EmulationError(f"found no {count} consecutive free ports")


# What a distribution needs on this machine beyond `make venv`, the module that shows it is there, and the
# command that installs it (Horovod is compiled against the installed TensorFlow: `make horovod`).
RUNTIMES = {"horovod": ("horovod.tensorflow", "make horovod")}


def missing_runtime(distribution: str, find: Any = None) -> str | None:
    """Why this machine cannot run a job of ``distribution``, naming the command that fixes it; None when it
    can. ``find``: importlib.util.find_spec, or a stand-in."""
    if distribution not in RUNTIMES:
        return None
    module, command = RUNTIMES[distribution]
    find = find or _find_spec
    if find(module) is not None:
        return None
    return (f"distribution {distribution!r} runs its trainers with {module.split('.')[0]}, which this environment "
            f"({sys.executable}) does not have: run `{command}` (once; it builds it against the installed TensorFlow), "
            "then run this again")


def _find_spec(module: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(module)
    except ImportError:  # a parent package that is there but cannot be imported: not usable either
        return None


class EmulatedCluster:
    """Start with ``start()``, then ``wait()``; ``kill(host)`` injects a host failure."""

    def __init__(self, spec: JobSpec, options: EmulationOptions, on_line: LineCallback | None = None) -> None:
        missing = missing_runtime(spec.distribution)
        if missing:  # refused before anything is packed, planned or started
            raise EmulationError(missing)
        # A user workload's code travels as on SageMaker: packed, then a channel of every host.
        self.code: PackedCode | None = None
        if spec.code is not None:
            folder = options.code_dir or (Path(spec.code.source) if spec.code.is_local else None)
            if folder is None:
                raise EmulationError(f"the spec's workload code is {spec.code.source}: give its folder with --code DIR")
            try:
                self.code = pack_code(folder)
            except CodeError as error:
                raise EmulationError(str(error)) from None
            # Where the platform would have uploaded it: the hosts see only the channel, as on SageMaker.
            spec = dataclasses.replace(spec, code=dataclasses.replace(spec.code, source=f"s3://emulated-results/{self.code.key}", sha256=self.code.sha256))
        self.spec = spec
        self.options = options
        subnet = options.subnet if options.subnet is not None else secrets.randbelow(200) + 20
        self.hosts = plan_hosts(spec, options, sorted(os.sched_getaffinity(0)), subnet)
        self._listeners: list[LineCallback] = [on_line or _print_line]
        self._trained = False  # a DNN host printed a step line (its data hosts had a client)
        self._stopping: tuple[str, float] | None = None  # (what stopped the job, when): see stop()
        self._processes: dict[str, subprocess.Popen] = {}
        self._outcomes = {host.name: HostOutcome(host) for host in self.hosts}
        self._pumps: list[threading.Thread] = []
        self._started_at = 0.0
        self.cluster_id = f"{os.getpid()}-{subnet}-{secrets.token_hex(4)}"
        self.hyperparameters: dict[str, str] = {}
        self.shutdown_token = ""
        quotas = {host.name: host.cpu_quota for host in self.hosts if host.cpu_quota is not None}
        try:
            self._quotas = ClusterQuotas(f"hetero-emulation-{os.getpid()}-{subnet}", quotas)
        except CpuQuotaUnavailableError as error:
            raise EmulationError(str(error)) from None

    @property
    def deadline_s(self) -> float:
        """How long the hosts may run: the option, else the spec's max_runtime_s (SageMaker's bound)."""
        return self.options.deadline_s if self.options.deadline_s is not None else float(self.spec.max_runtime_s)

    def running_hosts(self) -> list[EmulatedHost]:
        """The hosts whose first process is still running (all of them before ``start``: none)."""
        return [host for host in self.hosts if host.name in self._processes and self._processes[host.name].poll() is None]

    def add_listener(self, listener: LineCallback) -> None:
        self._listeners.append(listener)

    def host(self, name: str) -> EmulatedHost:
        return next(host for host in self.hosts if host.name == name)

    def hosts_with_role(self, role: str) -> list[EmulatedHost]:
        return [host for host in self.hosts if host.role == role]

    def prepare(self) -> None:
        """Write every host's /opt/ml tree (once: ``start`` keeps what an earlier call chose)."""
        check_channels([channel.name for channel in self.spec.inputs], self.options.channels)
        resume = self.resume_source()  # refused before anything of this job is written
        if not self.hyperparameters:
            data_hosts = len(self.hosts_with_role("data"))
            tf_ports = (free_port(), free_port_range(max(1, data_hosts)))
            ports = (free_port(), free_port(), free_port())
            self.hyperparameters = emulated_hyperparameters(self.spec, self.options, ports, tf_ports)
            # The job's token reaches every host as a file of its platform channel, as on SageMaker.
            self.shutdown_token = secrets.token_urlsafe(24)
            # Each job gets fresh outputs, as each SageMaker job gets a fresh /opt/ml: a failure reason, a
            # summary or a model an earlier job left in this work folder is not this job's. Checkpoints stay
            # (SageMaker syncs them back from the job's S3 prefix): a rerun in the same folder resumes.
            for host in self.hosts:
                for folder in ("output", "model"):
                    shutil.rmtree(host.base_dir / folder, ignore_errors=True)
        channels = {channel.name: channel for channel in self.spec.inputs}
        for host in self.hosts:
            token = host.base_dir / "input" / "data" / PLATFORM_CHANNEL / TOKEN_FILE
            token.parent.mkdir(parents=True, exist_ok=True)
            token.write_text(self.shutdown_token)
            token.chmod(0o600)
            config = host.base_dir / "input" / "config"
            config.mkdir(parents=True, exist_ok=True)
            (config / "resourceconfig.json").write_text(json.dumps(resource_config(host, self.hosts), indent=2))
            (config / "hyperparameters.json").write_text(json.dumps(self.hyperparameters, indent=2))
            assigned = self._channels_of(host)
            platform_channels = [PLATFORM_CHANNEL] + ([CODE_CHANNEL] if self.code is not None else [])
            if resume is not None and host.role == "dnn":  # routed to the DNN group alone, as the launch Lambda routes it
                platform_channels.append(RESUME_CHANNEL)
                folder = host.base_dir / "input" / "data" / RESUME_CHANNEL
                if folder.is_symlink():
                    folder.unlink()
                folder.parent.mkdir(parents=True, exist_ok=True)
                folder.symlink_to(resume, target_is_directory=True)
            (config / "inputdataconfig.json").write_text(json.dumps(
                {**{name: {"TrainingInputMode": INPUT_MODES[channels[name].input_mode],
                           "S3DistributionType": DISTRIBUTIONS[channels[name].distribution]} for name in assigned},
                 **{name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"} for name in platform_channels}}, indent=2))
            if self.code is not None:
                archive = host.base_dir / "input" / "data" / CODE_CHANNEL / ARCHIVE_NAME
                archive.parent.mkdir(parents=True, exist_ok=True)
                archive.write_bytes(self.code.archive)
            for name in assigned:
                folder = host.base_dir / "input" / "data" / name
                folder.parent.mkdir(parents=True, exist_ok=True)
                if folder.exists() or folder.is_symlink():
                    continue
                source = self.options.channels[name].resolve()
                if channels[name].distribution == "sharded":
                    receivers = [other.name for other in self.hosts if name in self._channels_of(other)]
                    write_shard(source, folder, receivers.index(host.name), len(receivers))
                else:
                    folder.symlink_to(source, target_is_directory=True)
            for folder in ("model", "output/data", "checkpoints"):
                (host.base_dir / folder).mkdir(parents=True, exist_ok=True)

    def resume_source(self) -> Path | None:
        """The earlier run's checkpoints (its chief DNN host's, as the job's S3 prefix holds them), or None;
        EmulationError when --resume-from names a folder that holds none."""
        if self.options.resume_from is None:
            return None
        chief = self.hosts_with_role("dnn")[0]
        source = (self.options.resume_from / chief.base_dir.relative_to(self.options.workdir) / "checkpoints").resolve()
        if not source.is_dir() or not any(path.is_file() for path in source.rglob("*")):
            raise EmulationError(f"--resume-from {self.options.resume_from}: no checkpoint in {source} (give the --workdir of a run "
                                 "of this spec that wrote one: a run stopped or ended after its first checkpoint_every steps)")
        return source

    def _channels_of(self, host: EmulatedHost) -> list[str]:
        return [channel.name for channel in self.spec.inputs if host.spec_group in self.spec.group_names_for(channel)]

    def plan_report(self) -> str:
        """One line per host: what it stands for and what it got."""
        lines = []
        for host in self.hosts:
            instance = CATALOG.get(host.instance_type)
            vcpus = f"{instance.vcpus} vCPU" if instance else "vCPUs unknown"
            cpus = ",".join(map(str, host.cpus))
            quota = f" at {host.cpu_quota:g} core" if host.cpu_quota is not None else ""
            lines.append(f"{host.name}  {host.group:<20} {host.role:<4} {host.instance_type} ({vcpus}) → {host.address}, CPUs {{{cpus}}}{quota}")
        return "\n".join(lines)

    def start(self) -> None:
        self.prepare()
        launcher = [sys.executable, "-m", "training.launcher"]
        hosts_path = self.options.workdir / "hosts"
        root = os.geteuid() == 0
        if self.spec.is_script:
            check_namespaces(root, self.options.workdir / ".namespace-probe")
            hosts_path.write_text(hosts_file(self.hosts, Path("/etc/hosts").read_text(errors="replace")))
        self._quotas.create()
        self._started_at = time.monotonic()
        addresses = json.dumps({host.name: host.address for host in self.hosts})
        for host in self.hosts:
            command = launcher
            if self.spec.is_script:
                scratch = self.options.workdir / host.name / ".machine-opt"
                scratch.mkdir(parents=True, exist_ok=True)
                command = namespace_command(hosts_path, host.name, host.base_dir, scratch, launcher, root=root)
            # Each host's launcher stamps its own container start: none is inherited from this process.
            env = {key: value for key, value in os.environ.items() if key != CONTAINER_STARTED_ENV} | {
                HOST_TAG_ENV: self.host_tag(host.name),
                BASE_DIR_ENV: str(host.base_dir),
                HOST_ADDRESSES_ENV: addresses,
                "PYTHONPATH": str(REPO_ROOT),
                "PYTHONUNBUFFERED": "1",
                # The host's first process supervises its launcher, as the container's PID 1 does.
                SUPERVISE_ENV: "1",
                "OMP_NUM_THREADS": str(len(host.cpus)),
                "GLOO_SOCKET_IFNAME": "lo",
                # torch-xla's CPU device stands in for NeuronCores (the neuron variant's trainer).
                "PJRT_DEVICE": "CPU",
            }
            process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
                preexec_fn=functools.partial(_enter_host, host.cpus, self._quotas.procs_file(host.name)),
            )
            self._processes[host.name] = process
            pump = threading.Thread(target=self._pump, args=(host, process), name=f"log-{host.name}", daemon=True)
            pump.start()
            self._pumps.append(pump)

    def host_tag(self, name: str) -> str:
        return f"{self.cluster_id}/{name}"

    def host_pids(self, name: str) -> list[int]:
        """Every live process of a host: its launcher's tree and anything else carrying its tag."""
        process = self._processes[name]
        tree = process_tree(process.pid) if process.poll() is None else []
        return sorted(set(tree) | set(tagged_processes(HOST_TAG_ENV, self.host_tag(name))))

    def _pump(self, host: EmulatedHost, process: subprocess.Popen) -> None:
        log_path = self.options.workdir / "logs" / f"{host.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w", buffering=1) as log_file:  # line-buffered: a killed run's log is whole
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                if host.role == "dnn" and line.startswith("step="):
                    self._trained = True
                for listener in self._listeners:
                    listener(host, line.rstrip("\n"))

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal every process of a host, as an instance failure would (SIGKILL) or a hang (SIGSTOP)."""
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self._outcomes[name].killed_on_request = True
        _signal_all(self.host_pids(name), sig)

    def kill_launcher(self, name: str, sig: signal.Signals) -> None:
        """Signal a host's first process alone (its supervisor, which passes SIGTERM and SIGINT on to the
        launcher), as SageMaker signals a container's first process (StopTrainingJob)."""
        _signal_all([self._processes[name].pid], sig)

    def pid(self, name: str) -> int:
        return self._processes[name].pid

    def stop(self, what: str) -> None:
        """What StopTrainingJob does: SIGTERM to every host's first process (the DNN hosts' trainers save a
        checkpoint and the model), and after ``stop_grace_s`` SIGKILL to whatever still runs (``wait``
        does that). ``what`` stopped it, for the result. A second call changes nothing."""
        if self._stopping is not None:
            return
        self._stopping = (what, time.monotonic())
        for process in self._processes.values():
            if process.poll() is None:
                _signal_all([process.pid], signal.SIGTERM)

    def wait(self) -> ClusterResult:
        deadline = self._started_at + self.deadline_s
        dnn_ended_at: float | None = None
        deadline_exceeded = False
        while True:
            now = time.monotonic()
            for name, process in self._processes.items():
                outcome = self._outcomes[name]
                if outcome.exit_code is None and process.poll() is not None:
                    outcome.exit_code, outcome.ended_at = process.returncode, now
                    # The container stops with its entrypoint: nothing of the host runs on.
                    leftovers = self.host_pids(name)
                    outcome.leftovers = len(leftovers)
                    _signal_all(leftovers, signal.SIGKILL)
                    failure = self.host(name).base_dir / "output" / "failure"
                    outcome.failure = failure.read_text(errors="replace").strip() if failure.is_file() else ""
            running = [name for name, outcome in self._outcomes.items() if outcome.exit_code is None]
            if not running:
                break
            if dnn_ended_at is None and all(self._outcomes[h.name].exit_code is not None for h in self.hosts_with_role("dnn")):
                dnn_ended_at = now
            if dnn_ended_at is not None and now > orphan_deadline(dnn_ended_at, self.options, self._trained):
                for name in running:
                    if self._processes[name].poll() is not None:
                        continue  # it ended since it was looked at above: its exit is recorded next time round
                    self._outcomes[name].orphaned = True
                    _signal_all(self.host_pids(name), signal.SIGKILL)
            elif self._stopping is not None and now > self._stopping[1] + self.options.stop_grace_s:
                for name in running:
                    self._outcomes[name].killed_after_stop_grace = True
                    _signal_all(self.host_pids(name), signal.SIGKILL)
            elif self._stopping is None and now > deadline:
                deadline_exceeded = True
                for name in running:
                    self._outcomes[name].killed_at_deadline = True
                    _signal_all(self.host_pids(name), signal.SIGKILL)
            time.sleep(0.1)
        for pump in self._pumps:
            pump.join(timeout=10)
        stopped_by = self._stopping[0] if self._stopping is not None else None
        return ClusterResult(list(self._outcomes.values()), time.monotonic() - self._started_at, deadline_exceeded, stopped_by)

    def run(self) -> ClusterResult:
        self.start()
        try:
            return self.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Kill whatever is left (an interrupted run must not leave processes behind)."""
        for name, process in self._processes.items():
            _signal_all(self.host_pids(name), signal.SIGKILL)
            if process.poll() is None:
                process.wait()
        self._quotas.remove()

    def summary(self) -> dict[str, Any] | None:
        """The chief DNN host's summary.json, if training got that far."""
        path = self.hosts_with_role("dnn")[0].base_dir / "output" / "data" / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


def _enter_host(cpus: tuple[int, ...], quota_procs: Path | None) -> None:
    """Runs in a host's first process before exec: its CPU set, and its CPU quota when it has one."""
    os.sched_setaffinity(0, cpus)
    enter_quota(quota_procs)


def tagged_processes(variable: str, value: str) -> list[int]:
    """Processes of this user whose environment holds ``variable=value`` (inherited by every descendant)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # ended while we looked, or not ours
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Signal a host's processes at once (collected first: a dead parent's children get reparented)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class LineWatcher:
    """A line listener that keeps every host's lines and lets a caller wait for one (fault injection in
    the tests and bench/faults.py: act when a host prints a given line)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self._changed = threading.Condition()

    def __call__(self, host: EmulatedHost, line: str) -> None:
        with self._changed:
            self.lines.append((host.name, line))
            self._changed.notify_all()

    def wait_for(self, host: str, pattern: str, timeout: float = 90.0) -> None:
        """Block until ``host`` printed a line matching ``pattern``; AssertionError after ``timeout``."""
        regex = re.compile(pattern)
        with self._changed:
            found = self._changed.wait_for(lambda: any(h == host and regex.search(line) for h, line in self.lines), timeout)
        if not found:
            raise AssertionError(f"{host} never printed {pattern!r}")

    def of(self, host: str) -> list[str]:
        with self._changed:
            return [line for h, line in self.lines if h == host]


_print_lock = threading.Lock()
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _print_line(host: EmulatedHost, line: str) -> None:
    with _print_lock:
        print(f"[{host.label}] {ANSI.sub('', line)}", file=sys.stderr, flush=True)

