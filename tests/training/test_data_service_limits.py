"""What our gRPC servers read, and what a trainer receives, at most: real servers in child processes, real
callers here, and the servers' memory measured from outside (psutil).

Before the token is checked, a data host and a DNN host's ReportFailure server used to take 1 GiB
messages: two unauthenticated 512 MiB requests took a data host from 60 MiB to 2.1 GB.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest

from tests.conftest import TOKEN
from training.data_service import codec
from training.data_service import data_service_pb2 as pb
from training.data_service.auth import call_metadata
from training.data_service.client import stream_options, stream_spec
from training.data_service.control import MAX_REPLY_BYTES
from training.data_service.dataset import MAX_CLASSES
from training.data_service.server import (
    MAX_REQUEST_BYTES,
    SERVICE,
    ReadyBatch,
    ServerSettings,
    StopReason,
    put_until_stopped,
    serve,
)
from training.local.cluster import free_port

REPO = Path(__file__).resolve().parents[2]
# Each unauthenticated request: far beyond any request, as the were (two of 512 MiB).
LARGE = 48 << 20

# A data host of the built-in vision workload, set up as the launcher's run_workload_data_host sets one up.
DATA_HOST = """
import sys, threading
from pathlib import Path
from training.data_service.server import ServerSettings, serve
from training.variants import BUILTIN_WORKLOADS_DIR
from training.workload.contract import load_workload, resolve_hyperparameters
from training.workload.serving import WorkloadBatchProducer, host_listing, recipe_for, wire_features
address, port, token, images = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
hyperparameters = resolve_hyperparameters(vision, {"image_size": "32"})
listing = host_listing(vision, "train", images, hyperparameters, {"train": images})
recipe = recipe_for(vision, listing, packages_dir=None, hyperparameters=hyperparameters, seed=0)
settings = ServerSettings(host="limits", bind_address=address, port=port, channel="train", batch_size=8, shutdown_token=token,
                          idle_timeout_s=120, start_deadline_s=120, workers=1, features=wire_features(recipe.features))
serve(settings, listing, threading.Event(), source=WorkloadBatchProducer(listing, recipe, batch_size=8, workers=1))
"""

FAILURE_REPORTS = """
import sys
from training.data_service.control import FailureReports
address, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with FailureReports(f"{address}:{port}", token):
    sys.stdin.read()  # until the test closes it
