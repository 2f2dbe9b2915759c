"""The gRPC data service: real servers with real worker processes on loopback, and the merging client.

The hosts serve the built-in vision workload (training/workloads/vision.py) as its jobs do: batches of
its features {"image": uint8 [B, 3, 32, 32], "label": int64 [B]}, made by its preprocess in the
producer's worker processes (training/workload/serving.py)."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.conftest import TOKEN
from tests.training.test_codec import image_batch_of_earlier_releases
from tests.training.test_data_service_limits import FixedBatches
from training.data_service import codec
from training.data_service import data_service_pb2 as pb
from training.data_service.client import DataServiceDataset
from training.data_service.control import DataServiceRefusedError, DataServiceUnavailableError, describe, request_shutdown
from training.data_service.dataset import ImageDataset
from training.data_service.server import (
    Activity,
    ServerSettings,
    StopReason,
    sample_order,
    serve,
    stop_verdict,
)
from training.local.cluster import free_port
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.contract import load_workload, resolve_hyperparameters
from training.workload.samples import BatchRecipe
from training.workload.serving import WorkloadBatchProducer, host_listing, recipe_for, wire_features

_addresses = itertools.count(2)
# What the vision workload's hosts below announce, and every batch of theirs holds.
VISION = (codec.FeatureSpec("image", "uint8", (3, 32, 32)), codec.FeatureSpec("label", "int64"))


def vision_host(images: Path, seed: int = 0) -> tuple[ImageDataset, BatchRecipe]:
    """The vision workload's listing of ``images`` and its workers' recipe (32² crops), as a data host sets them up."""
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": "32"})
    listing = host_listing(vision, "train", images, hyperparameters, {"train": images})
    return listing, recipe_for(vision, listing, packages_dir=None, hyperparameters=hyperparameters, seed=seed)


class RunningHost:
    def __init__(self, settings: ServerSettings, thread: threading.Thread, stop: threading.Event, result: dict,
                 source: WorkloadBatchProducer) -> None:
        self.settings, self.thread, self.stop, self._result, self.source = settings, thread, stop, result, source

    def warm(self, timeout: float = 60.0) -> RunningHost:
        """Wait until a batch is ready: the spawned workers import the workload (and torch) first, which
        can take longer than the short idle timeouts some tests set."""
        give_up = time.monotonic() + timeout
        while self.source.batches.empty():
            assert time.monotonic() < give_up and self.thread.is_alive(), "the data host made no batch"
            time.sleep(0.05)
        return self

    @property
    def target(self) -> str:
        return f"{self.settings.bind_address}:{self.settings.port}"

    def reason(self, timeout: float = 15.0) -> StopReason:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "data host did not stop"
        return self._result["reason"]


@contextlib.contextmanager
def data_host(images: Path, **overrides) -> Iterator[RunningHost]:
    """A data host of the vision workload over ``images``, set up as the launcher's run_workload_data_host sets one up."""
    settings = ServerSettings(
        host=f"test-host-{next(_addresses)}",
        bind_address=f"127.0.77.{next(_addresses)}",
        port=free_port(),
        channel="train",
        batch_size=8,
        shutdown_token=TOKEN,
        idle_timeout_s=30,
        start_deadline_s=60,
        workers=1,
        stop_grace_s=0,  # `stop` stands for a host that goes away
    )
    host_index = overrides.pop("host_index", 0)
    settings = ServerSettings(**{**settings.__dict__, **overrides})
    folder, recipe = vision_host(images, seed=settings.seed)
    settings = ServerSettings(**{**settings.__dict__, "features": wire_features(recipe.features)})
    source = WorkloadBatchProducer(folder, recipe, batch_size=settings.batch_size, workers=settings.workers, seed=settings.seed,
                                   host_index=host_index, queue_depth=settings.queue_depth, hosts=settings.hosts, sharded=settings.sharded)
    stop, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.setdefault("reason", serve(settings, folder, stop, source=source)), daemon=True)
    thread.start()
    host = RunningHost(settings, thread, stop, result, source)
    try:
        yield host
    finally:
        stop.set()
        thread.join(20)


