"""The DNN side of the data service: one IterableDataset that merges the batch streams of every data host.

One thread per data host holds a StreamBatches call open and puts decoded batches into a bounded queue;
iterating the dataset takes them in arrival order, so a slow host never stalls a fast one. Hosts may come
up after the trainer: connecting is retried until ``connect_timeout_s``. A host that dies mid-run is
retried for ``reconnect_timeout_s`` and then dropped; training carries on with the others, and only when
no host is left does iteration fail, with DataServiceUnavailableError naming every host and why.

Nothing a host sends is trusted. Each connection first asks the host's Describe what its batches are (the
workload's named features, DatasetInfo.features): the stream then reads no message larger than such a
batch, and one that is not such a batch (a feature missing, extra or misnamed, a wrong dtype, shape or
count, bytes that do not read: codec's check_batch) reaches no trainer; the host is dropped at once, as
lost, with MalformedBatchError and what was expected and seen.

A host that hangs (a stopped process keeps its connections open) is noticed two ways: a stream that
brings no batch for ``batch_timeout_s`` while this side waits for one is cancelled, and, as a backstop,
gRPC keep-alive pings that go unanswered break the connection (measured here: within about a minute,
gRPC's own limits on ping rates included). Either way the host is retried, then dropped, like a dead one.

    dataset = DataServiceDataset(["10.0.0.5:6000", "10.0.0.6:6000"], batch_size=256, token=token, client_id="algo-3/rank0")
    for batch in dataset: ...  # the vision workload's: {"image": uint8 [256, 3, S, S], "label": int64 [256]}

The dataset yields one dict of tensors per batch, {name: [B, *sample shape]}, in the order of
``dataset.features`` (those the trainer passed, or else those the first host described). Every host of a
dataset must describe the same features: one that does not is refused by name, and the others go on.

What reached training is the trainer's word, not the stream's: it calls ``mark_trained()`` once per step,
for the oldest batch yielded and not yet marked (a device loader may hold several yielded batches ahead
of the step). Only then is the batch counted in the epoch ledger and its positions recorded for the next
checkpoint (``drain_trained``: training/data_service/positions.py). A resumed job sets ``resume`` (a
positions.ResumePlan) before iterating: each host's StreamRequest then asks it to start there.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.experimental
import numpy as np
import torch
from torch.utils.data import IterableDataset

from training.data_service import codec
from training.data_service import data_service_pb2 as pb
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.auth import call_metadata
from training.data_service.control import CLIENT_OPTIONS, DataServiceRefusedError, DataServiceUnavailableError
from training.data_service.epochs import EpochLedger
from training.data_service.positions import ResumePlan, ranges_of
from training.data_service.server import (
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    MAX_BATCHES,
    STREAM_BATCHES,
    StopReason,
    put_until_stopped,
)

# What a stream's channel adds to the control calls' options (control.CLIENT_OPTIONS).
_STREAMING = [
    # Read a stream on the calling thread (each data host has a thread of its own already) instead of
    # handing every message over from gRPC's thread.
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    # Ping the data host; no answer within the timeout breaks the connection (a hung host).
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Without this, a client that receives no data sends at most one ping per 5 minutes, whatever the
    # keep-alive time: a frozen host then goes unnoticed by the pings.
    ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_TIME_MS),
]
# A host's Describe answers within this (and within the connection's retry bound, but at least 1 s), or
# the connection attempt counts as failed and is retried.
DESCRIBE_TIMEOUT_S = 10.0


def stream_options(max_message_bytes: int) -> list[tuple[str, object]]:
    """A stream's channel options: it reads no message larger than ``max_message_bytes`` (the batch it
    asked for, codec.BatchSpec.max_message_bytes), so a host cannot make a trainer hold more. Pure."""
    limit = ("grpc.max_receive_message_length", max_message_bytes)
    return [option for option in CLIENT_OPTIONS if option[0] != limit[0]] + [limit, *_STREAMING]


def stream_spec(batch_size: int, info: pb.DatasetInfo) -> codec.BatchSpec:
    """The batches to expect from the host that sent ``info``: the batch size this trainer asks for, of
    the features the host describes. Refused (DataServiceRefusedError), naming the feature, when the host
    describes none, or one has a bad name, a dtype that cannot travel, a dimension that is not positive,
    comes twice, or when a batch of them does not fit one gRPC message. Pure."""
    if batch_size <= 0:
        raise DataServiceRefusedError(f"a trainer cannot ask for batches of {batch_size} samples")
    if not info.features:
        # Its batches are not streamed by this service (a tf.data.service host's), or are of a format
        # this release no longer reads (the image batches of Batch fields 2 and 3).
        raise DataServiceRefusedError(f"data host {info.host} describes no features: it streams no batches this trainer reads")
    features = []
    for described in info.features:
        try:
            feature = codec.FeatureSpec(described.name, described.dtype, tuple(described.shape))
        except codec.TensorFormatError as error:
            raise DataServiceRefusedError(f"data host {info.host} describes a feature that cannot travel: {error}") from None
        if any(dimension <= 0 for dimension in feature.shape):
            raise DataServiceRefusedError(f"data host {info.host} describes feature {feature.name!r} of sample shape {list(feature.shape)}")
        features.append(feature)
    try:
        spec = codec.BatchSpec(batch_size, tuple(features))
    except codec.TensorFormatError as error:  # a name twice
        raise DataServiceRefusedError(f"data host {info.host} describes features that cannot travel: {error}") from None
    if spec.max_message_bytes > codec.MAX_GRPC_MESSAGE_BYTES:
        largest = max(features, key=lambda feature: feature.batch_bytes(batch_size))
        raise DataServiceRefusedError(
            f"batches of {batch_size} samples of features {[feature.name for feature in features]} take "
            f"{spec.max_message_bytes / 2**30:.1f} GiB, more than one gRPC message can carry (2 GiB); feature {largest.name!r} "
            f"({largest.dtype} {list(largest.shape)} a sample) takes {largest.batch_bytes(batch_size) / 2**30:.1f} GiB of it: "
            f"use a smaller batch_size or smaller features"
        )
    return spec


def _describes(features: tuple[codec.FeatureSpec, ...]) -> str:
    """What a host's batches are, in words, for a refusal. Pure."""
    return "features " + ", ".join(f"{feature.name!r} {feature.dtype} {list(feature.shape)}" for feature in features)


