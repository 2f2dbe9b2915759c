"""The container's contract: the job's hyperparameters, parsed into typed settings.

SageMaker passes hyperparameters as a string → string map (``/opt/ml/input/config/hyperparameters.json``).
Two kinds share it:

* platform settings, written by whoever launches the job (the launch Lambda, or the emulated cluster):
  the role of each instance group, ports and timeouts;
* the trainer's own settings (batch size, steps, model...), written by the user in the job spec.

The toolkit adds keys of its own, all prefixed ``sagemaker_``; they are left alone. Any other key that
neither the platform nor the trainer knows is refused before anything starts, with the nearest known
name, so that a typo (``lerning_rate``) fails the job in seconds instead of training with a default.

Both sides build and read these keys through this module only (``PlatformSettings.to_hyperparameters``
and ``parse_settings``), so no key is spelled twice.

The per-job shutdown token is not among them: hyperparameters are shown by DescribeTrainingJob to anyone
who may describe the job, land in every poll's execution history, and are logged. The launcher writes it
to S3 and the job receives it as a file in its own channel (``/opt/ml/input/data/platform/shutdown_token``),
which only the job's role can read; ``load_settings`` reads both.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from training.cluster import Cluster, address_of, config_dir

DATA = "data"
DNN = "dnn"
ROLES = (DATA, DNN)
DISTRIBUTIONS = ("torchrun", "horovod", "mirrored", "none")
RESERVED_PREFIX = "sagemaker_"
# The input channel every trainer (or its data hosts) trains from.
DATA_CHANNEL = "train"
# The channel the platform adds to every job, on every host: the shutdown token, as a file.
PLATFORM_CHANNEL = "platform"
# The channel a resuming run gets on its DNN hosts: the earlier run's checkpoints, which seed this run's
# own (/opt/ml/checkpoints, synced to checkpoints/<this run>/): a run never writes into another's.
RESUME_CHANNEL = "resume"
TOKEN_FILE = "shutdown_token"
# The channel a user workload's code arrives in, on every host: its packed folder (training/workload/code.py),
# as SageMaker's own script mode ships a source_dir (a channel routed to every instance group).
CODE_CHANNEL = "code"
# The packed code's name in that channel, and below code/<sha256>/ in the results bucket.
CODE_ARCHIVE = "sourcedir.tar.gz"
# Platform settings that never travel in hyperparameters.
SECRET_SETTINGS = frozenset({"shutdown_token"})

T = TypeVar("T")

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
SHA256 = re.compile(r"[0-9a-f]{64}")


def is_relative_path(path: str) -> bool:
    """A path that stays inside the folder it is relative to (no root, no '..', no backslash). Pure."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\\" not in path and all(part not in ("", "..") for part in parts)


class HyperparameterError(ValueError):
    """A hyperparameter is unknown, missing, or has a value of the wrong kind."""


class RoleMapError(HyperparameterError):
    """The role map does not give every instance group of the job exactly one known role."""


