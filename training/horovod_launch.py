"""Horovod across the DNN group without ssh or MPI: every DNN host starts its own ranks, as torchrun does.

``horovodrun`` starts remote ranks over ssh, and SageMaker's MPI launcher would run on every host of every
instance group, data hosts included. Instead the launcher on each DNN host starts ``processes_per_host``
trainer processes with the environment Horovod's gloo controller reads (the same variables
``horovodrun --gloo`` sets), and the first DNN host also runs Horovod's rendezvous server, on the job's
``master_port``, with the slot plan every host computes identically. MPI and ssh never reach a data host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
from dataclasses import dataclass

SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Slot:
    """One Horovod process: the fields of horovod.runner.common.util.hosts.SlotInfo."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def slot_plan(hosts: list[str], processes_per_host: int) -> list[Slot]:
    """Ranks host by host, as Horovod assigns them for hosts with equal slot counts."""
    size = len(hosts) * processes_per_host
    return [
        Slot(host, node * processes_per_host + local, local, node, size, processes_per_host, len(hosts))
        for node, host in enumerate(hosts)
        for local in range(processes_per_host)
    ]


def rank_environment(slot: Slot, rendezvous_address: str, rendezvous_port: int, interface: str) -> dict[str, str]:
    """What one rank needs to find the others (the variables horovodrun --gloo sets)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": interface,
        "NCCL_SOCKET_IFNAME": interface,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def interface_of(address: str) -> str:
    """The network interface that holds ``address`` (gloo binds to an interface, not an address).
    Loopback addresses (the emulated cluster's 127.0.x.y) are all on "lo"."""
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)  # bytes in, bytes out
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    raise OSError(f"no network interface of this host holds {address}")


class RendezvousServer:
    """Horovod's gloo rendezvous (its own HTTP key-value store), on a fixed address and port."""

    def __init__(self, bind_address: str, port: int, plan: list[Slot]) -> None:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        self._server = RendezvousHTTPServer((bind_address, port), RendezvousHandler, 0)
        self._server.init([SlotInfo(**vars(slot)) for slot in plan])
        self._thread = threading.Thread(target=self._server.serve_forever, name="horovod-rendezvous", daemon=True)

    def __enter__(self) -> RendezvousServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
