"""Transport: our gRPC data path, tf.data.service and a raw TCP socket on loopback, the same batches, one run.

    python bench/transport.py [--batches 300] [--rounds 3]

Every server runs in a process pinned to one CPU and sends the same pre-made uint8 batches (no
preprocessing: this times the wire alone); the client, pinned to another CPU, takes every batch as its
trainer does. The gRPC side is the real DataService server and DataServiceDataset client (torch tensors),
its batches the built-in vision workload's ({"image": uint8 [B, 3, S, S], "label": int64 [B]}, written by
codec.encode_features as its data hosts' workers write them, and announced by Describe as they announce them);
the tf.data.service side is a real dispatcher and worker serving the batches as a registered dataset,
registered and read as the tensorflow variant's job does (training/data_service/tf_pipeline.py:
uncompressed, dynamic sharding, one shared job; a reader that comes before the registration waits for
it); the socket side sends a small JSON header (dtype, shape) and the
raw bytes, and its client has the same structure as ours (a reader thread, a bounded queue to the
trainer). Rounds are interleaved; reports MB/s of each, the ratios to the socket (goal for ours ≥ 0.8)
and between the two services, and the bytes per sample on our wire against the uint8 sample.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.data_service import codec  # noqa: E402
from training.data_service import data_service_pb2 as pb  # noqa: E402
from training.data_service.client import DataServiceDataset  # noqa: E402
from training.data_service.dataset import ImageDataset  # noqa: E402
from training.data_service.server import ReadyBatch, ServerSettings, put_until_stopped, serve  # noqa: E402
from training.local.cluster import free_port  # noqa: E402

TOKEN = "transport-benchmark-token"
HEADER = struct.Struct("!I")


def vision_features(size: int) -> tuple[codec.FeatureSpec, ...]:
    """What the vision workload's data hosts announce (training/workloads/vision.py's preprocess). Pure."""
    return (codec.FeatureSpec("image", "uint8", (3, size, size)), codec.FeatureSpec("label", "int64"))


def encode(images: np.ndarray, labels: np.ndarray) -> bytes:
    """One batch as the vision workload's data host sends it (slot tags left out: there are no epochs here)."""
    return codec.encode_features({"image": images, "label": labels})


def make_batches(batch_size: int, size: int, count: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.integers(0, 256, (batch_size, 3, size, size), dtype=np.uint8), rng.integers(0, 1000, batch_size, dtype=np.int64))
        for _ in range(count)
    ]


class FixedBatches:
    """A BatchSource that cycles through pre-made batches, serialised once as the worker processes do."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.batches: queue.Queue = queue.Queue(maxsize=8)
        self.failure = None
        self.serves_batches = True
        self._source = [ReadyBatch(encode(images, labels)) for images, labels in batches]
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._fill, daemon=True).start()

    def begin(self, request: object, served: bool = False) -> None:
        """The same batches from any position: a benchmark's stream resumes nothing."""

    def _fill(self) -> None:
        for payload in itertools.cycle(self._source):
            if not put_until_stopped(self.batches, payload, self._stop):
                return

    def stop(self) -> None:
        self._stop.set()