def take(dataset: DataServiceDataset, count: int) -> list:
    return list(itertools.islice(iter(dataset), count))


def test_batches_are_raw_uint8_tensors_and_describe_tells_the_dataset(images: Path) -> None:
    with data_host(images) as host:
        info = describe([host.target], TOKEN, timeout_s=10)
        assert list(info.classes) == ["class_00", "class_01", "class_02", "class_03"]
        assert (info.num_samples, info.batch_size, list(info.sample_shape)) == (96, 8, [])
        assert tuple(codec.FeatureSpec(feature.name, feature.dtype, tuple(feature.shape)) for feature in info.features) == VISION
        dataset = DataServiceDataset([host.target], 8, TOKEN, "test")
        batches = take(dataset, 5)
    assert dataset.features == VISION
    for batch in batches:
        assert list(batch) == ["image", "label"]
        assert batch["image"].dtype.is_floating_point is False and str(batch["image"].dtype) == "torch.uint8"
        assert tuple(batch["image"].shape) == (8, 3, 32, 32)
        assert str(batch["label"].dtype) == "torch.int64" and set(batch["label"].tolist()) <= {0, 1, 2, 3}


def test_bytes_on_the_wire_per_sample_are_the_uint8_sample_size() -> None:
    images = np.zeros((64, 3, 96, 96), dtype=np.uint8)
    message = pb.Batch.FromString(codec.encode_features({"image": images, "label": np.zeros(64, dtype=np.int64)}))
    per_sample = message.ByteSize() / 64
    assert 3 * 96 * 96 <= per_sample <= 3 * 96 * 96 * 1.001  # the image bytes, 8 label bytes, and framing


def test_a_wrong_token_is_refused_and_the_right_one_stops_the_host(images: Path) -> None:
    with data_host(images) as host:
        describe([host.target], TOKEN, timeout_s=10)
        with pytest.raises(grpc.RpcError) as refused:
            request_shutdown(host.target, "not-the-job-token-at-all", "intruder")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert take(DataServiceDataset([host.target], 8, TOKEN, "test"), 1), "host must keep serving after a refused shutdown"
        reply = request_shutdown(host.target, TOKEN, "test")
        assert reply.host == host.settings.host
        assert host.reason() == StopReason.SHUTDOWN and StopReason.SHUTDOWN.exit_code == 0


def test_an_open_stream_ends_cleanly_on_shutdown(images: Path) -> None:
    with data_host(images) as host:
        dataset = DataServiceDataset([host.target], 8, TOKEN, "test")
        iterator = iter(dataset)
        next(iterator)
        request_shutdown(host.target, TOKEN, "test")
        remaining = list(iterator)  # drains what was in flight, then stops without an error
        assert len(remaining) < 20
        assert dataset.stats.hosts[host.target].ended == "end of stream (shutdown)"
        assert dataset.stats.lost_hosts == []


def test_a_batch_size_that_is_not_the_jobs_is_refused(images: Path) -> None:
    with data_host(images) as host, pytest.raises(DataServiceRefusedError, match="batches of 4, this data host makes 8"):
        take(DataServiceDataset([host.target], 4, TOKEN, "test"), 1)


def test_no_client_before_the_start_deadline_stops_the_host_with_an_error(images: Path) -> None:
    with data_host(images, start_deadline_s=1.0) as host:
        assert host.reason() == StopReason.START_DEADLINE
    assert StopReason.START_DEADLINE.exit_code != 0


def test_the_host_stops_after_its_clients_left_and_stayed_away(images: Path) -> None:
    with data_host(images, idle_timeout_s=1.0) as host:
        take(DataServiceDataset([host.warm().target], 8, TOKEN, "test"), 2)
        started = time.monotonic()
        assert host.reason() == StopReason.IDLE
        assert time.monotonic() - started < 6


def test_streams_of_several_hosts_are_merged(images: Path) -> None:
    with data_host(images) as first, data_host(images) as second:
        dataset = DataServiceDataset([first.target, second.target], 8, TOKEN, "test")
        # Arrival order decides; a host that starts later joins in as soon as its first batch is ready.
        take_until(iter(dataset), lambda: all(state.batches for state in dataset.stats.hosts.values()))


