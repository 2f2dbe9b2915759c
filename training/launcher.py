"""The entrypoint on every host of a training job: find this host's instance group, then serve or train.

SageMaker runs one image on every instance of every instance group; this module is its entrypoint. It
reads ``resourceconfig.json`` to learn the host's group, and the job's role map (a hyperparameter) to
learn what the group does:

* data role: serve preprocessed batches (our gRPC stream, training/data_service/server.py, or
  tf.data.service for the tensorflow variant, training/data_service/tf_service.py) until an
  authenticated shutdown, an idle timeout (the DNN hosts are gone), or a start deadline. A data host
  that cannot serve (taken port, empty or undecodable channel, tf.data.service that did not start)
  writes its reason to the failure file and reports it to every DNN host before it exits;
* dnn role: run the trainer across the DNN group (torchrun; Horovod ranks started per host,
  training/horovod_launch.py; or one plain process), keep the data hosts told that it runs, listen for
  data hosts' failure reports, then tell every data host to shut down so none keeps running, and
  billing, after training.

Everything is checked before anything starts: a malformed resourceconfig.json, a group missing from the
role map, an unknown hyperparameter or a missing channel ends the host with exit code 2 and one clear
line. The trainer's exit code is this host's exit code; a trainer killed by a signal exits 128 + signal,
and the failure reason names the rank and the signal. SIGTERM (StopTrainingJob, a spot interruption) is
passed to the trainers, which save a checkpoint and the model at the next step boundary; SageMaker
sends SIGKILL 120 s later, so they get STOP_GRACE_S.

Nothing frozen keeps the job billed: a DNN host whose trainers make no progress for
``trainer_stall_timeout_s`` fails with TrainerStalled (the marks they write after every step, every
evaluation batch and around every save, timed on the monotonic clock; marks already in the folder when
they start are not theirs); a failure the launcher decides kills the trainers' whole tree at once (an
abort saves nothing, and a stopped process ignores SIGINT); a finished run whose processes do not exit
within ``trainer_exit_timeout_s`` is killed and the host exits 0 (the work is saved), and so does a host
whose trainer crashed after every local rank's done mark (a teardown crash: TrainerCrashedAfterSaving,
a warning); and the container's first process kills a launcher that stopped heartbeating
(LauncherFrozen), so that its host exits: non-zero on a DNN host, 0 on a data host (its trainers go on with
the other data hosts; the reason is logged and left in the host's output/data).

The image runs this module as its entrypoint (training/images/Dockerfile), so that it is the process
SageMaker's SIGTERM reaches; SageMaker appends the word ``train``, which is accepted and ignored.

    SAGEMAKER_BASE_DIR=/tmp/host1/opt/ml python -m training.launcher
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from training.cluster import Cluster, ClusterConfigError, address_of, base_dir
from training.data_service.dataset import (
    ChannelError,
    EmptyChannelError,
    scan_image_files,
    scan_images,
    scan_text_channel,
)
from training.data_service.server import DataHostError, PortInUseError, StopReason
from training.data_service.tf_service import TfServiceError
from training.failure import RANK_FAILURE_ENV, failure_path, write_failure, write_quietly
from training.host_environment import (
    CONTAINER_STARTED_ENV,
    PROGRESS_DIR_ENV,
    WORKLOAD_DIR_ENV,
    WORKLOAD_MODULE_ENV,
    WORKLOAD_PACKAGES_ENV,
    HostEnvironment,
)
from training.hyperparameters import (
    DATA,
    DNN,
    RESUME_CHANNEL,
    HyperparameterError,
    PlatformSettings,
    build,
    parse_settings,
    platform_keys,
)
from training.stop_signals import restore_stop_signals
from training.trainers.loop import DONE_MARK
from training.variants import VARIANTS, WORKLOAD_TRAINER, Variant
from training.workload.code import CodeError, install_requirements
from training.workload.contract import WorkloadError
from training.workload.host import (
    CACHE_DIR_ENV,
    PreparedWorkload,
    builtin_workload,
    prepare,
    unpack_on_host,
)
from training.workload.samples import check_evaluation_classes, classes_of
from training.workload.tf_contract import file_pattern, list_channel_files, module_constant

if TYPE_CHECKING:
    from training.data_service.control import FailureReports

log = logging.getLogger("training.launcher")

# Exit code for a job that is wrong before anything ran (bad config, bad input), as argparse uses.
CONFIG_ERROR_EXIT = 2


def trainer_for(variant: str) -> Variant:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise HyperparameterError(f"variant {variant!r} has no trainer in this image; known: {sorted(VARIANTS)}") from None


def trainer_command(
    module: str,
    *,
    distribution: str,
    nnodes: int,
    processes_per_host: int,
    node_rank: int,
    master_address: str,
    master_port: int,
    python: str = sys.executable,
) -> list[str]:
    """The command that runs the trainer on one DNN host (for Horovod: each of its ranks)."""
    if distribution == "none" and nnodes * processes_per_host > 1:
        raise HyperparameterError(
            f"distribution 'none' runs one process, but the DNN group has {nnodes} hosts × "
            f"{processes_per_host} processes: use torchrun (PyTorch) or horovod (TensorFlow)"
        )
    if distribution == "mirrored" and nnodes > 1:
        raise HyperparameterError(
            f"distribution 'mirrored' runs on one host (one process, every local device), but the DNN group has "
            f"{nnodes} hosts: use distribution 'horovod'"
        )
    if distribution in ("none", "mirrored", "horovod"):
        return [python, "-m", module]
    return [
        python, "-m", "training.torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={processes_per_host}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_address}",
        f"--master-port={master_port}",
        "-m", module,
    ]


# What the SageMaker training toolkit's own torchrun runner sets on Trainium when a job spans several
# nodes: libfabric over EFA, with device RDMA, safe across the fork of torchrun's workers. Only on the
# instance types that have EFA (as the toolkit's own list does): ml.trn1.2xlarge has none, and libfabric
# told to use EFA there would find no provider.
EFA_ENVIRONMENT = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
EFA_INSTANCE_TYPES = frozenset({"ml.trn1.32xlarge", "ml.trn1n.32xlarge", "ml.trn2.48xlarge", "ml.trn2u.48xlarge"})
# The Neuron SDK's tool that runs a trainer with graph extraction only, then compiles every graph it saw,
# in parallel, into the compile cache (the real run then finds them there).
NEURON_PARALLEL_COMPILE = "neuron_parallel_compile"


def trainer_environment(settings: PlatformSettings, environ: dict[str, str], *, instance_type: str = "", nnodes: int = 1) -> dict[str, str]:
    """The trainer's environment: ours, plus the Neuron compile cache when the job has one, so that a
    graph compiled by an earlier job is not compiled again, plus EFA's settings on a multi-node job of an
    EFA Trainium type (a value already in the environment wins: the image or the user may know better).
    Pure."""
    environment = dict(environ)
    if settings.neuron_compile_cache_uri:
        environment["NEURON_COMPILE_CACHE_URL"] = settings.neuron_compile_cache_uri
    if instance_type in EFA_INSTANCE_TYPES and nnodes > 1:
        environment = EFA_ENVIRONMENT | environment
    return environment


def precompile_command(command: list[str]) -> list[str]:
    """The trainer's command under Neuron's parallel pre-compilation. Pure."""
    return [NEURON_PARALLEL_COMPILE, *command]


def gpu_count() -> int:
    """GPUs on this host, without importing a framework into the launcher."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False)
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def exit_status(returncode: int) -> int:
    """A child killed by signal N reports -N; a shell reports 128 + N. Never 0 for a killed child."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class TrainersOutcome:
    status: int  # this host's exit status
    returncode: int  # the return code of the process that decided it
    abort_reason: str | None = None  # why the launcher stopped the trainers itself


def failure_to_write(outcome: TrainersOutcome, *, stopped: bool, written: str, rank_failure: str | None, host: str) -> str | None:
    """The failure reason this host leaves, or None to keep what the trainers wrote. Pure.

    Stopping the trainers (SIGTERM) makes them save and write "TrainingStopped"; when the launcher stopped
    them for a reason of its own, that reason is the cause, not their stop. A rank killed by a signal
    writes nothing, and what its peers wrote on the way down is not the cause either."""
    if outcome.status == 0:
        return None
    if outcome.abort_reason:
        return outcome.abort_reason
    if stopped:
        return None if written else "stopped by SIGTERM (StopTrainingJob or a spot interruption) before the trainers reached a step boundary"
    if rank_failure and "killed by" in rank_failure:
        return f"{rank_failure} on {host}"
    if outcome.returncode < 0:  # one process of several (Horovod) killed by a signal: the cause, whatever its peers wrote
        return f"{trainer_failure(outcome.returncode, None)} on {host}"
    return None if written else f"{trainer_failure(outcome.returncode, rank_failure)} on {host}"


def trainer_failure(returncode: int, rank_failure: str | None) -> str:
    """The reason a host's trainer failed: which rank died of which signal when torchrun says so. Pure."""
    if rank_failure:
        return rank_failure
    if returncode < 0:
        return f"the trainer was killed by {signal.Signals(-returncode).name}"
    return f"the trainer exited with status {exit_status(returncode)}"


