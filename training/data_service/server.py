"""The data host: makes its channel's batches in worker processes (a workload's preprocess:
training/workload/serving.py) and streams them to every DNN process over gRPC; or, for the tensorflow
variant, answers the control calls (Describe, keep-alive, Shutdown) while tf.data.service sends its
batches (training/data_service/tf_service.py).

Worker processes are sized to the host's CPUs (its CPU affinity, which the emulated cluster sets per
host). Finished batches wait in a bounded queue: when the trainers fall behind, the workers stop, so
memory stays flat. The host stops, and its process exits, on the first of:

* a Shutdown RPC from the DNN hosts;
* an idle timeout: clients came, then neither took a batch nor sent a keep-alive for ``idle_timeout_s``
  (the DNN hosts are gone, or hung with their launchers: an open stream alone does not count);
* a start deadline: no client came at all (the DNN group never started);
* SIGTERM (SageMaker stopping the job), after ``stop_grace_s``: StopTrainingJob and spot interruptions
  signal every instance at once, and the DNN hosts need batches until their trainers reach the step at
  which they save; they send Shutdown when done, which usually comes first.

Every call must carry the job's token (training/data_service/auth.py). A host that cannot serve raises
PortInUseError (its port is taken) or DataHostError (its batches cannot be made); the launcher writes
the reason to the failure file and reports it to the DNN hosts.

Run through the launcher; ``serve`` is the entry point.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from training.data_service import codec
from training.data_service import data_service_pb2 as pb
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.auth import TokenAuth
from training.data_service.dataset import ImageDataset, channel_epoch_order, listing_digest, shard_stream_order
from training.data_service.epochs import SPARE_EPOCH
from training.data_service.positions import Position, from_message, serve_positions

log = logging.getLogger(__name__)

# The most a server of ours (a data host's, a DNN host's ReportFailure) reads of any one message, from any
# caller, with the job's token or without: gRPC reads a unary request whole before its handler runs (a
# call without the token is refused before its request is read at all: auth.TokenAuth). Requests are small:
# the largest is a FailureReport (a host name, and a reason cut at 1024 characters: at most 4 KiB of
# UTF-8); a StreamRequest holds a client id ("algo-3/rank0"), two integers and a resumed job's position
# (positions.MAX_GAP_RANGES pairs of varints at most: 20 KiB); DescribeRequest is empty. 64 KiB leaves
# room; it was 1 GiB, and two unauthenticated 512 MiB requests took a data host from 60 MiB to 2.1 GB.
# What servers send (batches) keeps gRPC's default: no send limit. The trainer bounds what it receives by
# the batch it asked for (codec.BatchSpec.max_message_bytes).
MAX_REQUEST_BYTES = 64 << 10
# Clients ping every KEEPALIVE_TIME_MS to notice a host that hangs (a stopped process keeps its TCP
# connections open, and a stream with no deadline would wait for ever); the server must accept pings at
# that rate, also while no data flows, or it answers them with GOAWAY ("too_many_pings").
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would then bind too and share
    # its connections. A data host must find out that its port is taken.
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


# end_reason of a stream that sent the max_batches the client asked for.
MAX_BATCHES = "max_batches"


class DataHostError(RuntimeError):
    """This data host cannot serve: the reason goes to the failure file and to the DNN hosts."""


class PortInUseError(RuntimeError):
    """Another process holds a port this host must listen on."""


class DataPositionConflict(ValueError):
    """A stream asks this host to start where it did not: its first stream fixed where it starts."""


class StopReason(enum.Enum):
    SHUTDOWN = "shutdown"
    IDLE = "idle timeout"
    START_DEADLINE = "start deadline"
    SIGNAL = "signal"
    FAILED = "preprocessing failed"

    @property
    def exit_code(self) -> int:
        # Exiting after an idle timeout is how a data host outlives a finished or dead trainer without
        # billing: not an error of its own. No client ever coming, or broken data, is.
        return {StopReason.START_DEADLINE: 3, StopReason.FAILED: 4}.get(self, 0)


@dataclass(frozen=True)
class ServerSettings:
    host: str
    bind_address: str
    port: int
    channel: str
    batch_size: int
    shutdown_token: str
    idle_timeout_s: float
    start_deadline_s: float
    workers: int
    seed: int = 0  # the job's, the same on every data host
    # Finished batches waiting for a client; with `workers` more in flight.
    queue_depth: int = 8
    # The data hosts that share the channel's epochs (sample_order), and whether each holds its own shard.
    hosts: int = 1
    sharded: bool = False
    # After SIGTERM, serve on this long at most (SageMaker sends SIGKILL 120 s after its SIGTERM).
    stop_grace_s: float = 110.0
    # The workload's batches (codec.encode_features): what Describe announces in DatasetInfo.features, and
    # what the trainers then check every batch against. Empty where tf.data.service sends the batches.
    features: tuple[codec.FeatureSpec, ...] = ()
    # tf.data.service's batches (channels, height, width), for the tensorflow trainer's check; empty on a
    # workload's host, whose features say what its batches hold.
    sample_shape: tuple[int, ...] = ()


@dataclass
class Activity:
    """What the lifecycle decision needs to know, updated by the RPC handlers: when a client (with the
    job's token) last took a batch or sent a keep-alive, and whether any ever came."""

    started_at: float
    last_activity: float
    clients_seen: int = 0


@dataclass(frozen=True)
class ReadyBatch:
    """A finished batch, serialised for the wire, and the undecodable files replaced while making it."""

    payload: bytes
    skipped: int = 0


def put_until_stopped(target: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put into a bounded queue, waiting while it is full, but give up as soon as ``stop`` is set (a
    plain blocking put would keep a stopping thread alive for ever). True if the item went in."""
    while not stop.is_set():
        try:
            target.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def stop_verdict(activity: Activity, now: float, idle_timeout_s: float, start_deadline_s: float) -> StopReason | None:
    """Should the host stop on its own? Pure, so the rules are tested without servers."""
    if activity.clients_seen == 0:
        return StopReason.START_DEADLINE if now - activity.started_at > start_deadline_s else None
    if now - activity.last_activity > idle_timeout_s:
        return StopReason.IDLE
    return None


def sample_order(
    num_samples: int, seed: int, host_index: int, hosts: int = 1, sharded: bool = False, shard_ends: Sequence[int] = ()
) -> Iterator[int]:
    """An endless stream of sample indices, one epoch after another: the sample at each position of this
    host's order from position 0 (HostOrder's, as a fresh job's producer serves them)."""
    check_share(num_samples, hosts, sharded)
    return map(HostOrder(num_samples, seed, host_index, hosts, sharded, shard_ends).sample_at, itertools.count())


def check_share(num_samples: int, hosts: int, sharded: bool) -> None:
    """Refuse a replicated channel with fewer samples than data hosts: each needs one per epoch."""
    if not sharded and num_samples < hosts:  # checked before any order is drawn: an empty share would spin forever
        raise DataHostError(f"the channel holds {num_samples} samples, fewer than its {hosts} data hosts: each needs at "
                            "least one per epoch (fewer data hosts, or more data)")


def epoch_share(num_samples: int, host_index: int, hosts: int = 1, sharded: bool = False) -> int:
    """How many of sample_order's indices make one of this host's epochs. Pure."""
    return num_samples if sharded else len(range(host_index, num_samples, hosts))


def epoch_order(num_samples: int, seed: int, host_index: int, epoch: int, hosts: int = 1, sharded: bool = False,
                shard_ends: Sequence[int] = ()) -> list[int]:
    """This host's samples of one epoch, in its order: epoch_share of them. Pure (the run's seed and the
    epoch fix it, so a resumed job's host draws the very order the first job's drew).

    A replicated channel (every data host holds every file): the hosts draw one order per epoch together
    (the seed is the run's, the same on every host) and host ``host_index`` of ``hosts`` takes every
    hosts-th index of it, so that across the hosts every sample goes out exactly once per epoch.
    A sharded channel (each host holds its own ~1/n of the files): each host serves all of its own
    files, in an order of its own. An epoch's order is a permutation, or for tar shards (``shard_ends``)
    the shards in a shuffled order, each read through, mixed by a shuffle buffer (shard_stream_order).
    """
    if not sharded:  # the channel's order, as a homogeneous run's ranks draw it: a host takes its share
        return channel_epoch_order(num_samples, seed, epoch, shard_ends)[host_index::hosts]
    rng = np.random.default_rng([seed, host_index, epoch])
    return shard_stream_order(tuple(shard_ends), rng) if shard_ends else rng.permutation(num_samples).tolist()


class HostOrder:
    """A host's endless order, by position: position p is the (p mod share)-th sample of its epoch
    p div share (epoch_order). Keeps the orders of the last two epochs read, as arrays: a resumed host's
    gaps may lie in an earlier epoch than the positions after them."""

    def __init__(self, num_samples: int, seed: int, host_index: int, hosts: int = 1, sharded: bool = False,
                 shard_ends: Sequence[int] = ()) -> None:
        self._args = (num_samples, seed, host_index)
        self._hosts, self._sharded, self._shard_ends = hosts, sharded, tuple(shard_ends)
        self.share = epoch_share(num_samples, host_index, hosts, sharded)
        self._orders: dict[int, np.ndarray] = {}

    def epoch_of(self, position: int) -> int:
        return position // self.share

    def sample_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.share)
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = np.asarray(epoch_order(*self._args, epoch, self._hosts, self._sharded, self._shard_ends), dtype=np.int64)
        return int(self._orders[epoch][offset])


class BatchSource(Protocol):
    """Where a data host's finished batches come from (the producer below; a benchmark's fixed batches;
    tf.data.service, whose batches go to the trainers without passing through this server)."""

    # Serialised Batch messages (codec.encode_features), ready for the wire.
    batches: queue.Queue[ReadyBatch]
    failure: str | None
    # False when the batches bypass this server, which then cannot count what it served.
    serves_batches: bool

    def start(self) -> None: ...

    def begin(self, request: pb.StreamRequest, served: bool) -> None:
        """Called with each unbounded stream's request before it takes a batch: the first fixes where the
        batches start (a resumed job's position; ``served``: bounded reads took batches before it, which
        the job's stream must not miss); a later one asking for another raises DataPositionConflict."""

    def stop(self) -> None: ...


@dataclass(frozen=True)
class WorkerSetup:
    """What a producer's worker processes run: ``initializer(*initargs)`` once in each, then per batch
    ``make_batch(indices, spares, seed, epochs, positions) -> (payload, skipped)``, the wire bytes made
    there, off the gRPC process's CPU. Module-level functions: the spawned workers import them by name."""

    initializer: Callable[..., None]
    initargs: tuple[object, ...]
    make_batch: Callable[[list[int], list[int], list[int], list[int], list[int]], tuple[bytes, int]]


class BatchProducer:
    """Keeps ``workers`` batches in flight on a process pool and finished ones in a bounded queue; what the
    workers run is ``setup``'s (a workload's: training/workload/serving.WorkloadBatchProducer).

    It starts making batches at once, from position 0 (a fresh job's start), so that the first trainer
    finds them ready. The first stream's request fixes where the batches start (``begin``): a resumed
    job's trainers ask for their checkpoint's position, and the producer then drops what it made and
    starts again there (training/data_service/positions.py)."""

    def __init__(
        self,
        folder: ImageDataset,
        setup: WorkerSetup,
        *,
        batch_size: int,
        workers: int,
        seed: int = 0,
        host_index: int = 0,
        queue_depth: int = 8,
        hosts: int = 1,
        sharded: bool = False,
    ) -> None:
        self._folder = folder
        check_share(len(folder), hosts, sharded)  # before any worker starts
        self._hosts, self._sharded = hosts, sharded
        self.share = epoch_share(len(folder), host_index, hosts, sharded)
        self._batch_size = batch_size
        self._workers = workers
        self._seed = seed
        self._host_index = host_index
        self._start = Position()
        self._begun: Position | None = None  # fixed by the first stream's request
        self._begin_lock = threading.Lock()
        self.batches: queue.Queue[ReadyBatch] = queue.Queue(maxsize=queue_depth)
        self.failure: str | None = None
        self.skipped_samples = 0  # in every batch made, served or not (the log's running count)
        self.serves_batches = True
        self._stop = threading.Event()
        self._generation = threading.Event()  # set to end the current thread's run (stop, or a new start)
        self._make_batch = setup.make_batch
        # spawn, not fork: this process runs gRPC threads, which do not survive a fork.
        self._pool = futures.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=setup.initializer,
            initargs=setup.initargs,
        )
        self._thread: threading.Thread | None = None  # started by start(), again by a begin() that moves the start

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._start, self._generation), name="batch-producer", daemon=True)
        self._thread.start()

    def begin(self, request: pb.StreamRequest, served: bool = False) -> None:
        try:
            start = from_message(request.resume, self.share) if request.HasField("resume") else Position()
        except ValueError as error:
            raise DataPositionConflict(f"a resume position that does not read: {error}") from None
        with self._begin_lock:
            if self._begun is not None:
                if start != self._begun:
                    raise DataPositionConflict(f"this host's stream starts at {self._begun}, as its first stream asked; "
                                               f"this stream asks for {start}")
                return
            self._begun = start
            if start == self._start and not served:
                return
            log.info("resuming: serving %d untrained positions of earlier epochs, then from position %d (epoch %d)",
                     sum(end - begin for begin, end in start.gaps), start.next, start.next // self.share)
            # What was made from position 0 is not what this job trains: drop it and start there.
            running = self._thread
            self._generation.set()
            if running is not None:
                running.join(timeout=30)
            while True:
                try:
                    self.batches.get_nowait()
                except queue.Empty:
                    break
            self._start, self._generation = start, threading.Event()
            if running is not None and not self._stop.is_set():
                self.start()

    def stop(self) -> None:
        self._stop.set()
        self._generation.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        # CPython keeps the pool's worker processes here; shutdown(wait=False) does not end a worker that
        # is blocked handing a large batch to a reader that stopped reading, which would outlive this
        # process (and hold its stdout open). End them explicitly.
        workers = list(getattr(self._pool, "_processes", {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.join(timeout=2)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=2)

    def _tasks(self, start: Position) -> Iterator[tuple[list[int], list[int], list[int], list[int], list[int]]]:
        """Per batch: its due samples, spares, seed, each slot's epoch and position, from ``start`` on."""
        batch_size = self._batch_size
        positions = serve_positions(start)
        order = HostOrder(len(self._folder), self._seed, self._host_index, self._hosts, self._sharded, self._folder.shard_ends)
        while True:
            batch = list(itertools.islice(positions, batch_size))
            indices = [order.sample_at(position) for position in batch]
            # Drawn from the batch's first position: a resumed job's spares for a position are the first job's.
            spares = np.random.default_rng([self._seed, self._host_index, 1 << 20, batch[0]]).integers(0, len(self._folder), size=batch_size).tolist()
            # The epoch of each slot (trainers count epochs by it) and its position (trainers record it as trained).
            yield indices, spares, [self._seed, self._host_index, batch[0]], [order.epoch_of(position) for position in batch], batch

    def _run(self, start: Position, generation: threading.Event) -> None:
        in_flight: collections.deque[futures.Future] = collections.deque()
        tasks = self._tasks(start)
        make = self._make_batch
        try:
            while not generation.is_set():
                while len(in_flight) < self._workers:
                    in_flight.append(self._pool.submit(make, *next(tasks)))
                payload, skipped = in_flight.popleft().result()
                if generation.is_set():
                    break
                self.skipped_samples += skipped
                if skipped:
                    log.warning("skipped %d undecodable files (%d so far)", skipped, self.skipped_samples)
                put_until_stopped(self.batches, ReadyBatch(payload, skipped), generation)
        except (futures.BrokenExecutor, RuntimeError) as error:
            # RuntimeError: the pool was shut down under us while stopping.
            if not generation.is_set():
                self.failure = f"preprocessing workers failed: {error}"
        except Exception as error:  # noqa: BLE001 — any other error must stop the host by name: a producer
            # thread that died quietly would leave the host serving nothing until its idle timeout.
            self.failure = f"preprocessing stopped: {type(error).__name__}: {error}"


def slot_tags(indices: list[int], spares: list[int], epochs: list[int], slots: list[int], failed: list[int]) -> tuple[list[int], list[int]]:
    """Batch.sample_ids and Batch.epochs: the sample in each slot with the epoch whose turn it was (a
    spare: SPARE_EPOCH), then the due samples that did not decode, with their epochs. Pure."""
    candidates = indices + spares
    due = len(indices)
    tagged = slots + [position for position in failed if position < due]
    return ([candidates[position] for position in tagged],
            [epochs[position] if position < due else SPARE_EPOCH for position in tagged])


class DataServiceServicer(pb_grpc.DataServiceServicer):
    def __init__(self, settings: ServerSettings, folder: ImageDataset, producer: BatchSource) -> None:
        self._settings = settings
        self._folder = folder
        self._producer = producer
        self._lock = threading.Lock()
        now = time.monotonic()
        self.activity = Activity(started_at=now, last_activity=now)
        self.shutdown_requested = threading.Event()
        # Set once the host is stopping, for whatever reason; open streams end with it, and with
        # ``stopping_detail`` (why preprocessing failed) so that a trainer fails naming the cause itself:
        # the failure report to its launcher comes only after this server has stopped.
        self.stopping: StopReason | None = None
        self.stopping_detail = ""
        self.batches_served = 0
        self.skipped_served = 0  # undecodable files replaced in the batches that went out
        self._begin_lock = threading.Lock()
        self._listing_digest = listing_digest(folder)

    def _touch(self, new_client: bool = False) -> None:
        with self._lock:
            self.activity.last_activity = time.monotonic()
            self.activity.clients_seen += int(new_client)

    def stop_verdict(self, idle_timeout_s: float, start_deadline_s: float) -> StopReason | None:
        with self._lock:
            return stop_verdict(self.activity, time.monotonic(), idle_timeout_s, start_deadline_s)

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DatasetInfo:
        self._touch(new_client=True)
        return pb.DatasetInfo(
            channel=self._settings.channel,
            num_samples=len(self._folder),
            classes=list(self._folder.classes),
            sample_shape=list(self._settings.sample_shape),
            batch_size=self._settings.batch_size,
            host=self._settings.host,
            workers=self._settings.workers,
            sharded=self._settings.sharded,
            labels_are_indices=bool(self._folder.shard_ends),
            features=[pb.FeatureSpec(name=feature.name, dtype=feature.dtype, shape=list(feature.shape)) for feature in self._settings.features],
            listing_digest=self._listing_digest,
        )

    def StreamBatches(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Yields serialised Batch messages; add_to_server registers this method without a serializer."""
        if request.batch_size != self._settings.batch_size:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"client asks for batches of {request.batch_size}, this data host makes {self._settings.batch_size}",
            )
        self._touch(new_client=True)  # before a begin that may take a while: the host is not idle
        # A bounded read (max_batches: a Neuron pre-compile's few steps, a benchmark's) does not fix where
        # the job's stream starts, and what it took is served again to the stream that does (a source
        # whose start is fixed already ignores ``served``). One begin at a time: the first decides, and no
        # stream reads before it has.
        if not request.max_batches:
            with self._begin_lock:
                try:
                    self._producer.begin(request, self.batches_served > 0)
                except DataPositionConflict as error:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        log.info("client %s connected", request.client_id or context.peer())
        sent = 0
        try:
            while context.is_active():
                if self.stopping is not None:
                    yield codec.end_of_stream(end_reason(self.stopping, self.stopping_detail))
                    return
                try:
                    batch = self._producer.batches.get(timeout=0.2)
                except queue.Empty:
                    continue
                yield batch.payload
                sent += 1
                self._touch()
                with self._lock:
                    self.batches_served += 1
                    self.skipped_served += batch.skipped
                if request.max_batches and sent >= request.max_batches:
                    yield codec.end_of_stream(MAX_BATCHES)
                    return
        finally:
            log.info("client %s left after %d batches", request.client_id or context.peer(), sent)

    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownReply:
        log.info("shutdown requested by %s", request.requester or context.peer())
        self.shutdown_requested.set()
        return pb.ShutdownReply(host=self._settings.host, batches_served=self.batches_served)


# Threads of a data host's gRPC server, created as needed: one per open stream (64 DNN hosts × 8 trainer
# processes) plus the control calls.
STREAM_THREADS = 544

SERVICE = pb.DESCRIPTOR.services_by_name["DataService"].full_name
STREAM_BATCHES = f"/{SERVICE}/StreamBatches"


def add_to_server(servicer: DataServiceServicer, server: grpc.Server) -> None:
    """Register the service as the generated code would, except that StreamBatches sends bytes that
    are already a serialised Batch (made in the worker processes) instead of serialising again."""
    handlers = {
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe, request_deserializer=pb.DescribeRequest.FromString, response_serializer=pb.DatasetInfo.SerializeToString
        ),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches, request_deserializer=pb.StreamRequest.FromString, response_serializer=None
        ),
        "Shutdown": grpc.unary_unary_rpc_method_handler(
            servicer.Shutdown, request_deserializer=pb.ShutdownRequest.FromString, response_serializer=pb.ShutdownReply.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def default_workers() -> int:
    """One preprocessing process per CPU this host may use; the gRPC threads mostly wait on I/O."""
    return max(1, len(os.sched_getaffinity(0)))


def serve(settings: ServerSettings, folder: ImageDataset, stop_signal: threading.Event, source: BatchSource) -> StopReason:
    """Run the data service until it should stop; return why. ``source`` makes the batches (a workload's
    WorkloadBatchProducer; tf.data.service; a benchmark's fixed batches), ``folder`` is what Describe tells."""
    servicer = DataServiceServicer(settings, folder, source)
    server = grpc.server(
        # One thread per open stream (every trainer process of every DNN host holds one), plus the
        # control calls: a stream beyond the pool would wait for a thread and never get a batch.
        futures.ThreadPoolExecutor(max_workers=STREAM_THREADS, thread_name_prefix="data-service"),
        options=SERVER_OPTIONS,
        interceptors=[TokenAuth(settings.shutdown_token)],
    )
    add_to_server(servicer, server)
    target = f"{settings.bind_address}:{settings.port}"
    bind_port(server, target)
    source.start()
    server.start()
    log.info(
        "data host %s serving channel %r (%d samples %s, %d classes) on %s with %d workers, batch %d",
        settings.host, settings.channel, len(folder), folder.described(), len(folder.classes), target, settings.workers, settings.batch_size,
    )
    reason = None
    signalled_at: float | None = None
    while reason is None:
        if stop_signal.is_set() and signalled_at is None:
            signalled_at = time.monotonic()
            log.info("SIGTERM: serving on until the DNN hosts are done, %.0f s at most", settings.stop_grace_s)
        if servicer.shutdown_requested.wait(timeout=0.25):
            reason = StopReason.SHUTDOWN
        elif signalled_at is not None and time.monotonic() - signalled_at >= settings.stop_grace_s:
            reason = StopReason.SIGNAL
        elif source.failure:
            log.error("%s", source.failure)
            reason = StopReason.FAILED
        else:
            reason = servicer.stop_verdict(settings.idle_timeout_s, settings.start_deadline_s)
    servicer.stopping_detail = (source.failure or "") if reason is StopReason.FAILED else ""
    servicer.stopping = reason
    # Give open streams a moment to send their end-of-stream marker, then stop everything.
    server.stop(grace=2.0).wait(timeout=5)
    source.stop()
    if source.serves_batches:
        log.info(
            "data host %s stopping (%s) after serving %d batches (%d undecodable files replaced in them)",
            settings.host, reason.value, servicer.batches_served, servicer.skipped_served,
        )
    else:  # tf.data.service: the batches went from its workers straight to the trainers
        log.info("data host %s stopping (%s); its batches went through tf.data.service", settings.host, reason.value)
    if reason is StopReason.FAILED:
        raise DataHostError(source.failure or "preprocessing failed")
    return reason


def end_reason(reason: StopReason, detail: str) -> str:
    """A stream's end-of-stream reason: the stop's name, with its cause when there is one, cut to
    codec.END_REASON_BYTES of UTF-8 (the trainer's receive limit leaves room for that much). Pure."""
    text = f"{reason.value}: {detail}" if detail else reason.value
    return text.encode()[: codec.END_REASON_BYTES].decode(errors="ignore")


def bind_port(server: grpc.Server, target: str) -> None:
    """Listen on ``target`` or raise PortInUseError (grpcio returns 0 or raises, by release)."""
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PortInUseError(f"cannot listen on {target}: another process on this host holds the port")