@dataclass(frozen=True)
class PlatformSettings:
    """What the launcher needs to know about the job beyond the trainer's own settings."""

    # Instance group name → "data" or "dnn". No group name is hard-coded anywhere else.
    role_map: Mapping[str, str]
    # Random per job; every call between hosts carries it. Never logged, never a hyperparameter: it comes
    # from the platform channel's file (load_settings). Empty where settings only become hyperparameters
    # (the launch side); a host's settings always have one (parse_settings), and no server starts without.
    shutdown_token: str = ""
    # Which trainer runs on the DNN group ("pytorch" here; "tensorflow" and "neuron" follow).
    variant: str = "pytorch"
    # A user workload (training/workload/): the module to import from the code channel's folder, the
    # SHA-256 of the packed folder (the launcher refuses any other), and its requirements file inside the
    # folder ("" for none). An empty module: the variant's built-in workload.
    workload_module: str = ""
    workload_sha256: str = ""
    workload_requirements: str = ""
    # Script mode (training/script_mode.py): the user's entry point in the code folder, or a shell command
    # run there, started once per host with the SageMaker toolkit's environment; where its log says a
    # step's time (a regex with one group; "": the platform's step_time_ms= lines), in ms or s, and how
    # many first steps are warm-up. An empty entry point and command: not a script.
    script_entry_point: str = ""
    script_command: str = ""
    script_step_time_regex: str = ""
    script_step_time_unit: str = "ms"
    script_warmup_steps: int = 1
    # How the trainer spans the DNN group: "torchrun" (PyTorch), "horovod" (one process per device on
    # every DNN host, gloo rendezvous on the first), "mirrored" (tf.distribute, one process on one host),
    # "none" (one process). Each variant accepts some of them (training/variants.py).
    distribution: str = "torchrun"
    # Trainer processes per DNN host; 0 means one per GPU, or one on a host without GPUs.
    processes_per_host: int = 0
    # The input channel the data service reads (/opt/ml/input/data/<channel>).
    data_channel: str = DATA_CHANNEL
    # Port of the gRPC data service on every data host.
    data_service_port: int = 6000
    # tf.data.service (tensorflow variant): the dispatcher's port on the first data host, and the first
    # worker port (data host i listens on tf_worker_port + i, so emulated hosts sharing one machine's
    # wildcard-bound ports do not collide).
    tf_dispatcher_port: int = 6100
    tf_worker_port: int = 6200
    # torchrun's (or Horovod's) rendezvous port on the first DNN host.
    master_port: int = 29500
    # Port of every DNN host's launcher, where data hosts that cannot serve report why (ReportFailure).
    job_control_port: int = 6001
    # A data host exits when no batch was asked for this long after its last client left.
    data_idle_timeout_s: float = 120.0
    # A data host exits with an error when no client came this long after it started.
    data_start_deadline_s: float = 900.0
    # How long a DNN process waits for the data hosts to come up, and for a lost host to come back.
    data_connect_timeout_s: float = 300.0
    # A stream that brings no batch for this long while its trainer waits is a hung host: it is cancelled,
    # retried, then dropped. Generous: a data host making one batch takes well under a second.
    data_batch_timeout_s: float = 60.0
    # tensorflow: the job fails when the tf.data.service dispatcher's host, having answered once, is silent
    # this long and no trainer step ended for as long (batches stopped, not just the control plane).
    dispatcher_silence_s: float = 30.0
    # Where the Neuron compiler keeps compiled graphs between jobs (s3://...); empty: no persistent cache.
    neuron_compile_cache_uri: str = ""
    # A DNN host fails with TrainerStalled when no trainer process of it finished a step for this long: a
    # frozen or deadlocked rank holds every rank in the next collective, and torch's own collective timeout
    # (10 or 30 minutes) would keep every host billed. Longer than what may come between two steps (a
    # checkpoint, a validation pass) and than the trainers' own wait for a lost data host
    # (data_connect_timeout_s + data_batch_timeout_s), whose error names more. 0: no such rule.
    trainer_stall_timeout_s: float = 900.0
    # The same rule before the first step, which waits for imports, the data hosts' start and a first
    # compile (XLA, or Neuron graphs that were not pre-compiled). 0: no such rule.
    trainer_first_step_timeout_s: float = 3600.0
    # Once every rank passed the final barrier (the model and the summary saved), how long the trainer
    # processes may take to exit (a hung torchrun, a NCCL teardown that never returns) before the launcher
    # kills them and exits 0: the work is saved. 0: wait for ever.
    trainer_exit_timeout_s: float = 120.0
    # The container's first process kills a launcher that sent it no heartbeat for this long (a frozen
    # process: its host would never exit, and keep the job billed) and fails the host with LauncherFrozen.
    # The beats come from a thread of their own every tenth of this (at most 10 s). 0: no heartbeat.
    launcher_heartbeat_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        bad_roles = {group: role for group, role in self.role_map.items() if role not in ROLES}
        if bad_roles:
            raise RoleMapError(f"role_map gives unknown roles {bad_roles}; each role must be one of {ROLES}")
        if list(self.role_map.values()).count(DNN) != 1:
            raise RoleMapError(f"role_map must name exactly one '{DNN}' group, got {dict(self.role_map)}")
        if self.distribution not in DISTRIBUTIONS:
            raise HyperparameterError(f"distribution {self.distribution!r} is not one of {DISTRIBUTIONS}")
        if self.shutdown_token and len(self.shutdown_token) < 16:
            raise HyperparameterError("shutdown_token must be a random string of at least 16 characters")
        for name in ("data_service_port", "master_port", "tf_dispatcher_port", "tf_worker_port", "job_control_port"):
            if not 1024 <= getattr(self, name) <= 65535:
                raise HyperparameterError(f"{name} must be a port in 1024..65535, got {getattr(self, name)}")
        if self.workload_module and not MODULE_NAME.fullmatch(self.workload_module):
            raise HyperparameterError(f"workload_module {self.workload_module!r} must be a dotted Python module name (workload, my_pkg.train)")
        if self.workload_module and not SHA256.fullmatch(self.workload_sha256):
            raise HyperparameterError("workload_sha256 must be the 64 hex digits of the packed code's SHA-256")
        if self.workload_requirements and not is_relative_path(self.workload_requirements):
            raise HyperparameterError(f"workload_requirements {self.workload_requirements!r} must be a relative path inside the code folder")
        if self.script_entry_point and self.script_command:
            raise HyperparameterError("script_entry_point and script_command: a script job runs one of them")
        if self.script_entry_point and not is_relative_path(self.script_entry_point):
            raise HyperparameterError(f"script_entry_point {self.script_entry_point!r} must be a relative path inside the code folder")
        if self.is_script and not SHA256.fullmatch(self.workload_sha256):
            raise HyperparameterError("workload_sha256 must be the 64 hex digits of the packed code's SHA-256")
        if self.script_step_time_unit not in ("ms", "s"):
            raise HyperparameterError(f"script_step_time_unit must be ms or s, got {self.script_step_time_unit!r}")
        if self.script_step_time_regex:
            try:
                groups = re.compile(self.script_step_time_regex).groups
            except re.error as error:
                raise HyperparameterError(f"script_step_time_regex {self.script_step_time_regex!r} is not a regular expression: {error}") from None
            if groups != 1:
                raise HyperparameterError(f"script_step_time_regex {self.script_step_time_regex!r} must have exactly one group, the step's time")
        if self.script_warmup_steps < 0:
            raise HyperparameterError(f"script_warmup_steps must be 0 or more, got {self.script_warmup_steps}")
        for name in ("trainer_stall_timeout_s", "trainer_first_step_timeout_s", "trainer_exit_timeout_s", "launcher_heartbeat_timeout_s"):
            if getattr(self, name) < 0:
                raise HyperparameterError(f"{name} must be 0 (no bound) or a number of seconds, got {getattr(self, name)}")

    @property
    def is_script(self) -> bool:
        return bool(self.script_entry_point or self.script_command)

    def role_of(self, group: str) -> str:
        try:
            return self.role_map[group]
        except KeyError:
            raise RoleMapError(
                f"instance group {group!r} is not in the role map {dict(self.role_map)}: "
                f"add it as '{DATA}' or '{DNN}'"
            ) from None

    def groups_with_role(self, role: str) -> list[str]:
        return [group for group, group_role in self.role_map.items() if group_role == role]

    def data_hosts(self, cluster: Cluster) -> list[str]:
        """Every host of every data group, in the order the groups appear in the role map."""
        return [host for group in self.groups_with_role(DATA) for host in cluster.group(group).hosts]

    def data_service_targets(self, cluster: Cluster, addresses: Mapping[str, str]) -> list[str]:
        """host:port of the data service on every data host."""
        return [f"{address_of(host, addresses)}:{self.data_service_port}" for host in self.data_hosts(cluster)]

    def job_control_targets(self, cluster: Cluster, addresses: Mapping[str, str]) -> list[str]:
        """host:port of the ReportFailure server on every DNN host."""
        hosts = [host for group in self.groups_with_role(DNN) for host in cluster.group(group).hosts]
        return [f"{address_of(host, addresses)}:{self.job_control_port}" for host in hosts]

    def tf_data_service_addresses(self, cluster: Cluster, addresses: Mapping[str, str]) -> tuple[str, list[str]]:
        """The tf.data.service dispatcher (host:port) and every data host's worker address, in order."""
        hosts = self.data_hosts(cluster)
        workers = [f"{address_of(host, addresses)}:{self.tf_worker_port + index}" for index, host in enumerate(hosts)]
        return f"{address_of(hosts[0], addresses)}:{self.tf_dispatcher_port}", workers

    def check_cluster(self, cluster: Cluster) -> None:
        """Every group of the running job needs a role, and every group in the map must exist."""
        for group in cluster.group_names:
            self.role_of(group)
        missing = sorted(set(self.role_map) - set(cluster.group_names))
        if missing:
            raise RoleMapError(f"role_map names groups {missing} that this job does not have: {cluster.group_names}")

    def to_hyperparameters(self) -> dict[str, str]:
        """The string map SageMaker's HyperParameters field takes: every setting but the secret ones."""
        return {item.name: to_hyperparameter_string(getattr(self, item.name)) for item in fields(self) if item.name not in SECRET_SETTINGS}