def shutdown_data_hosts(targets: list[str], token: str, requester: str) -> None:
    """Ask every data host to stop, in parallel; a host that is already gone is fine."""
    from training.data_service.control import request_shutdown

    def one(target: str) -> None:
        for attempt in range(3):
            try:
                reply = request_shutdown(target, token, requester)
                served = f" after serving {reply.batches_served} batches" if reply.batches_served else ""
                log.info("data host %s (%s) shut down%s", reply.host, target, served)
                return
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("data host %s refused the job's token", target)
                    return
                if attempt == 2:
                    log.info("data host %s did not answer the shutdown (%s): gone, or not serving yet (it ends at its start deadline)",
                             target, error.code().name)

    with futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        list(pool.map(one, targets))


def run_data_host(host: HostEnvironment, settings: PlatformSettings, variant: Variant, config: Any, stop: threading.Event,
                  keras_workload: KerasWorkloadCode | None = None) -> int:
    """Serve a tf.data.service variant's channel (the tensorflow one's) until stopped: the batches go from
    tf.data.service's workers to the trainers, and our server answers the control calls (Describe,
    keep-alive, Shutdown). ``keras_workload``: a user's, whose dataset the dispatcher host builds and
    registers (the other hosts' workers run its graph: they need no code). Every other variant's data
    hosts serve a workload (run_workload_data_host)."""
    if variant.data_service != "tf.data.service":  # the launcher gives every other variant a workload
        raise HyperparameterError(f"variant {variant.name!r} has no workload for its data hosts to serve")
    from training.data_service.server import ServerSettings, default_workers, serve
    from training.data_service.tf_service import TfDataService, TfServiceSettings

    cluster = host.cluster
    root = host.channel(settings.data_channel)
    sharded = host.channel_is_sharded(settings.data_channel)
    try:
        if keras_workload is not None:
            folder = list_channel_files(root, settings.data_channel, file_pattern(keras_workload.code_dir, keras_workload.module))
        else:
            folder = CHANNEL_CHECKS[variant.input_format](root, settings.data_channel, cluster.current_group)
    except EmptyChannelError as error:  # not a compressed shard or a layout refused: those say so themselves
        if not sharded:
            raise
        raise EmptyChannelError(f"this host's share of the sharded channel {settings.data_channel!r} holds no images ({error}): "
                                "S3 gives each host about 1/n of the objects, and this one got none of the images") from None
    data_hosts = settings.data_hosts(cluster)
    host_index = data_hosts.index(cluster.current_host)
    server_settings = ServerSettings(
        host=cluster.current_host,
        # On SageMaker listen on every interface; the emulated cluster gives each host its own address.
        bind_address=host.bind_address(),
        port=settings.data_service_port,
        channel=settings.data_channel,
        batch_size=config.batch_size,
        shutdown_token=settings.shutdown_token,
        idle_timeout_s=settings.data_idle_timeout_s,
        start_deadline_s=settings.data_start_deadline_s,
        workers=default_workers(),
        # The run's: a resumed job's hosts draw the order the first job's drew (positions.py).
        seed=config.seed,
        # The data hosts split a replicated channel's epochs between them; a sharded one, each serves its own.
        hosts=len(data_hosts),
        sharded=sharded,
        # What the built-in's trainer checks its elements against (a user's come with their spec from the dispatcher).
        sample_shape=config.augment_config.sample_shape if keras_workload is None else (),
    )
    dispatcher, workers = settings.tf_data_service_addresses(cluster, host.addresses)
    source = TfDataService(
        TfServiceSettings(
            dispatcher_address=dispatcher,
            worker_address=workers[host_index],
            channel_dir=root,
            dispatcher=host_index == 0,
            batch_size=config.batch_size,
            image_size=getattr(config, "image_size", 0),
            augment=getattr(config, "augment", ""),
            seed=config.seed + host_index,
            **(keras_workload.service_arguments() if keras_workload is not None else {}),
        )
    )
    return serve(server_settings, folder, stop, source=source).exit_code