def grpc_server(address: str, port: int, batch_size: int, size: int, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    settings = ServerSettings(
        host="bench", bind_address=address, port=port, channel="bench", batch_size=batch_size,
        shutdown_token=TOKEN, idle_timeout_s=5, start_deadline_s=60, workers=1, features=vision_features(size),
    )
    # As many classes as make_batches draws labels from (what Describe tells the trainer's model).
    folder = ImageDataset(Path("."), tuple(map(str, range(1000))), (("bench", 0),))
    serve(settings, folder, threading.Event(), source=FixedBatches(make_batches(batch_size, size)))


def socket_server(address: str, port: int, batch_size: int, size: int, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    batches = make_batches(batch_size, size)
    with socket.create_server((address, port)) as listener:
        connection, _ = listener.accept()
        with connection:
            try:
                for images, labels in itertools.cycle(batches):
                    header = json.dumps({"images": [images.dtype.name, images.shape], "labels": [labels.dtype.name, labels.shape]}).encode()
                    connection.sendall(HEADER.pack(len(header)) + header)
                    connection.sendall(images.data)
                    connection.sendall(labels.data)
            except (BrokenPipeError, ConnectionResetError):
                return


def tf_data_server(address: str, port: int, batch_size: int, size: int, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    from training.data_service.tf_pipeline import register

    service = tf.data.experimental.service
    # Held until the process ends: a collected server stops.
    _dispatcher = service.DispatchServer(service.DispatcherConfig(port=port))
    worker = service.WorkerServer(service.WorkerConfig(dispatcher_address=f"{address}:{port}", worker_address=f"{address}:%port%"))

    images, labels = zip(*make_batches(batch_size, size), strict=True)
    dataset = tf.data.Dataset.from_tensor_slices((np.stack(images), np.stack(labels))).repeat()
    register(f"{address}:{port}", dataset)  # as the job's dispatcher host registers its pipeline: uncompressed
    worker.join()


def tf_data_batches(address: str, port: int, batch_size: int, size: int, start_timeout_s: float = 120.0):
    """The registered batches read as the job's trainers read them: dynamic sharding, one shared job
    (tf_pipeline.read_from_service), once the server has registered them (a slow start is waited out)."""
    import tensorflow as tf

    from training.data_service.tf_pipeline import DATASET_ID, JOB_NAME

    spec = (tf.TensorSpec((batch_size, 3, size, size), tf.uint8), tf.TensorSpec((batch_size,), tf.int64))
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            dataset = tf.data.experimental.service.from_dataset_id(
                processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC, service=f"grpc://{address}:{port}",
                dataset_id=DATASET_ID, element_spec=spec, job_name=JOB_NAME,
            ).prefetch(4)  # as deep as the other clients' queues
            iterator = iter(dataset)
            first = next(iterator)
            break
        except (tf.errors.NotFoundError, tf.errors.UnavailableError, tf.errors.DeadlineExceededError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the dispatcher is not up, or has not registered the dataset yet
    yield first
    yield from iterator


def _receive_exactly(connection: socket.socket, count: int) -> bytearray:
    buffer = bytearray(count)
    view, received = memoryview(buffer), 0
    while received < count:
        chunk = connection.recv_into(view[received:])
        if chunk == 0:
            raise ConnectionError("server closed the connection")
        received += chunk
    return buffer


def socket_batches(address: str, port: int):
    """The socket client built like DataServiceDataset: a reader thread per host feeding a bounded queue
    that the trainer takes from, so that the two differ in their transport only."""
    merged: queue.Queue = queue.Queue(maxsize=4)

    def read() -> None:
        try:
            for images, labels in _read_socket(address, port):
                merged.put((images, labels))
        except ConnectionError:
            return  # the benchmark stopped the server

    threading.Thread(target=read, daemon=True).start()
    while True:
        images, labels = merged.get()
        yield torch.from_numpy(images), torch.from_numpy(labels)


def _read_socket(address: str, port: int):
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((address, port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with connection:
        while True:
            header = json.loads(_receive_exactly(connection, HEADER.unpack(_receive_exactly(connection, HEADER.size))[0]))
            tensors = []
            for name in ("images", "labels"):
                dtype, shape = np.dtype(header[name][0]), header[name][1]
                raw = _receive_exactly(connection, int(np.prod(shape)) * dtype.itemsize)
                tensors.append(np.frombuffer(raw, dtype=dtype).reshape(shape))
            yield tensors


def timed(batches, count: int, warmup: int = 20) -> float:
    """Batches per second over ``count`` batches after ``warmup``."""
    iterator = iter(batches)
    for _ in range(warmup):
        next(iterator)
    started = time.perf_counter()
    for _ in range(count):
        batch = next(iterator)
        images = batch["image"] if isinstance(batch, dict) else batch[0]  # ours: the workload's features by name
        assert images.dtype in (torch.uint8, "uint8") or images.dtype.name == "uint8"
    return count / (time.perf_counter() - started)


def measure(kind: str, batch_size: int, size: int, count: int, server_cpu: int) -> float:
    context = multiprocessing.get_context("spawn")
    address, port = "127.0.91.2", free_port()
    target = {"grpc": grpc_server, "tf.data": tf_data_server, "socket": socket_server}[kind]
    server = context.Process(target=target, args=(address, port, batch_size, size, server_cpu), daemon=True)
    server.start()
    try:
        if kind == "grpc":
            dataset = DataServiceDataset([f"{address}:{port}"], batch_size, TOKEN, "bench", connect_timeout_s=30)
            return timed(dataset, count)
        if kind == "tf.data":
            return timed(tf_data_batches(address, port, batch_size, size), count)
        return timed(socket_batches(address, port), count)
    finally:
        server.kill()
        server.join()


def median_rate(rounds: list[dict[str, float]], kind: str) -> float:
    return statistics.median(round_[kind] for round_ in rounds)


def median_ratio(rounds: list[dict[str, float]], top: str, bottom: str) -> float:
    return statistics.median(round_[top] / round_[bottom] for round_ in rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = cpus[0], cpus[-1]
    os.sched_setaffinity(0, {client_cpu})
    torch.set_num_threads(1)
    print(f"client on CPU {client_cpu}, servers on CPU {server_cpu}; {args.rounds} rounds of {args.batches} batches, interleaved")
    print("each side as the job runs it: gRPC = the data host's server and DataServiceDataset, batches written by "
          "codec.encode_features; tf.data = one dispatcher + worker, registered uncompressed and read with dynamic "
          "sharding as tf_pipeline.register/read_from_service do; socket = a bare TCP stream (the floor)")
    print(
        f"{'batch':<22} {'sample bytes':>12} {'wire bytes/sample':>18} {'gRPC MB/s':>10} {'tf.data MB/s':>13} {'socket MB/s':>12} "
        f"{'gRPC/socket':>12} {'tf.data/socket':>15} {'gRPC/tf.data':>13}"
    )
    for batch_size, size in ((32, 64), (32, 224)):
        images, labels = make_batches(batch_size, size, count=1)[0]
        message = pb.Batch.FromString(encode(images, labels))
        sample_bytes = images[0].nbytes
        rounds = []
        for _ in range(args.rounds):
            count = args.batches if size < 128 else args.batches // 4
            rounds.append({kind: measure(kind, batch_size, size, count, server_cpu) for kind in ("grpc", "tf.data", "socket")})

        megabytes = images.nbytes / 1e6
        print(
            f"{f'{batch_size} × 3 × {size} × {size}':<22} {sample_bytes:>12} {message.ByteSize() / batch_size:>18.1f} "
            f"{median_rate(rounds, 'grpc') * megabytes:>10.0f} {median_rate(rounds, 'tf.data') * megabytes:>13.0f} {median_rate(rounds, 'socket') * megabytes:>12.0f} "
            f"{median_ratio(rounds, 'grpc', 'socket'):>12.2f} {median_ratio(rounds, 'tf.data', 'socket'):>15.2f} {median_ratio(rounds, 'grpc', 'tf.data'):>13.2f}",
            flush=True,
        )
        spread = [round_["grpc"] / round_["tf.data"] for round_ in rounds]
        print(f"{'':<22} gRPC/tf.data per round: {', '.join(f'{ratio:.2f}' for ratio in spread)} (median above)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
