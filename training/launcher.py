"""The entrypoint on every host of a training job: find this host's instance group, then serve or train.

SageMaker runs one image on every instance of every instance group; the toolkit starts this file
(``SAGEMAKER_PROGRAM``) on each of them. It reads ``resourceconfig.json`` to learn the host's group, and
the job's role map (a hyperparameter) to learn what the group does:

* data role: serve preprocessed batches (our gRPC stream, training/data_service/server.py, or
  tf.data.service for the tensorflow variant, training/data_service/tf_service.py) until an
  authenticated shutdown, an idle timeout (the DNN hosts are gone), or a start deadline;
* dnn role: run the trainer across the DNN group (torchrun; Horovod ranks started per host,
  training/horovod_launch.py; or one plain process), keep the data hosts told that it runs, then tell
  every data host to shut down so none keeps running, and billing, after training.

Everything is checked before anything starts: a malformed resourceconfig.json, a group missing from the
role map, an unknown hyperparameter or a missing channel ends the host with exit code 2 and one clear
line. The trainer's exit code is this host's exit code; a trainer killed by a signal exits 128 + signal.

    SAGEMAKER_BASE_DIR=/tmp/host1/opt/ml python -m training.launcher
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from training.cluster import Cluster, ClusterConfigError, address_of, host_addresses, load_cluster
from training.data_service.dataset import ChannelError, channel_dir, scan_csv_channel, scan_image_folder
from training.data_service.server import StopReason
from training.data_service.tf_service import TfServiceError
from training.failure import failure_path, write_failure
from training.hyperparameters import DATA, DNN, HyperparameterError, PlatformSettings, load_hyperparameters, parse_settings
from training.variants import VARIANTS, Variant

if TYPE_CHECKING:
    from training.data_service.control import KeepAlive

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
        python, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={processes_per_host}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_address}",
        f"--master-port={master_port}",
        "-m", module,
    ]


def trainer_environment(settings: PlatformSettings, environ: dict[str, str]) -> dict[str, str]:
    """The trainer's environment: ours, plus the Neuron compile cache when the job has one, so that a
    graph compiled by an earlier job is not compiled again."""
    if settings.neuron_compile_cache_uri:
        return environ | {"NEURON_COMPILE_CACHE_URL": settings.neuron_compile_cache_uri}
    return environ


def gpu_count() -> int:
    """GPUs on this host, without importing a framework into the launcher."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False)
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def exit_status(returncode: int) -> int:
    """A child killed by signal N reports -N; a shell reports 128 + N. Never 0 for a killed child."""
    return 128 - returncode if returncode < 0 else returncode


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
                if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                    log.error("data host %s refused the shutdown token", target)
                    return
                if attempt == 2:
                    log.info("data host %s did not answer the shutdown (%s): already gone", target, error.code().name)

    with futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        list(pool.map(one, targets))


def run_data_host(cluster: Cluster, settings: PlatformSettings, variant: Variant, config: Any, stop: threading.Event) -> int:
    """Serve the channel until stopped. The control server (Describe, keep-alive, Shutdown) is ours for
    every variant; the batches come from our gRPC pipeline or from tf.data.service."""
    from training.data_service.server import ServerSettings, default_workers, serve

    root = channel_dir(settings.data_channel)
    folder = scan_image_folder(root, settings.data_channel, cluster.current_group)
    data_hosts = settings.data_hosts(cluster)
    host_index = data_hosts.index(cluster.current_host)
    addresses = host_addresses()
    server_settings = ServerSettings(
        host=cluster.current_host,
        # On SageMaker listen on every interface; the emulated cluster gives each host its own address.
        bind_address=addresses.get(cluster.current_host, "0.0.0.0"),
        port=settings.data_service_port,
        channel=settings.data_channel,
        batch_size=config.batch_size,
        augment=config.augment_config,
        shutdown_token=settings.shutdown_token,
        idle_timeout_s=settings.data_idle_timeout_s,
        start_deadline_s=settings.data_start_deadline_s,
        workers=default_workers(),
        seed=config.seed,
    )
    source = None
    if variant.data_service == "tf.data.service":
        from training.data_service.tf_service import TfDataService, TfServiceSettings

        dispatcher, workers = settings.tf_data_service_addresses(cluster, addresses)
        source = TfDataService(
            TfServiceSettings(
                dispatcher_address=dispatcher,
                worker_address=workers[host_index],
                channel_dir=root,
                dispatcher=host_index == 0,
                batch_size=config.batch_size,
                image_size=config.image_size,
                augment=config.augment,
                seed=config.seed + host_index,
            )
        )
    reason = serve(server_settings, folder, host_index, stop, source=source)
    return reason.exit_code


# How each input format's training channel is checked before a trainer starts.
CHANNEL_CHECKS = {"image_folder": scan_image_folder, "csv": scan_csv_channel}