@dataclass(frozen=True)
class KerasWorkloadCode:
    """A user's TensorFlow workload as the launcher has it: unpacked, installed, never imported here (the
    launcher does not load TensorFlow; the dispatcher host's tf.data.service child and the trainers do)."""

    code_dir: Path
    packages_dir: Path | None
    module: str

    def service_arguments(self) -> dict[str, str]:
        return {"workload_dir": str(self.code_dir), "workload_packages": str(self.packages_dir or ""), "workload_module": self.module}


def run_workload_data_host(host: HostEnvironment, prepared: PreparedWorkload, stop: threading.Event, packages_dir: Path | None) -> int:
    """Serve a user workload's training channel: listed and preprocessed by its own hooks (the first
    sample before serving: what Describe announces), in worker processes that import it by name."""
    from training.data_service.server import ServerSettings, default_workers, serve
    from training.workload.serving import WorkloadBatchProducer, host_listing, recipe_for, wire_features

    settings, config, cluster = prepared.settings, prepared.config, host.cluster
    root = prepared.channel(settings.data_channel)
    sharded = host.channel_is_sharded(settings.data_channel)
    listing = host_listing(prepared.workload, settings.data_channel, root, prepared.hyperparameters, prepared.channels)
    recipe = recipe_for(prepared.workload, listing, packages_dir=packages_dir, hyperparameters=prepared.hyperparameters, seed=config.seed)
    data_hosts = settings.data_hosts(cluster)
    host_index = data_hosts.index(cluster.current_host)
    workers = default_workers()
    server_settings = ServerSettings(
        host=cluster.current_host, bind_address=host.bind_address(), port=settings.data_service_port,
        channel=settings.data_channel, batch_size=config.batch_size,
        shutdown_token=settings.shutdown_token, idle_timeout_s=settings.data_idle_timeout_s, start_deadline_s=settings.data_start_deadline_s,
        workers=workers, seed=config.seed, hosts=len(data_hosts), sharded=sharded,  # the run's seed: see positions.py
        features=wire_features(recipe.features),
    )
    producer = WorkloadBatchProducer(listing, recipe, batch_size=config.batch_size, workers=workers, seed=server_settings.seed,
                                     host_index=host_index, queue_depth=server_settings.queue_depth, hosts=len(data_hosts), sharded=sharded)
    return serve(server_settings, listing, stop, source=producer).exit_code


def fail_data_host(host: HostEnvironment, settings: PlatformSettings, message: str, exit_code: int, stop: threading.Event) -> int:
    """A data host that cannot serve: write why (the job's FailureReason), tell every DNN host, so that
    it fails now with this reason instead of waiting out its connect timeout, then exit."""
    from training.data_service.control import report_failure

    log.error("%s", message)
    write_failure(message)
    targets = settings.job_control_targets(host.cluster, host.addresses)
    heard = report_failure(
        targets, settings.shutdown_token, host.cluster.current_host, message, timeout_s=settings.data_connect_timeout_s, stop=stop
    )
    log.info("told %d of %d DNN hosts why this data host stops", len(heard), len(targets))
    return exit_code


# How each input format's training channel is checked before a trainer starts.
CHANNEL_CHECKS = {"images": scan_images, "image_files": scan_image_files, "text": scan_text_channel}


def seed_checkpoints(host: HostEnvironment) -> int:
    """A resuming run's first start: the earlier run's checkpoints (its resume channel) become this run's,
    which SageMaker syncs to this run's own prefix. A restart that has checkpoints of its own keeps them.
    Returns the files copied."""
    source, target = host.channel(RESUME_CHANNEL), host.checkpoints_dir
    if not source.is_dir() or (target.is_dir() and any(target.iterdir())):
        return 0
    # Copied beside, then moved in file by file (each rename atomic; the folder SageMaker watches stays):
    # a host that dies mid-copy leaves no half-written checkpoint file that a restart would take for its own.
    staging = target.parent / f".{target.name}-seeding"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    target.mkdir(parents=True, exist_ok=True)
    files = sorted(path for path in staging.rglob("*") if path.is_file())
    for path in files:
        destination = target / path.relative_to(staging)
        destination.parent.mkdir(parents=True, exist_ok=True)
        path.replace(destination)
    shutil.rmtree(staging, ignore_errors=True)
    copied = len(files)
    log.info("resuming: %d checkpoint files from the %r channel", copied, RESUME_CHANNEL)
    return copied