def test_a_trainer_counts_each_epoch_of_two_replicated_data_hosts_exactly_once(images: Path) -> None:
    """Real servers and the real client: every batch says which sample's turn each slot was and in which
    epoch; the trainer's receipts show the 96-image channel's epochs whole and without duplicates."""
    from training.data_service.epochs import epoch_report

    with data_host(images, hosts=2, host_index=0) as first, data_host(images, hosts=2, host_index=1) as second:
        dataset = DataServiceDataset([first.target, second.target], 8, TOKEN, "test")
        # Until two epochs of each host's 48-image share were trained (12 batches each; a host's batches
        # are handed over in the order it made them). Arrived is not enough: some wait in the queue.
        def trained(host: str) -> int:
            return sum(count for count, _ in dataset.stats.ledger.as_dict()["epochs"].get(host, {}).values())

        def training() -> Iterator:
            for batch in dataset:
                dataset.mark_trained()  # as the trainer does, once per step
                yield batch

        batches = training()
        taken = take_until(batches, lambda: all(trained(host.settings.host) >= 96 for host in (first, second)), timeout_s=60)
        report = epoch_report(dataset.stats.ledger.as_dict(), {"channel": 96}, per_host=False)
    assert report["exactly_once"][:2] == ["0", "1"] and report["not_exactly_once"] == [] and report["duplicates"] == 0, report
    # What was handed over, not what arrived: the batches still queued are in no epoch.
    assert 96 * len(report["exactly_once"]) + sum(report["incomplete"].values()) == taken * 8


def test_a_trainer_of_a_replicated_channel_starts_without_waiting_for_every_data_host(images: Path, tmp_path: Path) -> None:
    """Its epochs are the channel's, so one Describe tells their size: a data host that never comes up
    (here algo-2: nothing listens at its address) leaves training to the others, as the client does."""
    import json

    from tests.conftest import hetero_resource_config, platform_hyperparameters, write_host_tree
    from training.cluster import HOST_ADDRESSES_ENV
    from training.host_environment import TrainerEnvironment
    from training.local.single_host import trainer_environment
    from training.trainers.pytorch_runtime import build_trainer

    with data_host(images, hosts=2) as live:
        hyperparameters = platform_hyperparameters(data_service_port=live.settings.port, data_connect_timeout_s=3, model="cnn",
                                                   cnn_width=8, image_size=32, batch_size=8, steps=10)
        base = write_host_tree(tmp_path / "algo-3", hetero_resource_config("algo-3"), hyperparameters)
        addresses = {"algo-1": live.settings.bind_address, "algo-2": "127.0.77.254", "algo-3": "127.0.0.1"}
        trainer = build_trainer(TrainerEnvironment.read(trainer_environment(base) | {HOST_ADDRESSES_ENV: json.dumps(addresses)}))
    assert trainer.source == "data_service" and trainer.epoch_samples == {"channel": 96} and not trainer.sharded


def take_until(iterator: Iterator, done, timeout_s: float = 15.0) -> int:
    """Take at least one batch, then more until ``done()`` holds; fail after ``timeout_s``."""
    give_up, taken = time.monotonic() + timeout_s, 0
    while taken == 0 or not done():
        assert time.monotonic() < give_up, "condition not reached in time"
        next(iterator)
        taken += 1
    return taken


def test_training_carries_on_when_one_host_is_lost(images: Path) -> None:
    with data_host(images) as doomed, data_host(images) as survivor:
        dataset = DataServiceDataset([doomed.target, survivor.target], 8, TOKEN, "test", reconnect_timeout_s=1.0)
        iterator = iter(dataset)
        take_until(iterator, lambda: all(state.batches for state in dataset.stats.hosts.values()))
        doomed.stop.set()  # the host goes away mid-run
        assert doomed.reason() == StopReason.SIGNAL
        take_until(iterator, lambda: dataset.stats.lost_hosts)
        assert dataset.stats.lost_hosts == [doomed.target]
        before = dataset.stats.hosts[survivor.target].batches
        assert len(list(itertools.islice(iterator, 30))) == 30
        assert dataset.stats.hosts[survivor.target].batches > before


