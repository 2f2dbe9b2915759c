"""The data hosts' control plane, as the DNN side calls it: Describe, keep-alive and Shutdown.

gRPC only (no torch, no TensorFlow), so the launcher and every trainer variant can use it. Every data
host answers these RPCs, whichever pipeline it runs (our gRPC batch stream, or tf.data.service):

* ``describe``: what the dataset looks like (classes, sample shape, batch size), from the first host
  that answers; also marks the caller as a client;
* ``KeepAlive``: Describe calls every few seconds while a trainer runs, for data hosts whose batches do
  not travel over our own stream (tf.data.service): when they stop, the host's idle timeout starts;
* ``request_shutdown``: the authenticated stop at the end of training.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc

from training.data_service import data_service_pb2 as pb
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.server import GRPC_OPTIONS

log = logging.getLogger(__name__)

# gRPC backs off exponentially (up to 2 minutes) between attempts to reach a host that is not up yet, and
# channels to the same target share that state. Data hosts start at different times: retry every second.
CLIENT_OPTIONS = GRPC_OPTIONS + [
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


def describe(addresses: list[str], timeout_s: float) -> pb.DatasetInfo:
    """DatasetInfo from the first data host that answers within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    errors: dict[str, str] = {}
    while time.monotonic() < deadline:
        for address in addresses:
            with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
                try:
                    return pb_grpc.DataServiceStub(channel).Describe(pb.DescribeRequest(), timeout=2.0)
                except grpc.RpcError as error:
                    errors[address] = f"{error.code().name}: {error.details()}"
        time.sleep(0.5)
    raise DataServiceUnavailableError(f"no data host answered within {timeout_s:.0f} s: {errors}")


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
    """Ask one data host to stop. Raises grpc.RpcError (PERMISSION_DENIED for a wrong token)."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DataServiceStub(channel).Shutdown(pb.ShutdownRequest(token=token, requester=requester), timeout=timeout_s)


class KeepAlive:
    """Tells every data host, every ``interval_s``, that a trainer is still running on this host, and
    tracks when each last answered.

    A host that does not answer is simply asked again next time (it may be starting, or gone);
    ``silent_for`` says for how long it has not answered.
    """

    def __init__(self, addresses: list[str], interval_s: float) -> None:
        self.addresses = addresses
        self._channels = [grpc.insecure_channel(address, options=CLIENT_OPTIONS) for address in addresses]
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._last_answer = {address: time.monotonic() for address in addresses}
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
        while not self._stop.is_set():
            for address, stub in zip(self.addresses, stubs, strict=True):
                try:
                    stub.Describe(pb.DescribeRequest(), timeout=2.0)
                    self._last_answer[address] = time.monotonic()
                except grpc.RpcError:
                    pass
            self._stop.wait(self._interval_s)

    def silent_for(self, address: str) -> float:
        """Seconds since ``address`` last answered (since the start, if it never did)."""
        return time.monotonic() - self._last_answer[address]
