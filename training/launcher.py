"""The entrypoint on every host of a training job: find this host's instance group, then serve or train.

SageMaker runs one image on every instance of every instance group; this module is its entrypoint. It
reads ``resourceconfig.json`` to learn the host's group, and the job's role map (a hyperparameter) to
learn what the group does:

* data role: serve preprocessed batches (training/data_host.py);
* dnn role: run the trainer across the DNN group and end the data hosts after it (training/dnn_host.py,
  its trainers watched by training/trainer_watch.py);
* a script-mode job: the user's own script, on either role (training/script_mode.py).

Everything is checked here, before any role starts: a malformed resourceconfig.json, a group missing
from the role map, an unknown hyperparameter, a workload that does not load or a missing channel ends
the host with exit code 2 and one clear line. The launcher reads the host's environment once
(training/host_environment.py) and hands it to the role; when it is the container's first process it
runs itself under a supervisor (training/supervisor.py) that kills it if it stops heartbeating.

The image runs this module as its entrypoint (training/images/Dockerfile), so that it is the process
SageMaker's SIGTERM reaches; SageMaker appends the word ``train``, which is accepted and ignored.

    SAGEMAKER_BASE_DIR=/tmp/host1/opt/ml python -m training.launcher
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.cluster import ClusterConfigError
from training.data_host import KerasWorkloadCode, fail_data_host, run_data_host, run_workload_data_host
from training.data_service.dataset import ChannelError
from training.data_service.server import DataHostError, PortInUseError, StopReason
from training.data_service.tf_service import TfServiceError
from training.dnn_host import run_dnn_host
from training.failure import write_failure
from training.host_environment import (
    CONTAINER_STARTED_ENV,
    WORKLOAD_DIR_ENV,
    WORKLOAD_MODULE_ENV,
    WORKLOAD_PACKAGES_ENV,
    HostEnvironment,
)
from training.hyperparameters import (
    DATA,
    DNN,
    HyperparameterError,
    PlatformSettings,
    build,
    parse_settings,
    platform_keys,
)
from training.processes import CONFIG_ERROR_EXIT
from training.stop_signals import restore_stop_signals
from training.supervisor import HEARTBEAT_FD_ENV, SUPERVISE_ENV, start_heartbeat, supervise
from training.variants import VARIANTS, Variant
from training.workload.code import CodeError, install_requirements
from training.workload.contract import WorkloadError
from training.workload.host import (
    CACHE_DIR_ENV,
    PreparedWorkload,
    builtin_workload,
    prepare,
    unpack_on_host,
)
from training.workload.tf_contract import module_constant

log = logging.getLogger("training.launcher")


def trainer_for(variant: str) -> Variant:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise HyperparameterError(f"variant {variant!r} has no trainer in this image; known: {sorted(VARIANTS)}") from None


def main() -> int:
    # Before any child: the ranks, torchrun, tf.data.service and a user's script then start with SIGINT and
    # SIGTERM at their defaults (a stop of the other ranks is a SIGINT), however this process was started.
    restore_stop_signals()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    if sys.argv[1:] not in ([], ["train"]):  # SageMaker starts the image with the argument "train"
        log.error("usage: python -m training.launcher [train]; got %s", sys.argv[1:])
        return CONFIG_ERROR_EXIT
    # Time to first batch counts from here (the supervised launcher inherits the supervisor's stamp).
    os.environ.setdefault(CONTAINER_STARTED_ENV, repr(time.time()))
    if os.getpid() == 1 or os.environ.get(SUPERVISE_ENV) == "1":
        return supervise([sys.executable, "-m", "training.launcher", *sys.argv[1:]])
    workload: PreparedWorkload | None = None
    keras_workload: KerasWorkloadCode | None = None
    packages_dir: Path | None = None
    trainer_env: dict[str, str] = {}
    try:
        host = HostEnvironment.read()  # the one read of this host's files: every role below is handed it
        # Node-local caches of workloads (the text built-in's tokenised channels) on the job's volume, not
        # the container's own disk; every process on the host inherits it.
        os.environ.setdefault(CACHE_DIR_ENV, str(host.cache_dir))
        cluster, hyperparameters = host.cluster, host.hyperparameters
        if hyperparameters.get("script_entry_point") or hyperparameters.get("script_command"):
            return run_script(host)
        variant = trainer_for(str(hyperparameters.get("variant", "pytorch")))
        if hyperparameters.get("workload_module") and variant.contract == "tensorflow":
            # A user's TensorFlow workload: unpacked and installed here; its module is imported and checked
            # by the processes that run TensorFlow (the dispatcher host's tf.data.service child, the trainers).
            settings, config, keras_workload = keras_job_on_host(host)
            trainer_env = {WORKLOAD_DIR_ENV: str(keras_workload.code_dir), WORKLOAD_PACKAGES_ENV: str(keras_workload.packages_dir or "")}
        elif hyperparameters.get("workload_module") or (variant.user_workloads and variant.contract == "pytorch"):
            # A PyTorch workload, before the role split: a user's code unpacked, installed, imported and
            # checked on every host (a built-in's is in the image), and the job's hyperparameters split
            # between platform, loop and workload.
            module = ""
            if hyperparameters.get("workload_module"):
                platform = {key: value for key, value in hyperparameters.items() if key in platform_keys()}
                code_dir, packages_dir = unpack_on_host(build(PlatformSettings, platform | {"shutdown_token": host.shutdown_token}), host)
            else:
                code_dir, module = builtin_workload(variant)
            workload = prepare(code_dir, packages_dir, host, raw=hyperparameters, module=module)
            settings, config = workload.settings, workload.config
            trainer_env = {WORKLOAD_DIR_ENV: str(code_dir), WORKLOAD_PACKAGES_ENV: str(packages_dir or ""), WORKLOAD_MODULE_ENV: module}
        else:
            settings, config = parse_settings(hyperparameters, variant.config, host.shutdown_token)
        settings.check_cluster(cluster)
        if getattr(config, "precompile_steps", 0) and variant.name != "neuron":
            # Refused on every host alike, so that no data host is left serving a trainer that never starts.
            raise HyperparameterError(f"precompile_steps pre-compiles a Trainium job's Neuron graphs: variant {variant.name!r} has none")
        if settings.distribution not in variant.distributions:
            raise HyperparameterError(
                f"variant {variant.name!r} runs with distribution {list(variant.distributions)}, not {settings.distribution!r}"
            )
        role = settings.role_of(cluster.current_group)
        log.info("host %s is in instance group %s (%s): role %s", cluster.current_host, cluster.current_group, cluster.current_instance_type, role)
        start_heartbeat(settings.launcher_heartbeat_timeout_s, cluster.current_host, role)
        os.environ.pop(HEARTBEAT_FD_ENV, None)  # the trainers' environment is ours: the pipe is not theirs
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    except (ClusterConfigError, HyperparameterError, CodeError, WorkloadError) as error:
        return refuse(error)
    try:
        if role == DATA:
            try:
                if workload is not None:
                    return run_workload_data_host(host, workload, stop, packages_dir)
                return run_data_host(host, settings, variant, config, stop, keras_workload)
            except WorkloadError as error:
                return fail_data_host(host, settings, f"{type(error).__name__}: {error}", CONFIG_ERROR_EXIT, stop)
            except (ChannelError, TfServiceError, DataHostError, PortInUseError) as error:
                # A channel that is wrong exits as a usage error; anything else as failed preprocessing.
                code = CONFIG_ERROR_EXIT if isinstance(error, ChannelError) else StopReason.FAILED.exit_code
                message = str(error) if isinstance(error, DataHostError) else f"{type(error).__name__}: {error}"
                return fail_data_host(host, settings, message, code, stop)
            except Exception as error:
                # An error nobody named (a bug): the DNN hosts still hear why now, rather than at their batch
                # deadline; then it propagates, with its traceback, as the host's failure.
                fail_data_host(host, settings, f"data host {cluster.current_host} failed: {type(error).__name__}: {error}",
                               StopReason.FAILED.exit_code, stop)
                raise
        return run_dnn_host(host, settings, variant, stop, precompile_steps=getattr(config, "precompile_steps", 0), workload=workload,
                            trainer_env=trainer_env, keras_workload=keras_workload)
    except (HyperparameterError, ChannelError, PortInUseError, WorkloadError) as error:
        return refuse(error)


def keras_job_on_host(host: HostEnvironment) -> tuple[PlatformSettings, Any, KerasWorkloadCode]:
    """A TensorFlow user workload's code unpacked and installed on this host, and the job's settings: the
    platform's and the loop's (KerasWorkloadConfig); the module's own are checked where it is imported."""
    from training.trainers.config import KerasWorkloadConfig

    known = platform_keys() | {item.name for item in dataclasses.fields(KerasWorkloadConfig)} | {"variant"}
    hyperparameters, token = host.hyperparameters, host.shutdown_token
    platform, _ = parse_settings({key: value for key, value in hyperparameters.items() if key in known}, KerasWorkloadConfig,
                                 token, also_known=frozenset(hyperparameters) - known)
    code_dir, packages_dir = unpack_on_host(platform, host)
    # The module's LOOP_DEFAULTS under the job's values, as the trainer splits them (a batch_size set there
    # is the data hosts' too): read from its source, since this process does not import TensorFlow.
    defaults = module_constant(code_dir, platform.workload_module, "LOOP_DEFAULTS") or {}
    if not isinstance(defaults, Mapping):
        raise WorkloadError(f"LOOP_DEFAULTS in {platform.workload_module} must be a dict of loop setting → default value")
    raw = {key: str(value) for key, value in defaults.items()} | dict(hyperparameters)
    settings, config = parse_settings({key: value for key, value in raw.items() if key in known}, KerasWorkloadConfig,
                                      token, also_known=frozenset(raw) - known)
    return settings, config, KerasWorkloadCode(code_dir, packages_dir, settings.workload_module)