log = logging.getLogger(__name__)

# A host that answers with one of these will answer the same again: no point retrying. Anything else
# (UNAVAILABLE, a reset stream...) may be a host that is starting, or one that died.
REFUSALS = frozenset({
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
})

CLEAN_ENDS = frozenset({MAX_BATCHES, StopReason.SHUTDOWN.value})


@dataclass
class HostState:
    address: str
    host: str = ""  # its name (algo-2), from its Describe; the address until then
    batches: int = 0
    skipped_samples: int = 0
    # None while streaming; "end of stream (...)" when the host ended it on purpose; else why it was lost.
    ended: str | None = None
    lost: bool = False  # given up on: no batch will come from it any more
    streaming: bool = False  # batches are flowing on the current connection
    # Since when this side has been waiting for the host's next batch (None: not waiting), and the call
    # to cancel when that wait passes the batch deadline.
    waiting_since: float | None = None
    call: grpc.Call | None = None
    stalled: bool = False  # the current call was cancelled for bringing no batch in time


@dataclass
class StreamStats:
    hosts: dict[str, HostState] = field(default_factory=dict)
    # What this process handed to training, per data host and epoch (training/data_service/epochs.py).
    ledger: EpochLedger = field(default_factory=EpochLedger)

    @property
    def skipped_samples(self) -> int:
        return sum(state.skipped_samples for state in self.hosts.values())

    @property
    def lost_hosts(self) -> list[str]:
        return [address for address, state in self.hosts.items() if state.lost]

    @property
    def lost_reasons(self) -> dict[str, str]:
        """Why each lost host was given up on (a malformed batch: "MalformedBatchError: expected ..., got ...")."""
        return {address: state.ended or "" for address, state in self.hosts.items() if state.lost}

    @property
    def unavailable_hosts(self) -> list[str]:
        """Hosts given up on, or whose stream broke and has not come back (yet): at the end of training,
        the hosts that were lost along the way."""
        return [
            address for address, state in self.hosts.items()
            if state.lost or (not state.streaming and not (state.ended or "").startswith("end of stream"))
        ]