def platform_keys() -> frozenset[str]:
    return frozenset(item.name for item in fields(PlatformSettings))


def load_hyperparameters(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    path = config_dir(environ) / "hyperparameters.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HyperparameterError(f"{path} does not exist") from None
    except json.JSONDecodeError as error:
        raise HyperparameterError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise HyperparameterError(f"{path} must hold a JSON object")
    return raw


def token_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the job's shutdown token arrives: a file in the platform channel."""
    return config_dir(environ).parent / "data" / PLATFORM_CHANNEL / TOKEN_FILE


def load_shutdown_token(environ: Mapping[str, str] = os.environ) -> str:
    path = token_path(environ)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise HyperparameterError(f"{path} does not exist: the job has no {PLATFORM_CHANNEL!r} channel with its shutdown token") from None


def load_settings(trainer_config: type[T], environ: Mapping[str, str] = os.environ,
                  hyperparameters: Mapping[str, Any] | None = None) -> tuple[PlatformSettings, T]:
    """The job's settings as this host receives them: hyperparameters.json and the token file."""
    raw = load_hyperparameters(environ) if hyperparameters is None else hyperparameters
    return parse_settings(raw, trainer_config, load_shutdown_token(environ))


def parse_settings(raw: Mapping[str, Any], trainer_config: type[T], shutdown_token: str,
                   also_known: frozenset[str] = frozenset()) -> tuple[PlatformSettings, T]:
    """Split the job's hyperparameters into platform settings and the trainer's config, refusing any key
    that belongs to neither, and any secret that came as a hyperparameter. ``also_known``: names a caller
    takes itself (a user workload's own), suggested for a typo like the others."""
    leaked = sorted(SECRET_SETTINGS & set(raw))
    if leaked:
        raise HyperparameterError(f"{leaked[0]} must not be a hyperparameter (DescribeTrainingJob shows those): "
                                  f"the platform delivers it in the {PLATFORM_CHANNEL!r} channel")
    known = platform_keys() | {item.name for item in fields(trainer_config)} | also_known
    unknown = sorted(key for key in raw if key not in known and not key.startswith(RESERVED_PREFIX))
    if unknown:
        raise HyperparameterError("; ".join(_unknown_message(key, known) for key in unknown))
    known -= also_known
    if len(shutdown_token) < 16:
        raise HyperparameterError(f"the job's shutdown token ({TOKEN_FILE} in the {PLATFORM_CHANNEL!r} channel) must be a random "
                                  "string of at least 16 characters")
    platform = {key: value for key, value in raw.items() if key in platform_keys()} | {"shutdown_token": shutdown_token}
    trainer = {key: value for key, value in raw.items() if key not in platform_keys() and key in known}
    return build(PlatformSettings, platform), build(trainer_config, trainer)


def build(cls: type[T], raw: Mapping[str, Any], strict: bool = False) -> T:
    """Instantiate a config dataclass from SageMaker's string values, converting each to its field's type;
    with ``strict``, a key that is not a field is refused."""
    if strict:
        known = {item.name for item in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(raw) - known)
        if unknown:
            raise HyperparameterError("; ".join(_unknown_message(key, known) for key in unknown))
    values = {}
    hints = typing.get_type_hints(cls)
    for item in fields(cls):  # type: ignore[arg-type]
        if item.name not in raw:
            if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                raise HyperparameterError(f"hyperparameter {item.name!r} is required")
            continue
        values[item.name] = _convert(item.name, raw[item.name], hints[item.name])
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        if isinstance(error, HyperparameterError):
            raise
        raise HyperparameterError(str(error)) from None


def config_to_dict(config: Any) -> dict[str, Any]:
    return {item.name: _plain(getattr(config, item.name)) for item in fields(config)}


def _convert(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            return _to_bool(value)
        if hint in (int, float, str):
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            converted = hint(value) if not (hint is int and isinstance(value, str)) else int(value, 10)
            if hint is float and not math.isfinite(converted):
                raise ValueError(value)  # "nan", "inf": a learning rate nothing can train with
            return converted
        if origin is collections.abc.Mapping:
            parsed = json.loads(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict):
                raise ValueError(value)
            return types.MappingProxyType({str(k): str(v) for k, v in parsed.items()})
    except (ValueError, TypeError, json.JSONDecodeError):
        raise HyperparameterError(f"hyperparameter {name!r}={value!r} is not a valid {_type_name(hint)}") from None
    raise HyperparameterError(f"hyperparameter {name!r} has an unsupported type {hint}")


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(value)


def to_hyperparameter_string(value: Any) -> str:
    """A value as SageMaker's string → string HyperParameters carry it (and ``build`` reads it back)."""
    if isinstance(value, Mapping):
        return json.dumps(dict(value), sort_keys=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _type_name(hint: Any) -> str:
    return "JSON object" if typing.get_origin(hint) is collections.abc.Mapping else hint.__name__


def _unknown_message(key: str, known: frozenset[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown hyperparameter {key!r}{hint}"