"""


@contextlib.contextmanager
def server_process(script: str, address: str, *args: str) -> Iterator[tuple[str, psutil.Process]]:
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", script, address, str(port), TOKEN, *args], cwd=REPO, stdin=subprocess.PIPE)
    target = f"{address}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            ready = grpc.channel_ready_future(channel)
            give_up = time.monotonic() + 60
            while not ready.done():
                assert child.poll() is None and time.monotonic() < give_up, f"the server did not start (exit {child.poll()})"
                time.sleep(0.1)
        yield target, psutil.Process(child.pid)
    finally:
        child.stdin.close()
        child.terminate()
        child.wait(timeout=30)


class PeakRss:
    """The highest resident memory of a process while the block runs, sampled every 5 ms."""

    def __init__(self, process: psutil.Process) -> None:
        self.process, self.peak, self._stop = process, process.memory_info().rss, threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        time.sleep(0.5)  # what the server still takes in after the caller's status
        self._stop.set()
        self._thread.join()


def raw_call(channel: grpc.Channel, method: str, payload: bytes, metadata=None) -> grpc.StatusCode:
    """Send ``payload`` as the request of ``method`` (no serializer: bytes as they are); the status."""
    try:
        channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=30, metadata=metadata)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


# Each server: its script, its address, a method, and a normal request of that method.
SERVERS = {
    "data host": (DATA_HOST, "127.0.79.2", f"/{SERVICE}/Describe", b""),
    "ReportFailure server": (FAILURE_REPORTS, "127.0.79.3", "/heterogeneous_training.data_service.JobControl/ReportFailure",
                             pb.FailureReport(host="algo-1", reason="test").SerializeToString()),
}


@pytest.mark.parametrize("server", list(SERVERS))
def test_unauthenticated_large_requests_are_refused_before_the_server_holds_them(server: str, images: Path) -> None:
    script, address, method, ask = SERVERS[server]
    with server_process(script, address, str(images)) as (target, process), grpc.insecure_channel(target) as channel:
        assert raw_call(channel, method, ask, call_metadata(TOKEN)) == grpc.StatusCode.OK  # warmed up: threads, buffers
        before = process.memory_info().rss
        with PeakRss(process) as memory:
            statuses = [raw_call(channel, method, bytes(LARGE), metadata) for metadata in (None, call_metadata("not-the-job-token-at-all"))]
        assert set(statuses) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, statuses
        # 96 MiB were sent; the server took in at most what flow control let through before it refused:
        # under half of one request (a server that held a whole one would grow by 48 MiB or more; the
        # buffers flow control lets fill grew up to 15 MiB on a loaded 2-core machine).
        grew = memory.peak - before
        assert grew < LARGE // 2, f"{server} grew by {grew / 2**20:.0f} MiB receiving 2 × {LARGE >> 20} MiB unauthenticated"
        # The job's token does not lift the limit; and a normal call still works.
        assert raw_call(channel, method, bytes(MAX_REQUEST_BYTES + 1), call_metadata(TOKEN)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raw_call(channel, method, ask, call_metadata(TOKEN)) == grpc.StatusCode.OK


def test_the_request_limit_holds_every_request_our_clients_send() -> None:
    largest = pb.FailureReport(host="x" * 255, reason="é" * 1024)  # report_failure cuts a reason at 1024 characters
    assert 16 * largest.ByteSize() < MAX_REQUEST_BYTES
    assert pb.StreamRequest(client_id="algo-64/rank7" * 20, batch_size=2**32 - 1, max_batches=2**64 - 1).ByteSize() < MAX_REQUEST_BYTES


def vision_info(image_size: int, **fields) -> pb.DatasetInfo:
    """What a data host of the vision workload describes: its features at ``image_size``."""
    features = [pb.FeatureSpec(name="image", dtype="uint8", shape=[3, image_size, image_size]), pb.FeatureSpec(name="label", dtype="int64")]
    return pb.DatasetInfo(features=features, **fields)


def test_the_reply_limit_holds_the_largest_describe() -> None:
    # Every class name at its longest; the vision workload's features (a tf.data.service host's sample shape instead).
    info = vision_info(224, channel="train", classes=["c" * 255] * MAX_CLASSES, sample_shape=[3, 224, 224], host="algo-1")
    assert info.ByteSize() < MAX_REPLY_BYTES


@pytest.mark.parametrize(("batch_size", "image_size"), [(1, 1), (8, 32), (256, 224)])
def test_a_streams_receive_limit_holds_its_largest_batch(batch_size: int, image_size: int) -> None:
    """The vision workload's batches: every slot tagged twice (its sample, and a due one that was
    skipped) and positioned, every count at its widest."""
    spec = stream_spec(batch_size, vision_info(image_size, classes=["a"] * MAX_CLASSES))
    images = np.zeros((batch_size, 3, image_size, image_size), dtype=np.uint8)
    labels = np.full(batch_size, 2**63 - 1, dtype=np.int64)
    tags = np.full(2 * batch_size, 2**64 - 1, dtype=np.uint64)
    payload = codec.encode_features({"image": images, "label": labels}, 2**32 - 1, tags, np.full(2 * batch_size, 2**32 - 1, dtype=np.uint32),
                                    np.full(batch_size, 2**64 - 1, dtype=np.uint64))
    codec.check_batch(codec.decode_batch(payload), spec)
    assert len(payload) <= spec.max_message_bytes < len(payload) + 2048 + codec.END_REASON_BYTES
    assert ("grpc.max_receive_message_length", spec.max_message_bytes) in stream_options(spec.max_message_bytes)


def test_batches_no_grpc_message_can_carry_are_refused_by_name() -> None:
    from training.data_service.control import DataServiceRefusedError

    with pytest.raises(DataServiceRefusedError, match="more than one gRPC message can carry"):
        stream_spec(4096, vision_info(512))
    with pytest.raises(DataServiceRefusedError, match="describes feature 'image' of sample shape"):
        stream_spec(8, vision_info(0))
    with pytest.raises(DataServiceRefusedError, match="negative dimension"):
        stream_spec(8, vision_info(-1))
    with pytest.raises(DataServiceRefusedError, match="describes no features"):  # a tf.data.service host's, or an earlier release's
        stream_spec(8, pb.DatasetInfo(host="algo-1", sample_shape=[3, 32, 32]))


class FixedBatches:
    """A BatchSource of one pre-made batch, again and again (server.BatchSource)."""

    def __init__(self, payload: bytes) -> None:
        self.batches: queue.Queue = queue.Queue(maxsize=2)
        self.failure, self.serves_batches, self._stop = None, True, threading.Event()
        self._payload = payload

    def start(self) -> None:
        threading.Thread(target=self._fill, daemon=True).start()

    def begin(self, request: object, served: bool = False) -> None:
        """Serves the same from any position."""

    def _fill(self) -> None:
        while put_until_stopped(self.batches, ReadyBatch(self._payload), self._stop):
            pass

    def stop(self) -> None:
        self._stop.set()


def test_a_data_host_streams_batches_beyond_grpcs_default_and_its_own_request_limit() -> None:
    """The servers' small limit is on what they read: a real data host sends, and the real trainer client
    reads, batches of 128 × 3 × 128² (6 MiB: more than gRPC's 4 MiB default, 96 times the request limit)."""
    from training.data_service.client import DataServiceDataset
    from training.data_service.dataset import ImageDataset

    features = {"image": np.full((128, 3, 128, 128), 7, np.uint8), "label": np.ones(128, np.int64)}
    batch = codec.encode_features(features, 0, np.arange(128), np.zeros(128, int))
    assert len(batch) > max(4 << 20, 96 * MAX_REQUEST_BYTES)
    settings = ServerSettings(host="big", bind_address="127.0.79.4", port=free_port(), channel="train", batch_size=128,
                              shutdown_token=TOKEN, idle_timeout_s=30, start_deadline_s=30, workers=1, stop_grace_s=0,
                              features=(codec.FeatureSpec("image", "uint8", (3, 128, 128)), codec.FeatureSpec("label", "int64")))
    folder = ImageDataset(Path("."), ("a", "b"), (("unused", 0),))
    stop, result = threading.Event(), {}
    host = threading.Thread(target=lambda: result.setdefault("reason", serve(settings, folder, stop, source=FixedBatches(batch))), daemon=True)
    host.start()
    try:
        dataset = DataServiceDataset([f"{settings.bind_address}:{settings.port}"], 128, TOKEN, "test")
        received = list(itertools.islice(iter(dataset), 3))
    finally:
        stop.set()
        host.join(20)
    assert len(received) == 3 and tuple(received[0]["image"].shape) == (128, 3, 128, 128) and int(received[0]["image"][5, 1, 2, 3]) == 7
    assert dataset.stats.lost_hosts == [] and result["reason"] == StopReason.SIGNAL


class FailingBatches(FixedBatches):
    """FixedBatches whose preprocessing fails, with a hook's error, after ``good`` batches."""

    def __init__(self, payload: bytes, good: int, failure: str) -> None:
        super().__init__(payload)
        self._good, self._failure = good, failure

    def _fill(self) -> None:
        for _ in range(self._good):
            put_until_stopped(self.batches, ReadyBatch(self._payload), self._stop)
        while not self.batches.empty() and not self._stop.is_set():  # served, as far as this host can tell
            time.sleep(0.01)
        self.failure = self._failure


def test_a_trainer_fed_by_a_host_whose_preprocessing_failed_fails_naming_the_cause() -> None:
    """The stream's end carries the host's failure: the trainer's error names the user's hook and sample
    by itself (the failure report to its launcher comes only after the host has stopped serving)."""
    from training.data_service.client import DataServiceDataset
    from training.data_service.control import DataServiceUnavailableError
    from training.data_service.dataset import ImageDataset
    from training.data_service.server import DataHostError

    features = {"image": np.zeros((4, 3, 8, 8), np.uint8), "label": np.zeros(4, np.int64)}
    cause = "preprocessing stopped: HookError: preprocess raised ValueError at workload.py:9 on sample 37 (37): a broken record"
    settings = ServerSettings(host="failing", bind_address="127.0.79.5", port=free_port(), channel="train", batch_size=4,
                              shutdown_token=TOKEN, idle_timeout_s=30, start_deadline_s=30, workers=1, stop_grace_s=0,
                              features=(codec.FeatureSpec("image", "uint8", (3, 8, 8)), codec.FeatureSpec("label", "int64")))
    source = FailingBatches(codec.encode_features(features, 0, np.arange(4), np.zeros(4, int)), good=2, failure=cause)
    errors: list[BaseException] = []

    def host() -> None:
        try:
            serve(settings, ImageDataset(Path("."), ("a",), (("unused", 0),)), threading.Event(), source=source)
        except BaseException as error:  # noqa: BLE001 — the test reads what the host raised
            errors.append(error)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    dataset = DataServiceDataset([f"{settings.bind_address}:{settings.port}"], 4, TOKEN, "test", reconnect_timeout_s=1)
    received = []
    with pytest.raises(DataServiceUnavailableError, match=r"end of stream \(preprocessing failed: preprocessing stopped: HookError: preprocess raised ValueError .* on sample 37"):
        received.extend(iter(dataset))
    thread.join(20)
    assert len(received) == 2
    assert len(errors) == 1 and isinstance(errors[0], DataHostError) and str(errors[0]) == cause


def test_the_longest_end_of_stream_reason_fits_the_smallest_batchs_receive_limit() -> None:
    """A failure's reason in any script (3 bytes a character here) is cut to what the trainer reads."""
    from training.data_service.server import StopReason, end_reason

    spec = codec.BatchSpec(1, (codec.FeatureSpec("x", "int8"),))
    reason = end_reason(StopReason.FAILED, "preprocess raised ValueError: " + "漢" * 2000)
    assert len(reason.encode()) <= codec.END_REASON_BYTES and reason.startswith("preprocessing failed: preprocess raised")
    assert len(codec.end_of_stream(reason)) <= spec.max_message_bytes