def test_unreachable_hosts_fail_within_the_connect_bound() -> None:
    targets = [f"127.0.78.2:{free_port()}", f"127.0.78.3:{free_port()}"]
    started = time.monotonic()
    with pytest.raises(DataServiceUnavailableError, match="all 2 data hosts are gone"):
        take(DataServiceDataset(targets, 8, TOKEN, "test", connect_timeout_s=1.5), 1)
    assert time.monotonic() - started < 6
    with pytest.raises(DataServiceUnavailableError, match="no data host answered"):
        describe(targets, TOKEN, timeout_s=1.0)


def test_losing_every_host_mid_run_is_an_error_not_a_hang(images: Path) -> None:
    with data_host(images) as host:
        iterator = iter(DataServiceDataset([host.target], 8, TOKEN, "test", reconnect_timeout_s=1.0))
        next(iterator)
        host.stop.set()
        started = time.monotonic()
        with pytest.raises(DataServiceUnavailableError, match="gone"):
            list(itertools.islice(iterator, 1000))
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("activity", "now", "expected"),
    [
        (Activity(started_at=0, last_activity=0), 5, None),
        (Activity(started_at=0, last_activity=0), 11, StopReason.START_DEADLINE),
        (Activity(started_at=0, last_activity=98, clients_seen=1), 100, None),
        (Activity(started_at=0, last_activity=1, clients_seen=1), 3, None),
        # Clients came, then nothing was taken and no keep-alive came: an open stream does not count.
        (Activity(started_at=0, last_activity=1, clients_seen=1), 4.5, StopReason.IDLE),
    ],
)
def test_stop_verdict(activity: Activity, now: float, expected: StopReason | None) -> None:
    assert stop_verdict(activity, now, idle_timeout_s=3, start_deadline_s=10) == expected


def test_sample_order_is_a_fresh_permutation_each_epoch() -> None:
    first = list(itertools.islice(sample_order(10, seed=0, host_index=0), 20))
    assert sorted(first[:10]) == sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:]


@pytest.mark.parametrize(("samples", "hosts"), [(10, 2), (11, 3), (96, 4), (5, 5)])
def test_a_replicated_channels_data_hosts_send_every_sample_exactly_once_per_epoch(samples: int, hosts: int) -> None:
    """Each host holds every file; together they serve each epoch once, not once per host."""
    for epoch in range(3):
        shares = []
        for host in range(hosts):
            per_epoch = len(range(host, samples, hosts))
            order = list(itertools.islice(sample_order(samples, seed=7, host_index=host, hosts=hosts), per_epoch * 3))
            shares.append(order[epoch * per_epoch:(epoch + 1) * per_epoch])
        served = [index for share in shares for index in share]
        assert sorted(served) == list(range(samples)), f"epoch {epoch}"


def test_a_sharded_channels_host_serves_all_of_its_own_shard_in_its_own_order() -> None:
    first = list(itertools.islice(sample_order(10, seed=0, host_index=0, hosts=2, sharded=True), 10))
    second = list(itertools.islice(sample_order(10, seed=0, host_index=1, hosts=2, sharded=True), 10))
    assert sorted(first) == sorted(second) == list(range(10)) and first != second


def test_fewer_samples_than_data_hosts_is_refused_before_anything_starts(images: Path) -> None:
    from training.data_service.server import DataHostError

    folder, recipe = vision_host(images)
    tiny = ImageDataset(folder.root, folder.classes, folder.samples[:2])
    with pytest.raises(DataHostError, match="fewer than its 3 data hosts"):
        WorkloadBatchProducer(tiny, recipe, batch_size=1, workers=1, hosts=3)


# What the fake hosts below describe: the batches of data_host's (8 × 3 × 32², four classes).
FAKE_INFO = pb.DatasetInfo(channel="train", classes=[f"class_0{index}" for index in range(4)], batch_size=8, host="fake",
                           features=[pb.FeatureSpec(name=feature.name, dtype=feature.dtype, shape=list(feature.shape)) for feature in VISION])