def run_dnn_host(host: HostEnvironment, settings: PlatformSettings, variant: Variant, stop: threading.Event, precompile_steps: int = 0,
                 workload: PreparedWorkload | None = None, trainer_env: Mapping[str, str] | None = None,
                 keras_workload: KerasWorkloadCode | None = None) -> int:
    """Train across the DNN group; ``workload``: a user's (checked on this host), whose trainer is the one
    PyTorch runtime, started with ``trainer_env`` (where its code is)."""
    seed_checkpoints(host)
    cluster, addresses = host.cluster, host.addresses
    dnn_hosts = cluster.group(settings.groups_with_role(DNN)[0]).hosts
    data_targets = settings.data_service_targets(cluster, addresses)
    try:
        if workload is not None and not data_targets:
            # The hooks run on this host's own samples before any trainer starts: the training channel,
            # then the validation channel, listed with the training channel's classes as the trainer lists
            # it. (With data hosts, the classes are theirs: the trainer lists the validation channel once
            # they have described them, before its first step.)
            samples = workload.list(settings.data_channel, training=True)
            workload.features(samples, training=True)
            if workload.config.eval_channel:
                evaluation = workload.list(workload.config.eval_channel, training=False, classes=classes_of(samples))
                check_evaluation_classes(workload.config.eval_channel, evaluation, classes_of(samples))
                workload.features(evaluation, training=False)
        elif not data_targets and keras_workload is not None:
            list_channel_files(host.channel(settings.data_channel), settings.data_channel,
                               file_pattern(keras_workload.code_dir, keras_workload.module))
        elif not data_targets:
            # Homogeneous: the channel must be here; fail now rather than after the trainer started.
            CHANNEL_CHECKS[variant.input_format](host.channel(settings.data_channel), settings.data_channel, cluster.current_group)
    except Exception:
        # No trainer will ask the data hosts for anything: end them now rather than at their start deadline.
        if data_targets:
            shutdown_data_hosts(data_targets, settings.shutdown_token, requester=cluster.current_host)
        raise
    node_rank = dnn_hosts.index(cluster.current_host)
    processes_per_host = settings.processes_per_host or max(1, gpu_count())
    master_address = address_of(dnn_hosts[0], addresses)
    command = trainer_command(
        WORKLOAD_TRAINER if workload is not None else variant.module,
        distribution=settings.distribution,
        nnodes=len(dnn_hosts),
        processes_per_host=processes_per_host,
        node_rank=node_rank,
        master_address=master_address,
        master_port=settings.master_port,
    )
    with contextlib.ExitStack() as stack:
        workspace = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="launcher-")))
        progress_dir, rank_failure_file = workspace / "progress", workspace / "rank-failure.json"
        progress_dir.mkdir()
        environment = trainer_environment(settings, dict(os.environ), instance_type=cluster.current_instance_type, nnodes=len(dnn_hosts)) | {
            PROGRESS_DIR_ENV: str(progress_dir),
            RANK_FAILURE_ENV: str(rank_failure_file),
        } | dict(trainer_env or {})
        if precompile_steps:
            status = None
            try:
                status = _precompile(command, environment, stop, cluster.current_host)
            finally:
                if status != 0 and data_targets:  # no trainer follows: end the data hosts now
                    shutdown_data_hosts(data_targets, settings.shutdown_token, requester=cluster.current_host)
            if status != 0:
                return status
        data_watch, reports = None, None
        if data_targets:
            data_watch, reports = _start_data_host_watch(stack, cluster, settings, variant, addresses, data_targets)
        watch = TrainerWatch(
            progress_dir, host=cluster.current_host, stall_timeout_s=settings.trainer_stall_timeout_s,
            first_step_timeout_s=settings.trainer_first_step_timeout_s, exit_timeout_s=settings.trainer_exit_timeout_s,
            # torchrun and Horovod run processes_per_host ranks here, each writing its own mark; else one process.
            local_ranks=processes_per_host if settings.distribution in ("torchrun", "horovod") else 1, data_watch=data_watch,
        )
        if settings.distribution == "horovod":
            processes = _start_horovod_ranks(
                stack, cluster, settings, command, environment, dnn_hosts, processes_per_host, addresses, master_address
            )
        else:
            log.info("host %s (dnn, node rank %d) starting the trainer: %s", cluster.current_host, node_rank, " ".join(command[1:]))
            processes = [subprocess.Popen(command, env=environment)]
        peer_grace_s = TORCHRUN_PEER_GRACE_S if settings.distribution == "torchrun" else PEER_GRACE_S
        outcome = wait_for_trainers(
            processes, stop, abort=watch.abort, finished=watch.finished, saved=watch.saved, peer_grace_s=peer_grace_s
        )
        status = outcome.status
        reason = failure_to_write(
            outcome, stopped=stop.is_set(), written=_failure_text(), rank_failure=read_rank_failure(rank_failure_file), host=cluster.current_host
        )
        if reason is not None:
            # Before the workspace goes: a trainer orphaned by a killed torchrun fails on its removed progress
            # folder, and its reason (a consequence) must find this one there, not the other way round.
            write_failure(reason)
    # Node rank 0 ends the data hosts after training (every rank has passed the final barrier by then);
    # any node whose trainer failed ends them too, since the job is failing anyway.
    if data_targets and (node_rank == 0 or status != 0):
        # Data hosts that reported a failure are on their way out already (and may not answer).
        failed = reports.snapshot() if reports is not None else {}
        serving = [target for host, target in zip(settings.data_hosts(cluster), data_targets, strict=True) if host not in failed]
        shutdown_data_hosts(serving, settings.shutdown_token, requester=cluster.current_host)
    return status


def _precompile(command: list[str], environment: dict[str, str], stop: threading.Event, host: str) -> int:
    """Run the trainer once under neuron_parallel_compile (a few steps, graph extraction only, outputs
    thrown away by the trainer), so that the real run finds every graph compiled in the cache. It writes
    no progress marks: nothing watches it, and its ``done`` marks, left in the real run's folder, would
    say that run had finished before it began."""
    if shutil.which(NEURON_PARALLEL_COMPILE, path=environment.get("PATH")) is None:
        raise HyperparameterError(f"precompile_steps needs {NEURON_PARALLEL_COMPILE} (the Neuron SDK's), which this image does not have")
    log.info("host %s pre-compiling the trainer's graphs: %s", host, " ".join(precompile_command(command)[:2]))
    environment = {key: value for key, value in environment.items() if key != PROGRESS_DIR_ENV}
    outcome = wait_for_trainers([subprocess.Popen(precompile_command(command), env=environment)], stop, abort=None, peer_grace_s=TORCHRUN_PEER_GRACE_S)
    if outcome.status != 0 and not stop.is_set():
        write_failure(f"NeuronPrecompileError: {NEURON_PARALLEL_COMPILE} exited with status {outcome.status}")
    return outcome.status


def _failure_text() -> str:
    try:
        return failure_path().read_text()
    except OSError:
        return ""


