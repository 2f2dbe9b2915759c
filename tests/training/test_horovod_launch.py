"""training/horovod_launch.py: the slot plan, the rank environment and the interface lookup (pure), and
Horovod itself across two real processes through our rendezvous server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.horovod_launch import RendezvousServer, interface_of, rank_environment, slot_plan
from training.local.cluster import free_port

REPO = Path(__file__).resolve().parents[2]


def test_ranks_are_numbered_host_by_host() -> None:
    plan = slot_plan(["algo-3", "algo-4"], 2)
    assert [(slot.hostname, slot.rank, slot.local_rank, slot.cross_rank) for slot in plan] == [
        ("algo-3", 0, 0, 0), ("algo-3", 1, 1, 0), ("algo-4", 2, 0, 1), ("algo-4", 3, 1, 1),
    ]
    assert {(slot.size, slot.local_size, slot.cross_size) for slot in plan} == {(4, 2, 2)}


def test_each_rank_gets_the_gloo_rendezvous_and_its_place() -> None:
    env = rank_environment(slot_plan(["algo-3", "algo-4"], 2)[3], "10.0.0.7", 29500, "eth0")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.7" and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "29500"
    assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_RANK"], env["HOROVOD_CROSS_RANK"]) == ("3", "4", "1", "1")
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_GLOO_IFACE"] == "eth0"


def test_loopback_addresses_are_on_lo_and_a_foreign_address_is_refused() -> None:
    assert interface_of("127.0.44.3") == "lo"
    with pytest.raises(OSError, match="no network interface of this host holds 198.51.100.77"):
        interface_of("198.51.100.77")  # TEST-NET-2: documentation only


ALLREDUCE = """
import horovod.tensorflow as hvd, tensorflow as tf
hvd.init()
total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()} sum {float(total)}", flush=True)
"""


def test_two_ranks_find_each_other_through_our_rendezvous_server() -> None:
    port = free_port()
    plan = slot_plan(["algo-1"], 2)
    with RendezvousServer("127.0.0.1", port, plan):
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", ALLREDUCE], env=os.environ | rank_environment(slot, "127.0.0.1", port, "lo"),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            for slot in plan
        ]
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert "rank 0/2 local 0 sum 3.0" in outputs[0] and "rank 1/2 local 1 sum 3.0" in outputs[1]
