"""The dnn role: run the trainer across the DNN group (torchrun; Horovod ranks started per host,
training/horovod_launch.py; or one plain process), keep the data hosts told that it runs, listen for
data hosts' failure reports, then tell every data host to shut down so none keeps running, and billing,
after training. The trainer's exit code is this host's exit code; a trainer killed by a signal exits
128 + signal, and the failure reason names the rank and the signal (training/trainer_watch.py watches
them while they run)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from training.cluster import Cluster, address_of
from training.data_host import CHANNEL_CHECKS, KerasWorkloadCode, data_failure_verdict, dispatcher_lost, shutdown_data_hosts
from training.failure import RANK_FAILURE_ENV, failure_path, write_failure
from training.host_environment import (
    PROGRESS_DIR_ENV,
    HostEnvironment,
)
from training.hyperparameters import (
    DNN,
    RESUME_CHANNEL,
    HyperparameterError,
    PlatformSettings,
)
from training.processes import gpu_count
from training.trainer_watch import (
    PEER_GRACE_S,
    TORCHRUN_PEER_GRACE_S,
    Progress,
    TrainerWatch,
    failure_to_write,
    read_rank_failure,
    wait_for_trainers,
)
from training.variants import WORKLOAD_TRAINER, Variant
from training.workload.host import PreparedWorkload
from training.workload.samples import check_evaluation_classes, classes_of
from training.workload.tf_contract import file_pattern, list_channel_files

if TYPE_CHECKING:
    from training.data_service.control import FailureReports

log = logging.getLogger("training.dnn_host")


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