def _start_data_host_watch(
    stack: contextlib.ExitStack,
    cluster: Cluster,
    settings: PlatformSettings,
    variant: Variant,
    addresses: Mapping[str, str],
    data_targets: list[str],
) -> tuple[Callable[[Progress, float], str | None], FailureReports]:
    """Keep-alives to every data host while the trainers run (their idle timeout starts when these stop),
    the server where data hosts report failures, and the rule that turns both into a reason to stop."""
    from training.data_service.control import FailureReports, KeepAlive

    bind = f"{addresses.get(cluster.current_host, '0.0.0.0')}:{settings.job_control_port}"
    reports = stack.enter_context(FailureReports(bind, settings.shutdown_token))
    keepalive = stack.enter_context(
        KeepAlive(data_targets, settings.shutdown_token, interval_s=min(5.0, settings.data_idle_timeout_s / 3))
    )
    data_hosts = settings.data_hosts(cluster)
    # tf.data.service has one dispatcher, on the first data host: without it no batch can come.
    dispatcher = data_targets[0] if variant.data_service == "tf.data.service" else None

    def watch(progress: Progress, now: float) -> str | None:
        verdict = data_failure_verdict(reports.snapshot(), data_hosts, essential=data_hosts[0] if dispatcher else None)
        if verdict or dispatcher is None:
            return verdict
        return dispatcher_lost(
            dispatcher,
            answered=keepalive.answered(dispatcher),
            silent_s=keepalive.silent_for(dispatcher),
            no_progress_s=now - progress.since,
            bound_s=settings.dispatcher_silence_s,
        )

    return watch, reports


def data_failure_verdict(reports: Mapping[str, str], data_hosts: list[str], essential: str | None = None) -> str | None:
    """Why training cannot go on, from the data hosts' failure reports: every data host failed, or the
    one the others depend on (tf.data.service's dispatcher host). Fewer failures: the rest carry on. Pure."""
    if essential is not None and essential in reports:
        return f"data host {essential} (the tf.data.service dispatcher) failed: {reports[essential]}"
    if data_hosts and all(host in reports for host in data_hosts):
        if len(data_hosts) == 1:
            return f"data host {data_hosts[0]} failed: {reports[data_hosts[0]]}"
        return "every data host failed: " + "; ".join(f"{host}: {reports[host]}" for host in data_hosts)
    return None


# A gap longer than this between two looks of a watcher at its clock: the watcher itself did not run (its
# host was frozen and continued, its VM paused), and the silence it would see in that gap is not the
# watched processes'. Far above the watchers' own periods (0.1 s and 0.5 s), far below every bound.
PAUSED_S = 5.0


@dataclass(frozen=True)
class Progress:
    """What a DNN launcher has seen of its trainers' step marks (training/trainers/loop.py writes them).

    Every time is the launcher's monotonic clock, never a mark's mtime: the wall clock may be stepped (NTP,
    an operator), and an hour back would hide a stall for that hour. A mark counts as news when anything
    about it changed (its mtime, its text), timed when the launcher saw the change. A mark that was in the
    folder before the trainers started (``stale``: another run's, a graph extraction's ``done``), and has
    not changed since, is not theirs and counts for nothing."""

    since: float  # when a mark last changed (the trainers' start while none has)
    seen_at: float  # the last look
    marks: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # mark → (mtime_ns, text) at the last look
    step: int = 0  # the newest step a mark reported
    done_at: float | None = None  # when a mark first said that the run finished, saved
    done: int = 0  # how many marks say so now (one per rank of this host, each past the final barrier)
    stale: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # marks there before the trainers started


def parse_mark(text: str) -> tuple[int, bool]:
    """(step, finished) from a mark's text: "12", "done 12", or a phase with no step of its own and a count
    ("evaluate 3 12", "checkpoint 1 12": the step is the last word); a mark read while it was being
    rewritten reads as step 0. Pure."""
    words = text.split()
    finished = bool(words) and words[0] == DONE_MARK
    number = words[-1] if words else ""
    return (int(number) if number.isdigit() else 0), finished


def observe(progress: Progress, marks: Mapping[str, tuple[int, str]], now: float) -> Progress:
    """The progress after a look at the marks at ``now`` (monotonic). Pure."""
    since, done_at = progress.since, progress.done_at
    gap = now - progress.seen_at
    if gap > PAUSED_S:  # the launcher did not run in the gap: no one's silence counts for it
        since += gap
        done_at = None if done_at is None else done_at + gap
    marks = {name: mark for name, mark in marks.items() if progress.stale.get(name) != mark}
    if marks != progress.marks:
        since = now
    parsed = [parse_mark(text) for _, text in marks.values()]
    step = max([progress.step, *(number for number, _ in parsed)])
    done = sum(finished for _, finished in parsed)
    if done_at is None and done:
        done_at = now
    return Progress(since=since, seen_at=now, marks=types.MappingProxyType(marks), step=step, done_at=done_at, done=done,
                    stale=progress.stale)


def trainer_stalled(progress: Progress, now: float, *, host: str, bound_s: float, first_step_bound_s: float) -> str | None:
    """Why the host must fail, if its trainers made no progress for longer than the bound (before their
    first mark: ``first_step_bound_s``). A bound of 0 turns the rule off. Pure.

    Progress is any change of any of this host's marks (training/trainers/loop.py): every training step,
    every batch of an evaluation (periodic or final, ``TrainingLoop.mark_progress``), and the start and end
    of each checkpoint write, of the summary's part that the variant computes, and of the model's save. What
    writes no mark: one batch, one evaluation batch or one save that alone takes longer than the bound, and
    a rank that waits in a collective for a peer on another host (the chief's checkpoint write holds the
    other hosts' ranks in the barrier after it): the bound must exceed the longest of those."""
    if progress.done_at is not None:
        return None  # finished: whether they exit is trainers_lingering's
    silent = now - progress.since
    first = not progress.marks
    bound = first_step_bound_s if first else bound_s
    if bound <= 0 or silent <= bound:
        return None
    if first:
        return f"TrainerStalled: no training step on {host} {silent:.0f} s after the trainers started (bound {bound:.0f} s)"
    return (
        f"TrainerStalled: no training step on {host} for {silent:.0f} s (last step {progress.step}; bound {bound:.0f} s): "
        "a frozen or deadlocked rank holds every rank in its next collective"
    )


def trainers_lingering(progress: Progress, now: float, bound_s: float) -> bool:
    """Whether the trainers finished (every rank passed the final barrier: the work is saved) longer than
    ``bound_s`` ago and yet run on. Pure."""
    return progress.done_at is not None and bound_s > 0 and now - progress.done_at > bound_s


def every_rank_done(progress: Progress, local_ranks: int) -> bool:
    """Whether every one of this host's ``local_ranks`` ranks wrote its done mark (past the final barrier:
    the model and the summary are saved). Pure."""
    return progress.done >= max(1, local_ranks)


