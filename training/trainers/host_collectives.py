"""The shared loop's own collectives (data wait, stop votes, summary counts, barriers) on a gloo process
group of their own: host values between host processes, never a device graph.

On GPUs the gradients go over NCCL; on Trainium over XLA's device collectives. The loop's collectives
run after every step, so on the device they would cost a graph and a transfer each (on XLA,
``xm.mesh_reduce`` is a device all-gather of sizes, then of padded payloads), and under Neuron's graph
extraction, where device values are zeros, they would return nothing. A gloo group beside the
device's keeps them on the host, and lets ranks wait for each other (tokenisation, the chief's save)
without a device collective's timeout.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist


def host_group() -> Any:
    """A gloo group over every rank of the default process group (call on every rank, once)."""
    return dist.new_group(backend="gloo")


def reduce_max(values: list[float], group: Any) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def gather(value: Any, world_size: int, group: Any) -> list[Any]:
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_to_chief(value: Any, world_size: int, group: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (None elsewhere): what only the chief needs (a checkpoint's)."""
    gathered: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered


def barrier(group: Any) -> None:
    dist.barrier(group=group)


def broadcast_parameters(module: torch.nn.Module, group: Any, source: int = 0) -> None:
    """Every rank takes rank ``source``'s parameters and buffers (on the CPU, before the model moves to
    its device: one host copy at start, no device collective)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, source, group=group)


def end_process(status: int) -> None:
    """Exit with ``status``. A distributed trainer leaves with os._exit once its output is flushed: tearing
    down a gloo process group can deadlock (its destructor, holding the GIL, joins a worker thread that
    needs the GIL to free the tensors of the last collective; seen here once in three 2-rank runs), and
    a trainer that never exits after finishing is a hung job."""
    if dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    sys.exit(status)
