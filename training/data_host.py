"""The data role: serve preprocessed batches (our gRPC stream, training/data_service/server.py, or
tf.data.service for the tensorflow variant, training/data_service/tf_service.py) until an authenticated
shutdown, an idle timeout (the DNN hosts are gone), or a start deadline. A data host that cannot serve
(taken port, empty or undecodable channel, tf.data.service that did not start) writes its reason to the
failure file and reports it to every DNN host before it exits. Also the DNN hosts' side of the data
hosts: the shutdown after training, and the verdicts on their failure reports and a lost dispatcher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from training.data_service.dataset import (
    EmptyChannelError,
    scan_image_files,
    scan_images,
    scan_text_channel,
)
from training.failure import write_failure
from training.host_environment import HostEnvironment
from training.hyperparameters import (
    HyperparameterError,
    PlatformSettings,
)
from training.variants import Variant
from training.workload.host import PreparedWorkload
from training.workload.tf_contract import file_pattern, list_channel_files

log = logging.getLogger("training.data_host")


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