def read_marks(progress_dir: Path) -> dict[str, tuple[int, str]]:
    """Every mark in the folder: (mtime_ns, text)."""
    marks = {}
    for entry in progress_dir.iterdir() if progress_dir.exists() else []:
        try:
            marks[entry.name] = (entry.stat().st_mtime_ns, entry.read_text())
        except OSError:
            continue  # being replaced while we looked
    return marks


class TrainerWatch:
    """The edge of the progress rules: looks at the marks, on the monotonic clock, and applies the rules to
    what it saw (wait_for_trainers calls ``abort``, ``finished`` and ``saved``). Create it just before the
    trainers start: the marks already in the folder then are not theirs."""

    def __init__(
        self,
        progress_dir: Path,
        *,
        host: str,
        stall_timeout_s: float,
        first_step_timeout_s: float,
        exit_timeout_s: float,
        local_ranks: int = 1,
        data_watch: Callable[[Progress, float], str | None] | None = None,
    ) -> None:
        self.progress_dir, self.host, self.local_ranks, self.data_watch = progress_dir, host, local_ranks, data_watch
        self.stall_timeout_s, self.first_step_timeout_s, self.exit_timeout_s = stall_timeout_s, first_step_timeout_s, exit_timeout_s
        now = time.monotonic()
        self.progress = Progress(since=now, seen_at=now, stale=types.MappingProxyType(read_marks(progress_dir)))
        if self.progress.stale:
            log.warning("progress marks left before the trainers started (%s): not theirs, ignored", ", ".join(sorted(self.progress.stale)))

    def look(self) -> Progress:
        self.progress = observe(self.progress, read_marks(self.progress_dir), time.monotonic())
        return self.progress

    def abort(self) -> str | None:
        """Why the trainers must be killed now: the data hosts' verdict, or a stall."""
        progress, now = self.look(), time.monotonic()
        return (self.data_watch(progress, now) if self.data_watch else None) or trainer_stalled(
            progress, now, host=self.host, bound_s=self.stall_timeout_s, first_step_bound_s=self.first_step_timeout_s
        )

    def finished(self) -> bool:
        """Whether the run finished and its processes linger (``abort`` looked at the marks a moment ago)."""
        return trainers_lingering(self.progress, time.monotonic(), self.exit_timeout_s)

    def saved(self) -> bool:
        """Whether every local rank is past the final barrier (a fresh look: asked when a trainer ended)."""
        return every_rank_done(self.look(), self.local_ranks)


def _start_horovod_ranks(
    stack: contextlib.ExitStack,
    cluster: Cluster,
    settings: PlatformSettings,
    command: list[str],
    environment: dict[str, str],
    dnn_hosts: list[str],
    processes_per_host: int,
    addresses: dict[str, str],
    master_address: str,
) -> list[subprocess.Popen]:
    """This host's Horovod ranks; the first DNN host also runs the gloo rendezvous for all of them."""
    from training.horovod_launch import RendezvousServer, interface_of, rank_environment, slot_plan

    plan = slot_plan(dnn_hosts, processes_per_host)
    own_address = address_of(cluster.current_host, addresses)
    if cluster.current_host == dnn_hosts[0]:
        stack.enter_context(RendezvousServer(addresses.get(cluster.current_host, "0.0.0.0"), settings.master_port, plan))
    interface = interface_of(socket.gethostbyname(own_address))
    slots = [slot for slot in plan if slot.hostname == cluster.current_host]
    log.info(
        "host %s (dnn) starting Horovod ranks %s of %d (gloo on %s, rendezvous %s:%d): %s",
        cluster.current_host, [slot.rank for slot in slots], len(plan), interface, master_address, settings.master_port,
        " ".join(command[1:]),
    )
    return [
        subprocess.Popen(command, env=environment | rank_environment(slot, master_address, settings.master_port, interface))
        for slot in slots
    ]


# SIGTERM to the launcher: how long its trainers get to reach a step boundary and save before SIGKILL
# (SageMaker sends SIGKILL 120 s after its SIGTERM). A failed peer or a watchdog: PEER_GRACE_S; for
# torchrun, longer than the 30 s it gives its own ranks, so that it is never killed with ranks running.
STOP_GRACE_S = 100.0
PEER_GRACE_S = 10.0
TORCHRUN_PEER_GRACE_S = 40.0


def dispatcher_lost(
    dispatcher_target: str, *, answered: bool, silent_s: float, no_progress_s: float, bound_s: float
) -> str | None:
    """Why the job must stop, if the dispatcher's host answered once, then went silent for longer than
    ``bound_s``, and the trainers have made no progress for as long. Pure.

    tf.data.service has one dispatcher: once its host is gone the trainers' client waits (for an hour)
    for batches that may never come. The control plane alone is not evidence (tf.data.service workers go
    on serving the tasks they have), batches that stopped are. Before the first answer the trainers' own
    bound, data_connect_timeout_s, governs the start."""
    if not answered or silent_s <= bound_s or no_progress_s <= bound_s:
        return None
    return (
        f"the tf.data.service dispatcher host ({dispatcher_target}) has not answered for {silent_s:.0f} s and no batch "
        f"has reached a trainer for {no_progress_s:.0f} s"
    )


