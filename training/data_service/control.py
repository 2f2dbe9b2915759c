"""The control plane between hosts: what the DNN side asks of data hosts, and what data hosts tell it.

gRPC only (no torch, no TensorFlow), so the launcher and every trainer variant can use it. Every data
host answers these RPCs, whichever pipeline it runs (our gRPC batch stream, or tf.data.service), and
every call carries the job's token (training/data_service/auth.py):

* ``describe``: what the dataset looks like (classes, sample shape, batch size), from the first host
  that answers; also marks the caller as a client;
* ``KeepAlive``: Describe calls every few seconds from each DNN host's launcher while its trainers run:
  when they stop (the DNN host is gone), the data host's idle timeout starts;
* ``request_shutdown``: the stop at the end of training;
* ``FailureReports`` / ``report_failure``: the other direction. Each DNN host's launcher listens for
  ReportFailure; a data host that cannot serve (taken port, undecodable channel, tf.data.service that did
  not start) reports its reason there before it exits, so the DNN host fails at once with that reason.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures

import grpc

from training.data_service import data_service_pb2 as pb
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.auth import TokenAuth, call_metadata
from training.data_service.server import MAX_REQUEST_BYTES, SERVER_OPTIONS, bind_port

log = logging.getLogger(__name__)

# The most a control call's reply may be: the largest is DatasetInfo, whose class names for
# dataset.MAX_CLASSES classes, each as long as a folder name can be (255 bytes), take ~25 MiB
# (tests/training/test_data_service_limits.py builds it). Batches are not control replies: a stream's
# limit is its batch's own (client.stream_options).
MAX_REPLY_BYTES = 32 << 20

# gRPC backs off exponentially (up to 2 minutes) between attempts to reach a host that is not up yet, and
# channels to the same target share that state. Data hosts start at different times: retry every second.
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),  # what the servers read at most
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class DataServiceError(RuntimeError):
    """The data service cannot feed this trainer."""


class DataServiceUnavailableError(DataServiceError):
    """No data host can serve batches any more."""


class DataServiceRefusedError(DataServiceError):
    """A data host refused the request (e.g. a batch size that is not the job's)."""


def describe(addresses: list[str], token: str, timeout_s: float) -> pb.DatasetInfo:
    """DatasetInfo from the first data host that answers within ``timeout_s``. A refusal (the token is
    not the job's) is final: DataServiceRefusedError at once."""
    deadline = time.monotonic() + timeout_s
    errors: dict[str, str] = {}
    while time.monotonic() < deadline:
        for address in addresses:
            with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
                try:
                    return pb_grpc.DataServiceStub(channel).Describe(pb.DescribeRequest(), timeout=2.0, metadata=call_metadata(token))
                except grpc.RpcError as error:
                    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise DataServiceRefusedError(f"data host {address} refused this job's token: {error.details()}") from None
                    errors[address] = f"{error.code().name}: {error.details()}"
        time.sleep(0.5)
    raise DataServiceUnavailableError(f"no data host answered within {timeout_s:.0f} s: {errors}")


def describe_every(addresses: list[str], token: str, timeout_s: float) -> list[pb.DatasetInfo]:
    """DatasetInfo from every data host, each within ``timeout_s`` (DataServiceUnavailableError names
    the hosts that did not answer)."""
    deadline = time.monotonic() + timeout_s
    return [describe([address], token, max(0.0, deadline - time.monotonic())) for address in addresses]


def wait_for_port(address: str, timeout_s: float, what: str = "the tf.data.service dispatcher") -> None:
    """Wait until something listens on host:port. tf.data.service's own client retries an unreachable
    dispatcher for up to an hour; this bounds the wait and names what is missing."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise DataServiceUnavailableError(f"{what} at {address} is unreachable after {timeout_s:.0f} s: {error}") from None
            time.sleep(0.5)


def request_shutdown(address: str, token: str, requester: str, timeout_s: float = 5.0) -> pb.ShutdownReply:
    """Ask one data host to stop. Raises grpc.RpcError (UNAUTHENTICATED for a wrong token)."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DataServiceStub(channel).Shutdown(
            pb.ShutdownRequest(requester=requester), timeout=timeout_s, metadata=call_metadata(token)
        )


