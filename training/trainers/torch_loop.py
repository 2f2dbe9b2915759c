"""What every PyTorch trainer adds to the shared loop (training/trainers/loop.py): the loop's own
collectives on the host gloo group (training/trainers/host_collectives.py), and the random-number state of
torch, CUDA and XLA generators in checkpoints. The GPU vision trainer, the Trainium text trainer and the
runtime of user workloads all derive from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from training.trainers import host_collectives
from training.trainers.loop import TrainingLoop, decode_bytes, encode_bytes
from training.trainers.service_summary import rank_service_stats, service_summary

BatchT = TypeVar("BatchT")


class TorchTrainingLoop(TrainingLoop[BatchT]):
    # Set by a multi-process trainer (host_collectives.host_group()); a single process needs none.
    host_group: Any = None
    device: torch.device

    def barrier(self) -> None:
        if self.world_size > 1:
            host_collectives.barrier(self.host_group)

    def reduce_max(self, values: list[float]) -> list[float]:
        return host_collectives.reduce_max(values, self.host_group) if self.world_size > 1 else values

    def gather(self, value: Any) -> list[Any]:
        return host_collectives.gather(value, self.world_size, self.host_group) if self.world_size > 1 else [value]

    def gather_to_chief(self, value: Any) -> list[Any] | None:
        return host_collectives.gather_to_chief(value, self.world_size, self.host_group) if self.world_size > 1 else [value]

    def rng_state(self) -> dict[str, Any]:
        state = super().rng_state() | {"torch": encode_bytes(torch.get_rng_state().numpy().tobytes())}
        if self.device.type == "cuda":
            state["cuda"] = encode_bytes(torch.cuda.get_rng_state(self.device).numpy().tobytes())
        if self.device.type == "xla":
            import torch_xla.core.xla_model as xm

            state["xla"] = xm.get_rng_state()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        super().set_rng_state(state)
        if "torch" in state:
            torch.set_rng_state(byte_tensor(state["torch"]))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(byte_tensor(state["cuda"]), self.device)
        if "xla" in state and self.device.type == "xla":
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(state["xla"]))


    def input_summary(self, service: Any, skipped_samples: int, epoch_samples: Mapping[str, int], *, sharded: bool,
                      epochs: bool, earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The summary's account of what the ranks trained on (a collective: every rank calls it): the
        samples skipped, summed over the ranks, and with data hosts (``service``, a DataServiceDataset)
        the hosts lost and why, batches per host and the epochs, with those of the ``earlier`` jobs of a
        resumed run (their epoch ledger, from the checkpoint) (training/trainers/service_summary.py)."""
        local = rank_service_stats(service) if service is not None else {"skipped_samples": skipped_samples}
        ranks = self.gather(local)
        summary: dict[str, Any] = {"skipped_samples": sum(rank["skipped_samples"] for rank in ranks)}
        if service is not None:
            summary |= service_summary(service.addresses, ranks, epoch_samples, sharded=sharded, epochs=epochs, earlier=earlier)
        return summary


def byte_tensor(text: str) -> torch.Tensor:
    """A generator state saved by encode_bytes, as the byte tensor torch takes back."""
    return torch.frombuffer(bytearray(decode_bytes(text)), dtype=torch.uint8)


def host_cpus() -> int:
    return len(os.sched_getaffinity(0))