def read_rank_failure(path: Path) -> str | None:
    """Which rank failed first and how, from training/torchrun.py's record (None when it wrote none)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return describe_rank_failure(record)


def describe_rank_failure(record: Mapping[str, Any]) -> str:
    """One line from a rank failure record (rank, local_rank, exitcode, signal). Pure."""
    where = f"rank {record['rank']} (local rank {record['local_rank']})"
    if record.get("signal"):
        hint = " (the kernel's OOM killer sends it when the host runs out of memory)" if record["signal"] == "SIGKILL" else ""
        return f"{where} was killed by {record['signal']}{hint}"
    return f"{where} exited with status {record['exitcode']}"


def wait_for_trainers(
    processes: list[subprocess.Popen],
    stop: threading.Event,
    abort: Callable[[], str | None] | None = None,
    stop_grace_s: float = STOP_GRACE_S,
    peer_grace_s: float = PEER_GRACE_S,
    finished: Callable[[], bool] | None = None,
    saved: Callable[[], bool] | None = None,
) -> TrainersOutcome:
    """Wait for every trainer process of this host. The first to fail fails the host: the others are
    stopped (a Horovod rank whose peer died would otherwise wait for ever); SIGTERM to the launcher is
    passed on to all of them, with ``stop_grace_s`` to save; ``abort`` returning a reason kills them all
    at once and fails the host with it; ``finished`` returning True (the run is done and saved, but its
    processes have not exited) kills them all and leaves the host's status 0. A process that fails when
    ``saved`` says every local rank is past the final barrier (a crash in NCCL's or XLA's teardown, after
    the model and the summary were written) leaves the status 0 too, with a warning that names the crash:
    failing the host would fail the job, and SageMaker uploads no model of a failed job."""
    status, returncode, abort_reason = 0, 0, None
    stopping_since: float | None = None
    lingered = False
    grace_s = peer_grace_s
    failed: list[subprocess.Popen] = []  # in the order their failures were seen
    while alive := [process for process in processes if process.poll() is None]:  # polls every one
        failed += [process for process in processes if process.returncode not in (None, 0) and process not in failed]
        if failed and stopping_since is None and not lingered and saved is not None and saved():
            _log_crash_after_saving(failed[0].returncode)
            lingered, stopping_since = True, time.monotonic()
            kill_trees([process.pid for process in alive])
        if abort is not None and stopping_since is None and not failed and (abort_reason := abort()):
            log.error("%s", abort_reason)
            write_failure(abort_reason)
            status, returncode = 1, 1
            # An abort needs no saving (the job fails anyway), and waiting out torchrun's close of ranks that
            # are blocked on a dead data host or frozen (a stopped process ignores SIGINT and SIGTERM until
            # continued) would keep every host billed for nothing: every process of the trainers, now.
            stopping_since = time.monotonic()
            kill_trees([process.pid for process in alive])
        elif finished is not None and stopping_since is None and not failed and finished():
            log.warning(
                "TrainerExitTimeout: every rank finished and the work is saved, but the trainer processes have not "
                "exited: killed (the host exits 0)"
            )
            lingered, stopping_since = True, time.monotonic()
            kill_trees([process.pid for process in alive])
        if (failed or stop.is_set()) and stopping_since is None:
            # A stop (SIGTERM) asks the trainers to save; a failure (SIGINT) only to end: torchrun then
            # closes its ranks within its own 30 s, and nothing writes "stopped" over the cause.
            sig = signal.SIGINT
            if failed:
                returncode = failed[0].returncode
                status = exit_status(returncode)
                _log_trainer_end(returncode)
            else:
                sig, grace_s = signal.SIGTERM, stop_grace_s
                log.warning("SIGTERM: the trainers get %.0f s to save a checkpoint", grace_s)
            stopping_since = time.monotonic()
            for process in alive:
                process.send_signal(sig)
        if stopping_since is not None and time.monotonic() - stopping_since > grace_s:
            kill_trees([process.pid for process in alive])  # torchrun's ranks too: they run in sessions of their own
        time.sleep(0.1)
    failed += [process for process in processes if process.returncode != 0 and process not in failed]
    if not status and not lingered and failed:
        returncode = failed[0].returncode
        if saved is not None and saved():
            _log_crash_after_saving(returncode)
            return TrainersOutcome(0, returncode)
        status = exit_status(returncode)
        _log_trainer_end(returncode)
    return TrainersOutcome(status, returncode, abort_reason)


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant, parents first, from /proc (session boundaries do not stop it:
    torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of /proc/<pid>/stat is the parent pid; the command name before it may hold spaces.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
        children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop(0)
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree


def kill_trees(roots: list[int]) -> int:
    """SIGKILL every process of the trees under ``roots``; returns how many. They are stopped first, then
    listed again: a process that forks while we kill its parent would leave a child that no list saw
    (SIGKILL ends a stopped process as well)."""
    for pid in dict.fromkeys(pid for root in roots for pid in process_tree(root)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    pids = list(dict.fromkeys(pid for root in roots for pid in process_tree(root)))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _log_crash_after_saving(returncode: int) -> None:
    log.warning(
        "TrainerCrashedAfterSaving: %s after every rank of this host had passed the final barrier (the model "
        "and the summary are saved; a teardown crash, NCCL's or XLA's): the host exits 0", trainer_failure(returncode, None)
    )


def _log_trainer_end(returncode: int) -> None:
    if returncode == 128 + signal.SIGTERM:  # TrainingStopped's, and torchrun's after its ranks stopped
        log.warning("the trainer stopped (SIGTERM) after saving: exit code %d", returncode)
    elif returncode < 0:
        log.error("the trainer was killed by %s", signal.Signals(-returncode).name)
    else:
        log.error("the trainer failed with exit code %d", returncode)


# The write end of the heartbeat pipe, in the launcher the container's first process supervises.
HEARTBEAT_FD_ENV = "TRAINING_HEARTBEAT_FD"
# "1": supervise the launcher as the container's first process does, though this one is not PID 1 (the
# emulated cluster runs every host so, so that its tests go through the same supervisor).
SUPERVISE_ENV = "TRAINING_SUPERVISE"
# The host's exit status when its first process killed a frozen launcher of a DNN host (or of a host
# whose role it was not told). A data host's is 0 (frozen_exit_status).
LAUNCHER_FROZEN_EXIT = 1
# What /proc/<pid>/stat's state letter means, for the reason a frozen launcher leaves.
PROCESS_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep (I/O)", "R": "running",
                  "S": "sleeping", "Z": "a zombie"}


@dataclass(frozen=True)
class Heartbeat:
    """What the container's first process knows of its launcher's beats, on its monotonic clock. Until the
    first beat (which says the bound and the host) nothing is enforced: a launcher still parsing its
    settings, or one that runs without beats (bound 0), is never blamed."""

    checked_at: float  # the supervisor's last look at its clock
    heard_at: float | None = None
    bound_s: float = 0.0
    host: str = ""
    role: str = ""  # the host's role (DATA, DNN), as the launcher found it; "" when it did not say
    pending: bytes = b""  # a beat's line not whole yet


def heard(beat: Heartbeat, data: bytes, now: float) -> Heartbeat:
    """The heartbeat after reading ``data`` from the pipe (JSON lines: the bound, the host, its role). Pure."""
    *lines, pending = (beat.pending + data).split(b"\n")
    for line in reversed(lines):
        try:
            said = json.loads(line)
            return dataclasses.replace(beat, heard_at=now, bound_s=float(said["bound_s"]), host=str(said["host"]),
                                       role=str(said.get("role", "")), pending=pending)
        except (ValueError, KeyError, TypeError):
            continue  # not a beat: nothing else writes there, but a torn line must not end the supervisor
    return dataclasses.replace(beat, pending=pending)


def heartbeat_lost(beat: Heartbeat, now: float) -> tuple[Heartbeat, str | None]:
    """The heartbeat after a look at the clock at ``now``, and the reason to kill the launcher if it has
    not beaten for longer than its bound. A gap in the supervisor's own looks (it was frozen too: the whole
    instance, or a VM paused) moves the last beat forward by the gap. Pure."""
    gap = now - beat.checked_at
    heard_at = beat.heard_at
    if heard_at is not None and gap > PAUSED_S:
        heard_at += gap
    beat = dataclasses.replace(beat, checked_at=now, heard_at=heard_at)
    if heard_at is None or beat.bound_s <= 0 or now - heard_at <= beat.bound_s:
        return beat, None
    return beat, f"LauncherFrozen: the launcher on {beat.host} sent no heartbeat for {now - heard_at:.0f} s (bound {beat.bound_s:.0f} s)"


def frozen_exit_status(role: str) -> int:
    """The host's exit status once its first process killed its frozen launcher, by the host's role. Pure.

    SageMaker fails the whole job when any container exits non-zero. A data host is one of the trainers'
    sources: they drop a lost one and train on with the others (and when every data host is lost the DNN
    hosts fail by themselves, naming it), so its loss is not the job's failure, and it exits 0. A DNN
    host's trainers are gone with it: the job has failed (non-zero), as it has when the role is unknown."""
    return 0 if role == DATA else LAUNCHER_FROZEN_EXIT