class DataServiceDataset(IterableDataset):
    """Batches from every data host: dicts of named feature tensors {name: [B, *sample shape]} (see ``features``)."""

    def __init__(
        self,
        addresses: list[str],
        batch_size: int,
        token: str,
        client_id: str,
        connect_timeout_s: float = 300.0,
        reconnect_timeout_s: float = 10.0,
        batch_timeout_s: float = 60.0,
        queue_depth: int = 4,
        pin_memory: bool = False,
        features: Sequence[codec.FeatureSpec] | None = None,
        max_batches: int = 0,
    ) -> None:
        if not addresses:
            raise ValueError("DataServiceDataset needs at least one data host address")
        self.addresses = list(addresses)
        self.batch_size = batch_size
        self.token = token
        self.client_id = client_id
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.queue_depth = queue_depth
        # Per host, at most this many batches (0: no limit); a bounded read does not fix where the host's
        # stream starts (a Neuron pre-compile's few steps: the job's own stream gets those batches again).
        self.max_batches = max_batches
        # For a CUDA trainer: each stream's thread copies its batches into page-locked memory, so that the
        # trainer's copy to the device is a non-blocking DMA, and the copy costs the trainer's thread nothing.
        self.pin_memory = pin_memory
        # The features of the dicts this dataset yields, in this order: None until the first host's Describe
        # has been read (or as the caller says). Every host must describe the same (codec.FeatureSpec
        # compared by name, any order).
        self.features: tuple[codec.FeatureSpec, ...] | None = None if features is None else tuple(features)
        self._features_lock = threading.Lock()
        self.stats = StreamStats()
        # Where a resumed job's hosts start (None: a fresh job's, from the start).
        self.resume: ResumePlan | None = None
        # Yielded and not yet marked trained, oldest first: (host, sample ids, epochs, positions).
        self._handed: collections.deque[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = collections.deque()
        # Positions trained since the last drain, per host, as [start, end) ranges: a run's batches from one
        # host are mostly consecutive positions, so this stays small between checkpoints.
        self._trained: dict[str, list[list[int]]] = {}

    def mark_trained(self, batches: int = 1) -> None:
        """The oldest ``batches`` yielded batches were trained: count them in the epoch ledger, and
        record their positions for the next checkpoint. Called by the trainer, once per step."""
        for _ in range(batches):
            if not self._handed:
                raise RuntimeError("mark_trained: no batch yielded that was not already marked trained")
            host, sample_ids, epochs, positions = self._handed.popleft()
            self.stats.ledger.add(host, sample_ids, epochs)
            if len(positions):
                ranges = self._trained.setdefault(host, [])
                for start, end in ranges_of(positions).tolist():
                    if ranges and ranges[-1][1] == start:
                        ranges[-1][1] = end  # the next batch of a host this rank took the last one of too
                    else:
                        ranges.append([start, end])

    def drain_trained(self) -> dict[str, np.ndarray]:
        """The positions trained since the last drain, per host name, as (n, 2) arrays of [start, end)
        ranges (for the checkpoint's gather: positions.advance folds them)."""
        drained, self._trained = self._trained, {}
        return {host: np.asarray(ranges, dtype=np.int64).reshape(-1, 2) for host, ranges in drained.items()}

    def _agree(self, spec: codec.BatchSpec, host: str) -> tuple[codec.FeatureSpec, ...]:
        """The dataset's features once this host's agree with them (the first host's set them); refused
        (DataServiceRefusedError) otherwise: a trainer gets one kind of batch, whichever host it came from."""
        with self._features_lock:
            if self.features is None:
                self.features = spec.features
        if {feature.name: feature for feature in spec.features} != {feature.name: feature for feature in self.features}:
            raise DataServiceRefusedError(f"data host {host} describes {_describes(spec.features)}; this trainer reads {_describes(self.features)}")
        return self.features

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        merged: queue.Queue[tuple[dict[str, torch.Tensor], HostState, codec.DecodedBatch]] = queue.Queue(maxsize=self.queue_depth)
        stop = threading.Event()
        self.stats = StreamStats({address: HostState(address, host=address) for address in self.addresses})
        self._handed.clear()
        threads = [
            threading.Thread(target=self._stream, args=(state, merged, stop), name=f"stream-{state.address}", daemon=True)
            for state in self.stats.hosts.values()
        ]
        for thread in threads:
            thread.start()
        threading.Thread(target=self._watch_deadlines, args=(stop,), name="stream-deadlines", daemon=True).start()
        try:
            while True:
                try:
                    batch, state, decoded = merged.get(timeout=0.1)
                except queue.Empty:
                    if all(not thread.is_alive() for thread in threads) and merged.empty():
                        self._raise_if_all_lost()
                        return
                    continue
                # Counted when the trainer says it trained it (mark_trained): yielded is not trained.
                # Copies: the tags view the batch's payload, which they must not keep alive.
                self._handed.append((state.host, decoded.sample_ids.copy(), decoded.epochs.copy(), decoded.positions.copy()))
                yield batch
        finally:
            stop.set()

    def _raise_if_all_lost(self) -> None:
        states = self.stats.hosts.values()
        refused = [state for state in states if state.ended and state.ended.startswith("refused")]
        if refused:
            raise DataServiceRefusedError("; ".join(f"{state.address}: {state.ended}" for state in refused))
        if all(state.lost for state in states):
            reasons = "; ".join(f"{state.address}: {state.ended}" for state in states)
            raise DataServiceUnavailableError(f"all {len(self.addresses)} data hosts are gone ({reasons})")

    def stall_limit_s(self, state: HostState) -> float:
        """How long a stream may keep this side waiting: the batch deadline once the host has sent a batch;
        before that, the start bound too (its preprocessing workers may still be starting)."""
        return self.batch_timeout_s if state.batches else max(self.batch_timeout_s, self.connect_timeout_s)

    def _watch_deadlines(self, stop: threading.Event) -> None:
        """Cancel any call that has kept this side waiting for a batch longer than it may."""
        while not stop.wait(0.5):
            now = time.monotonic()
            for state in self.stats.hosts.values():
                waiting_since, call = state.waiting_since, state.call
                if waiting_since is not None and call is not None and now - waiting_since > self.stall_limit_s(state):
                    state.stalled = True
                    call.cancel()

    def _stream(self, state: HostState, merged: queue.Queue, stop: threading.Event) -> None:
        """Stream one host's batches into ``merged`` until it ends the stream, is lost, or we stop."""
        # The first connection may wait for a host that is still starting; later ones only briefly.
        retry_until = time.monotonic() + self.connect_timeout_s
        # Why the host first failed since its last batch: a hung host's stall is its cause, and the
        # reconnects that follow it only find it "unreachable".
        cause: str | None = None
        while not stop.is_set():
            # Two channels: the stream's receive limit is that of the host's batches, which its Describe tells.
            channel = grpc.insecure_channel(state.address, options=CLIENT_OPTIONS)
            call = None
            try:
                grpc.channel_ready_future(channel).result(timeout=max(0.1, min(2.0, retry_until - time.monotonic())))
                info = pb_grpc.DataServiceStub(channel).Describe(
                    pb.DescribeRequest(), timeout=max(1.0, min(DESCRIBE_TIMEOUT_S, retry_until - time.monotonic())),
                    metadata=call_metadata(self.token),
                )
                spec = stream_spec(self.batch_size, info)
                state.host = info.host or state.address
                features = self._agree(spec, state.host)
                request = pb.StreamRequest(client_id=self.client_id, batch_size=self.batch_size, max_batches=self.max_batches)
                if self.resume is not None:
                    request.resume.CopyFrom(self.resume.message(state.host))
                channel.close()
                channel = grpc.insecure_channel(state.address, options=stream_options(spec.max_message_bytes))
                call = channel.unary_stream(
                    STREAM_BATCHES, request_serializer=pb.StreamRequest.SerializeToString, response_deserializer=None
                )(request, metadata=call_metadata(self.token))
                state.stalled, state.call = False, call
                for payload in _timed(call, state):
                    batch = codec.decode_batch(payload)
                    if batch.end_of_stream:
                        state.ended = f"end of stream ({batch.end_reason})"
                        # A host that stops for any other reason than being done is a lost host.
                        state.lost = batch.end_reason not in CLEAN_ENDS
                        return
                    codec.check_batch(batch, spec)
                    tensors = {feature.name: _to_tensor(batch.features[feature.name], self.pin_memory) for feature in features}
                    item = (tensors, state, batch)
                    state.streaming = True
                    state.batches += 1
                    state.skipped_samples += batch.skipped_samples
                    retry_until = time.monotonic() + self.reconnect_timeout_s
                    cause = None
                    if not put_until_stopped(merged, item, stop):
                        return
                reason = "the stream ended without an end-of-stream marker"
            except grpc.FutureTimeoutError:
                reason = "unreachable"
            except DataServiceRefusedError as error:
                state.ended, state.lost = f"refused: {error}", True
                return
            except codec.TensorFormatError as error:
                # A host that sends malformed batches will keep doing so: drop it, by name and at once; the
                # others go on. Nothing of the batch reached training.
                named = error if isinstance(error, codec.MalformedBatchError) else codec.MalformedBatchError("a well-formed Batch", str(error))
                state.ended, state.lost, state.streaming = f"{type(named).__name__}: {named}", True, False
                log.error("data host %s sent a malformed batch (%s); dropped, carrying on with the others", state.address, named)
                return
            except grpc.RpcError as error:
                if stop.is_set():
                    return
                if call is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (error.details() or ""):
                    # More than the batch this host described: it would send the same again.
                    named = codec.MalformedBatchError(f"a message of at most {spec.max_message_bytes} bytes", error.details())
                    state.ended, state.lost, state.streaming = f"{type(named).__name__}: {named}", True, False
                    log.error("data host %s sent a batch larger than it described (%s); dropped", state.address, error.details())
                    return
                if error.code() in REFUSALS:
                    state.ended = f"refused: {error.code().name}: {error.details()}"
                    state.lost = True
                    return
                if state.stalled:
                    limit = self.stall_limit_s(state)
                    reason = f"no batch for {limit:.0f} s: the host is hung or overloaded"
                    log.warning("data host %s brought no batch for %.0f s; reconnecting", state.address, limit)
                    # A host that took a stream and sent nothing gets the reconnect bound, not the start's.
                    retry_until = min(retry_until, time.monotonic() + self.reconnect_timeout_s)
                else:
                    reason = f"{error.code().name}: {error.details()}"
                state.streaming = False
            except Exception as error:  # noqa: BLE001 — any other error must drop the host by name: a thread that
                # died of it would end this host's batches silently, and training with "the input ended".
                state.ended, state.lost, state.streaming = f"{type(error).__name__}: {error}", True, False
                log.exception("reading from data host %s failed; dropped, carrying on with the others", state.address)
                return
            finally:
                state.waiting_since, state.call = None, None
                if call is not None:
                    call.cancel()
                channel.close()
            cause = cause or reason
            if time.monotonic() >= retry_until:
                state.ended, state.lost = (reason if cause == reason else f"{cause}; then {reason}"), True
                log.warning("data host %s lost (%s); carrying on with the others", state.address, reason)
                return
            time.sleep(0.2)


def _timed(call: Iterator[bytes], state: HostState) -> Iterator[bytes]:
    """The call's messages, with ``state.waiting_since`` set while this side waits for the next one
    (not while it waits for room in the merged queue: a slow trainer is not a hung host)."""
    while True:
        state.waiting_since = time.monotonic()
        try:
            payload = next(call)
        except StopIteration:
            return
        finally:
            state.waiting_since = None
        yield payload


def _to_tensor(array: np.ndarray, pin_memory: bool = False) -> torch.Tensor:
    # The array views the message's immutable bytes; torch warns about that, but nothing writes into
    # the batch in place (normalisation makes a new float tensor on the device).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pin_memory else tensor