# The call metadata that names the host a keep-alive comes from.
SENDER_METADATA = "x-keepalive-sender"


class KeepAlive:
    """Tells every data host, every ``interval_s``, that a trainer is still running on this host, and
    tracks when each last answered.

    A host that does not answer is simply asked again next time (it may be starting, or gone);
    ``answered`` says whether it ever did, ``silent_for`` for how long it has not since.
    """

    def __init__(self, addresses: list[str], token: str, interval_s: float, sender: str = "") -> None:
        self.addresses = addresses
        # ``sender``: this host's name, for a data host that tracks each trainer host (script mode's).
        self._metadata = call_metadata(token) + (((SENDER_METADATA, sender),) if sender else ())
        self._channels = [grpc.insecure_channel(address, options=CLIENT_OPTIONS) for address in addresses]
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._last_answer: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="data-host-keepalive", daemon=True)

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 3)
        for channel in self._channels:
            channel.close()

    def _run(self) -> None:
        stubs = [pb_grpc.DataServiceStub(channel) for channel in self._channels]

        def ask(address: str, stub: pb_grpc.DataServiceStub) -> None:
            try:
                stub.Describe(pb.DescribeRequest(), timeout=2.0, metadata=self._metadata)
                self._last_answer[address] = time.monotonic()
            except grpc.RpcError:
                pass

        # All at once: a few hung hosts must not delay the keep-alives of the others.
        with futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(self.addresses))), thread_name_prefix="keepalive") as pool:
            while not self._stop.is_set():
                list(pool.map(ask, self.addresses, stubs))
                # Until every host has answered once, ask every second: a data host learns that its DNN
                # hosts exist (and so that it may leave once they are gone) as soon as it is up.
                pending = any(address not in self._last_answer for address in self.addresses)
                self._stop.wait(min(1.0, self._interval_s) if pending else self._interval_s)

    def answered(self, address: str) -> bool:
        return address in self._last_answer

    def silent_for(self, address: str) -> float:
        """Seconds since ``address`` last answered (since the keep-alives started, if it never did)."""
        return time.monotonic() - self._last_answer.get(address, self._started)


class FailureReports(pb_grpc.JobControlServicer):
    """The DNN host's end of ReportFailure: collects what data hosts say before they exit. Use as a
    context manager; ``reports`` maps host name → reason."""

    def __init__(self, bind_target: str, token: str) -> None:
        self.reports: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="job-control"),
            options=SERVER_OPTIONS,
            interceptors=[TokenAuth(token)],
        )
        pb_grpc.add_JobControlServicer_to_server(self, self._server)
        bind_port(self._server, bind_target)

    def __enter__(self) -> FailureReports:
        self._server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.stop(grace=1.0).wait(timeout=3)

    def ReportFailure(self, request: pb.FailureReport, context: grpc.ServicerContext) -> pb.FailureAck:
        with self._lock:
            first = request.host not in self.reports
            self.reports[request.host] = request.reason
        if first:
            log.error("data host %s failed: %s", request.host, request.reason)
        return pb.FailureAck(host=request.host)

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self.reports)


def report_failure(
    targets: list[str], token: str, host: str, reason: str, timeout_s: float, stop: threading.Event | None = None
) -> list[str]:
    """Tell every DNN host (host:port of its ReportFailure server) why this data host cannot serve;
    retried while a DNN host is not up yet, for at most ``timeout_s`` or until ``stop`` is set (SIGTERM).
    Returns the targets that heard it."""
    request = pb.FailureReport(host=host, reason=reason[:1024])
    stop = stop or threading.Event()

    def one(target: str) -> str | None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(target, options=CLIENT_OPTIONS) as channel:
            stub = pb_grpc.JobControlStub(channel)
            while True:
                try:
                    stub.ReportFailure(request, timeout=2.0, metadata=call_metadata(token), wait_for_ready=True)
                    return target
                except grpc.RpcError as error:
                    if error.code() == grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline or stop.is_set():
                        log.warning("could not tell DNN host %s that this host failed (%s)", target, error.code().name)
                        return None

    with futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        return [target for target in pool.map(one, targets) if target is not None]