def frozen_note_path(host: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a data host whose frozen launcher was killed leaves the reason: beside the job's outputs
    (every host's /opt/ml/output/data goes into the job's output.tar.gz), not in the failure file, which is
    the job's FailureReason when it fails, and a lost data host is not why."""
    return base_dir(environ) / "output" / "data" / f"LauncherFrozen-{host or 'unknown'}.txt"


def start_heartbeat(bound_s: float, host: str, role: str = "", environ: Mapping[str, str] = os.environ) -> bool:
    """Beat to the supervising first process (when there is one, and a bound) from a thread of its own,
    every tenth of the bound: a launcher whose every thread stopped (SIGSTOP, a hang that holds the GIL)
    stops beating. Each beat says the bound, the host and its role (what the supervisor's exit status
    depends on: frozen_exit_status). Returns whether it beats."""
    fd = environ.get(HEARTBEAT_FD_ENV)
    if not fd or bound_s <= 0:
        return False
    line = json.dumps({"bound_s": bound_s, "host": host, "role": role}).encode() + b"\n"
    interval = min(10.0, bound_s / 10)

    def beat() -> None:
        while True:
            try:
                os.write(int(fd), line)
            except BlockingIOError:
                pass  # the pipe is full (the supervisor is not reading): a beat is not worth blocking for
            except OSError:
                return  # the supervisor is gone: no one listens
            time.sleep(interval)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return True


def process_state(pid: int) -> str:
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return PROCESS_STATES.get(letter, letter)


def supervise(command: list[str]) -> int:
    """What the container's first process does when the launcher is it (the image's entrypoint): run the
    launcher as a child, pass SIGTERM and SIGINT on to it, reap every process that ends up orphaned (the
    kernel gives them to PID 1, and no other process would collect them), and exit with the launcher's
    status once it ends.

    It also watches the launcher's heartbeat: a launcher that stopped beating for its bound is frozen, and
    a frozen launcher never exits (on a data host, its DNN hosts' shutdown cannot reach it), so the job
    would stay InProgress and bill every instance until its deadline. Then this kills it and everything
    it started, and exits, which ends the container: on a DNN host with LAUNCHER_FROZEN_EXIT and
    LauncherFrozen as the host's failure; on a data host with 0 (frozen_exit_status), the reason logged as
    an error and left in frozen_note_path. What it cannot see: a frozen first process (the whole instance
    frozen), and a launcher whose main thread is deadlocked while its other threads run."""
    pr_set_child_subreaper = 36  # so that this holds when it is not PID 1 too (the tests)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_child_subreaper, 1)
    pending: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)  # arrived while the launcher was starting: sent once it exists
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    beats, beat_end = os.pipe()
    os.set_blocking(beat_end, False)  # a beat never blocks the launcher (see start_heartbeat)
    environment = {key: value for key, value in os.environ.items() if key != SUPERVISE_ENV} | {HEARTBEAT_FD_ENV: str(beat_end)}
    child = subprocess.Popen(command, env=environment, pass_fds=(beat_end,))
    os.close(beat_end)
    for signum in pending:
        forward(signum, None)
    heartbeat, listening = Heartbeat(checked_at=time.monotonic()), [beats]
    while True:
        readable, _, _ = select.select(listening, [], [], 0.5)
        now = time.monotonic()
        if readable:
            data = os.read(beats, 4096)
            if data:
                heartbeat = heard(heartbeat, data, now)
            else:
                listening = []  # every write end closed: the launcher is ending
        if (status := _reap(child.pid)) is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            return status
        heartbeat, frozen = heartbeat_lost(heartbeat, now)
        if frozen:
            state = process_state(child.pid)
            killed = kill_trees([pid for pid in process_tree(os.getpid()) if pid != os.getpid()])
            reason = f"{frozen}: it was {state}; killed it and the {killed - 1} processes under it"
            status = frozen_exit_status(heartbeat.role)
            if status == 0:
                log.error(
                    "%s. This data host exits 0: the trainers drop it and train on with the other data hosts (the "
                    "DNN hosts fail by themselves, naming it, if every data host is lost)", reason
                )
                write_quietly(frozen_note_path(heartbeat.host), reason + "\n")
            else:
                log.error("%s", reason)
                write_failure(reason)
            _reap_all(deadline=time.monotonic() + 10)  # all killed: collected, so that none outlives this
            return status


def _reap(launcher: int) -> int | None:
    """Collect every child that ended (the launcher, or an orphan given to this process); the launcher's
    exit status once it ended."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == launcher:
            return exit_status(os.waitstatus_to_exitcode(wait_status))


def _reap_all(deadline: float) -> None:
    """Collect every child until none is left, or until ``deadline`` (monotonic): a process in
    uninterruptible sleep dies only when its I/O returns."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


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