def run_script(host: HostEnvironment) -> int:
    """A script-mode host (training/script_mode.py): the code unpacked and installed, then the user's script
    run as it is under this launcher. Its hyperparameters beyond the platform's are the script's own."""
    from training.script_mode import DEFAULT_REQUIREMENTS, run_script_host

    cluster, hyperparameters = host.cluster, host.hyperparameters
    try:
        platform = {key: value for key, value in hyperparameters.items() if key in platform_keys()}
        settings = build(PlatformSettings, platform | {"shutdown_token": host.shutdown_token})
        settings.check_cluster(cluster)
        role = settings.role_of(cluster.current_group)
    except HyperparameterError as error:
        return refuse(error)
    log.info("host %s is in instance group %s (%s): %s of a script job", cluster.current_host, cluster.current_group,
             cluster.current_instance_type, "trainer" if role == DNN else "data host")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        code_dir, packages_dir = unpack_on_host(settings, host)
        if not settings.workload_requirements and (code_dir / DEFAULT_REQUIREMENTS).is_file():
            # As the toolkit does: a requirements.txt in the code is installed whether or not the spec names it.
            packages_dir = install_requirements(code_dir, DEFAULT_REQUIREMENTS)
        start_heartbeat(settings.launcher_heartbeat_timeout_s, cluster.current_host, role)
        os.environ.pop(HEARTBEAT_FD_ENV, None)  # the script's environment is ours: the pipe is not its
        return run_script_host(host, settings, code_dir, packages_dir, stop)
    except PortInUseError as error:
        if role == DATA:  # this host's alone: the trainer hosts hear why now, rather than wait on a data service that never comes
            return fail_data_host(host, settings, f"{type(error).__name__}: {error}", CONFIG_ERROR_EXIT, stop)
        return refuse(error)
    except (HyperparameterError, CodeError) as error:  # the job's: every host refuses it alike
        return refuse(error)


def refuse(error: Exception) -> int:
    """A job that is wrong on this host: one clear line, the failure reason, the usage-error exit code."""
    message = f"{type(error).__name__}: {error}"
    log.error("%s", message)
    write_failure(message)
    return CONFIG_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