@contextlib.contextmanager
def fake_data_host(stream_batches, address: str, info: pb.DatasetInfo = FAKE_INFO) -> Iterator[str]:
    """A real gRPC server whose StreamBatches is ``stream_batches(request, context)``: a faulty data host.
    Its Describe answers ``info`` (a trainer's stream asks it what batches to expect)."""
    from concurrent import futures

    from training.data_service.server import SERVICE

    server = grpc.server(futures.ThreadPoolExecutor(4))
    handlers = {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            stream_batches, request_deserializer=pb.StreamRequest.FromString, response_serializer=None
        ),
        "Describe": grpc.unary_unary_rpc_method_handler(
            lambda request, context: info, request_deserializer=pb.DescribeRequest.FromString, response_serializer=pb.DatasetInfo.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(f"{address}:0")
    server.start()
    try:
        yield f"{address}:{port}"
    finally:
        server.stop(0)


def _malformed(images: np.ndarray | pb.Tensor, labels: np.ndarray) -> bytes:
    """A Batch a faulty or hostile data host might send (protobuf's writer: any shape goes)."""
    tensor = images if isinstance(images, pb.Tensor) else codec.encode(images)
    return pb.Batch(features=[pb.Feature(name="image", tensor=tensor), pb.Feature(name="label", tensor=codec.encode(labels))]).SerializeToString()


def _good(images: np.ndarray | None = None, labels: np.ndarray | None = None) -> bytes:
    """A batch of the vision workload's, as its data host's workers write it."""
    return codec.encode_features({"image": GOOD_IMAGES if images is None else images, "label": GOOD_LABELS if labels is None else labels})


GOOD_IMAGES, GOOD_LABELS = np.zeros((8, 3, 32, 32), np.uint8), np.zeros(8, np.int64)
MALFORMED = {
    "truncated": (b"\x4a\x05abc", "a well-formed Batch, got field 9 runs past"),  # field 9 (a feature) claims 5 bytes, 3 follow
    # numpy's product of these dimensions is 0: today's reader raised ValueError in reshape, uncaught.
    "overflowing shape": (_malformed(pb.Tensor(dtype="uint8", shape=[2**62, 4]), GOOD_LABELS), "exceeds"),
    "labels of another dtype": (_good(labels=np.zeros(8, np.int32)), "feature 'label' of int64 [8], got int32 [8]"),
    "fewer labels than images": (_malformed(GOOD_IMAGES, np.zeros(7, np.int64)), "feature 'label' of int64 [8], got int64 [7]"),
    "images of another rank": (_good(images=np.zeros((8, 3072), np.uint8)),
                               "feature 'image' of uint8 [8, 3, 32, 32], got uint8 [8, 3072]"),
    "a feature missing": (codec.encode_features({"image": GOOD_IMAGES}), "got no feature 'label'"),
    # The image batches of earlier releases (Batch fields 2 and 3, now reserved): no features at all.
    "an image batch of an earlier release": (image_batch_of_earlier_releases(GOOD_IMAGES, GOOD_LABELS), "got no feature 'image'"),
    # More bytes than the batch it described: gRPC does not read it (the stream's receive limit).
    "larger than described": (_good(images=np.zeros((8, 3, 64, 64), np.uint8)), "larger than max"),
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_host_sending_a_malformed_batch_is_lost_by_name_not_an_ended_input(fault: str) -> None:
    payload, seen = MALFORMED[fault]

    def faulty(request, context):
        yield payload

    with fake_data_host(faulty, "127.0.78.9") as target:
        dataset = DataServiceDataset([target], 8, TOKEN, "test")
        started = time.monotonic()
        with pytest.raises(DataServiceUnavailableError, match=f"all 1 data hosts are gone .*MalformedBatchError: expected .*{re.escape(seen)}"):
            take(dataset, 1)
    assert dataset.stats.lost_hosts == [target] and time.monotonic() - started < 10


def test_training_goes_on_with_the_other_hosts_when_one_sends_a_malformed_batch(images: Path) -> None:
    payload, _ = MALFORMED["fewer labels than images"]

    def faulty(request, context):
        yield _good()  # one good batch first: trained on, as it should be
        yield payload

    with fake_data_host(faulty, "127.0.78.12") as bad, data_host(images) as healthy:
        dataset = DataServiceDataset([bad, healthy.target], 8, TOKEN, "test")
        iterator = iter(dataset)
        take_until(iterator, lambda: dataset.stats.lost_hosts and dataset.stats.hosts[healthy.target].batches, timeout_s=60)
        assert dataset.stats.lost_hosts == [bad] and dataset.stats.hosts[bad].batches == 1
        assert dataset.stats.lost_reasons[bad] == "MalformedBatchError: expected feature 'label' of int64 [8], got int64 [7]"
        assert bad in dataset.stats.unavailable_hosts  # the summary's lost_data_hosts
        labels = [batch["label"] for batch in itertools.islice(iterator, 10)]
        assert len(labels) == 10 and all(tuple(batch.shape) == (8,) and int(batch.max()) < 4 for batch in labels)


# The job's token on every call ------------------------------------------------------------------------


def test_calls_without_the_jobs_token_are_refused_and_change_nothing(images: Path) -> None:
    from training.data_service import data_service_pb2_grpc as pb_grpc
    from training.data_service.auth import call_metadata

    with data_host(images, idle_timeout_s=2.0) as host:
        with grpc.insecure_channel(host.target) as channel:
            stub = pb_grpc.DataServiceStub(channel)
            for metadata in (None, call_metadata("a-token-that-is-not-this-jobs")):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Describe(pb.DescribeRequest(), timeout=5, metadata=metadata, wait_for_ready=True)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as refused:
                    next(iter(stub.StreamBatches(pb.StreamRequest(batch_size=8), timeout=5, metadata=metadata, wait_for_ready=True)))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(DataServiceRefusedError, match="UNAUTHENTICATED"):
            take(DataServiceDataset([host.target], 8, "not-the-job-token-either", "intruder"), 1)
        with pytest.raises(DataServiceRefusedError, match="refused this job's token"):
            describe([host.target], "not-the-job-token-either", timeout_s=5)
        # None of it counted as a client: the host still waits for its first one.
        time.sleep(2.5)
        assert host.thread.is_alive()
        assert take(DataServiceDataset([host.target], 8, TOKEN, "test"), 1)


def test_an_open_stream_that_takes_no_batches_does_not_keep_the_host_alive(images: Path) -> None:
    from training.data_service import data_service_pb2_grpc as pb_grpc
    from training.data_service.auth import call_metadata

    with data_host(images, idle_timeout_s=1.0) as host, grpc.insecure_channel(host.warm().target) as channel:
        stream = pb_grpc.DataServiceStub(channel).StreamBatches(pb.StreamRequest(batch_size=8), metadata=call_metadata(TOKEN), wait_for_ready=True)
        next(iter(stream))  # one batch, then the stream stays open and nothing more is read
        started = time.monotonic()
        assert host.reason(timeout=20) == StopReason.IDLE
        assert time.monotonic() - started < 15
        stream.cancel()


@contextlib.contextmanager
def hung_data_host() -> Iterator[str]:
    """A data host that accepts streams and then never sends a batch."""
    release = threading.Event()

    def never(request, context):
        release.wait()
        yield from ()

    try:
        with fake_data_host(never, "127.0.78.10") as target:
            yield target
    finally:
        release.set()


def test_a_host_that_sends_nothing_is_dropped_after_the_batch_deadline(images: Path) -> None:
    # The start bound applies to the healthy host too: it must cover its worker's start (an import of torch in a
    # spawned process) on a loaded machine, or both hosts are dropped. The full suite under load once took over 2 s.
    with hung_data_host() as hung, data_host(images) as healthy:
        describe([healthy.target], TOKEN, timeout_s=30)
        dataset = DataServiceDataset(
            [hung, healthy.target], 8, TOKEN, "test", batch_timeout_s=1.0, reconnect_timeout_s=1.0, connect_timeout_s=8.0
        )
        iterator = iter(dataset)
        take_until(iterator, lambda: dataset.stats.lost_hosts, timeout_s=40)
        assert dataset.stats.lost_hosts == [hung]
        assert "no batch for 8 s" in dataset.stats.hosts[hung].ended  # before its first batch, the start bound
        assert len(list(itertools.islice(iterator, 10))) == 10  # the healthy host goes on


def test_a_job_whose_only_host_hangs_fails_with_a_named_error() -> None:
    with hung_data_host() as hung:
        started = time.monotonic()
        with pytest.raises(DataServiceUnavailableError, match="no batch for 3 s: the host is hung"):
            take(DataServiceDataset([hung], 8, TOKEN, "test", batch_timeout_s=1.0, reconnect_timeout_s=1.0, connect_timeout_s=3.0), 1)
        assert time.monotonic() - started < 30


def test_a_slow_trainer_is_not_a_hung_host(images: Path) -> None:
    """The batch deadline counts only time spent waiting for the host, never time the trainer took."""
    with data_host(images) as host:
        dataset = DataServiceDataset([host.target], 8, TOKEN, "test", batch_timeout_s=0.5)
        iterator = iter(dataset)
        for _ in range(3):
            next(iterator)
            time.sleep(1.5)  # a step three times longer than the deadline
        assert dataset.stats.lost_hosts == [] and dataset.stats.hosts[host.target].ended is None


def test_a_taken_port_is_a_named_error_not_a_shared_port(images: Path) -> None:
    from training.data_service.server import PortInUseError

    with data_host(images) as first:
        describe([first.target], TOKEN, timeout_s=10)  # the first host holds its port
        settings = ServerSettings(**{**first.settings.__dict__, "host": "second"})
        folder, _ = vision_host(images)
        with pytest.raises(PortInUseError, match="another process on this host holds the port"):
            serve(settings, folder, threading.Event(), source=FixedBatches(_good()))


def test_after_sigterm_a_data_host_serves_on_until_the_dnn_hosts_shut_it_down(images: Path) -> None:
    """StopTrainingJob signals every instance: the trainers need batches until the step where they save."""
    with data_host(images, stop_grace_s=60) as host:
        dataset = DataServiceDataset([host.target], 8, TOKEN, "test")
        iterator = iter(dataset)
        next(iterator)
        host.stop.set()  # SIGTERM
        assert len(list(itertools.islice(iterator, 20))) == 20 and host.thread.is_alive()
        request_shutdown(host.target, TOKEN, "test")
        assert host.reason() == StopReason.SHUTDOWN
    with data_host(images, stop_grace_s=1) as host:
        describe([host.target], TOKEN, timeout_s=10)
        host.stop.set()
        assert host.reason() == StopReason.SIGNAL  # nobody shut it down: it leaves after its grace


def test_a_host_slow_to_send_its_first_batch_is_not_dropped_by_the_batch_deadline() -> None:
    """Its preprocessing workers may still be starting: until a first batch, the start bound governs."""
    batch = _good()

    def slow_start(request, context):
        time.sleep(2.0)
        while context.is_active():
            yield batch

    with fake_data_host(slow_start, "127.0.78.11") as target:
        dataset = DataServiceDataset([target], 8, TOKEN, "test", batch_timeout_s=0.5, connect_timeout_s=30)
        assert len(take(dataset, 5)) == 5 and dataset.stats.lost_hosts == []


def test_an_unexpected_error_in_preprocessing_stops_the_host_by_name(images: Path) -> None:
    """Not a decode error (those are skipped and counted): anything else a worker raises ends the
    producer, and the host stops at once with the error's name, not silently at its idle timeout."""
    from dataclasses import replace

    folder, recipe = vision_host(images)
    samples = tuple((source, "not a class index") for source, _ in folder.samples[:4])  # the label's np.int64 raises ValueError
    producer = WorkloadBatchProducer(ImageDataset(folder.root, folder.classes, samples), replace(recipe, samples=samples), batch_size=2, workers=1)
    producer.start()
    try:
        deadline = time.monotonic() + 120
        while producer.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        producer.stop()
    assert producer.failure is not None and producer.failure.startswith("preprocessing stopped: HookError: preprocess raised ValueError"), producer.failure