def run_dnn_host(cluster: Cluster, settings: PlatformSettings, variant: Variant, stop: threading.Event) -> int:
    addresses = host_addresses()
    dnn_hosts = cluster.group(settings.groups_with_role(DNN)[0]).hosts
    data_targets = settings.data_service_targets(cluster, addresses)
    if not data_targets:
        # Homogeneous: the channel must be here; fail now rather than after the trainer started.
        CHANNEL_CHECKS[variant.input_format](channel_dir(settings.data_channel), settings.data_channel, cluster.current_group)
    node_rank = dnn_hosts.index(cluster.current_host)
    processes_per_host = settings.processes_per_host or max(1, gpu_count())
    master_address = address_of(dnn_hosts[0], addresses)
    command = trainer_command(
        variant.module,
        distribution=settings.distribution,
        nnodes=len(dnn_hosts),
        processes_per_host=processes_per_host,
        node_rank=node_rank,
        master_address=master_address,
        master_port=settings.master_port,
    )
    environment = trainer_environment(settings, dict(os.environ))
    with contextlib.ExitStack() as stack:
        if settings.distribution == "horovod":
            processes = _start_horovod_ranks(
                stack, cluster, settings, command, environment, dnn_hosts, processes_per_host, addresses, master_address
            )
        else:
            log.info("host %s (dnn, node rank %d) starting the trainer: %s", cluster.current_host, node_rank, " ".join(command[1:]))
            processes = [subprocess.Popen(command, env=environment)]
        watchdog = None
        if data_targets and variant.data_service != "grpc":
            # Batches bypass our data hosts' control servers: tell them the trainers are alive.
            from training.data_service.control import KeepAlive

            keepalive = stack.enter_context(KeepAlive(data_targets, interval_s=min(5.0, settings.data_idle_timeout_s / 3)))
            watchdog = functools.partial(dispatcher_lost, keepalive, data_targets[0], DISPATCHER_LOSS_S)
        status = wait_for_trainers(processes, stop, abort=watchdog)
    if status and not failure_path().exists():  # the trainer may have written a more precise reason
        write_failure(f"the trainer on {cluster.current_host} exited with status {status}")
    # Node rank 0 ends the data hosts after training (every rank has passed the final barrier by then);
    # any node whose trainer failed ends them too, since the job is failing anyway.
    if data_targets and (node_rank == 0 or status != 0):
        shutdown_data_hosts(data_targets, settings.shutdown_token, requester=cluster.current_host)
    return status


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


# tf.data.service has one dispatcher: once its host is gone no trainer gets another batch, and its
# client would wait for an hour. The job fails after this long without an answer from that host.
DISPATCHER_LOSS_S = 20.0


def dispatcher_lost(keepalive: KeepAlive, dispatcher_target: str, bound_s: float) -> str | None:
    """Why the job must stop, if the dispatcher's host has been silent for longer than ``bound_s``."""
    silent = keepalive.silent_for(dispatcher_target)
    if silent <= bound_s:
        return None
    return f"the tf.data.service dispatcher host ({dispatcher_target}) has not answered for {silent:.0f} s: no trainer can get batches"


def wait_for_trainers(
    processes: list[subprocess.Popen], stop: threading.Event, grace_s: float = 10.0, abort: Callable[[], str | None] | None = None
) -> int:
    """Wait for every trainer process of this host. The first to fail fails the host: the others are
    stopped (a Horovod rank whose peer died would otherwise wait for ever); SIGTERM to the launcher is
    passed on to all of them; ``abort`` returning a reason stops them all and fails the host with it.
    Returns this host's exit status."""
    status = 0
    stopping_since: float | None = None
    while any(process.poll() is None for process in processes):
        failed = [process for process in processes if process.returncode not in (None, 0)]
        reason = abort() if abort is not None and stopping_since is None else None
        if reason:
            log.error("%s", reason)
            write_failure(reason)
            status = 1
        if (failed or reason or stop.is_set()) and stopping_since is None:
            if failed:
                status = exit_status(failed[0].returncode)
                _log_trainer_end(failed[0].returncode)
            stopping_since = time.monotonic()
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > grace_s:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.1)
    if not status:
        failed = [process for process in processes if process.returncode != 0]
        if failed:
            status = exit_status(failed[0].returncode)
            _log_trainer_end(failed[0].returncode)
    return status


def _log_trainer_end(returncode: int) -> None:
    if returncode < 0:
        log.error("the trainer was killed by %s", signal.Signals(-returncode).name)
    else:
        log.error("the trainer failed with exit code %d", returncode)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        cluster = load_cluster()
        hyperparameters = load_hyperparameters()
        variant = trainer_for(str(hyperparameters.get("variant", "pytorch")))
        settings, config = parse_settings(hyperparameters, variant.config)
        settings.check_cluster(cluster)
        if settings.distribution not in variant.distributions:
            raise HyperparameterError(
                f"variant {variant.name!r} runs with distribution {list(variant.distributions)}, not {settings.distribution!r}"
            )
        role = settings.role_of(cluster.current_group)
        log.info("host %s is in instance group %s (%s): role %s", cluster.current_host, cluster.current_group, cluster.current_instance_type, role)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if role == DATA:
            return run_data_host(cluster, settings, variant, config, stop)
        return run_dnn_host(cluster, settings, variant, stop)
    except (ClusterConfigError, HyperparameterError, ChannelError, TfServiceError) as error:
        message = f"{type(error).__name__}: {error}"
        log.error("%s", message)
        write_failure(message)
        # A job that is wrong exits as a usage error; a data host whose tf.data.service did not start, as failed preprocessing.
        return StopReason.FAILED.exit_code if isinstance(error, TfServiceError) else CONFIG_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
