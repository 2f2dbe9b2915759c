"""The data-group sizing advisor: how many data hosts make a job no longer input-bound, and which size
is cheapest per step. Pure.

From one short profiling run it takes two figures: what one batch's preprocessing costs on one data
vCPU (``preprocess_ms_per_batch_per_vcpu``, vCPU-milliseconds), and the DNN's step time with its input
already in memory (``train_ms_per_step``: synthetic or cached input). With ``n`` data hosts of ``v``
vCPUs each, preprocessing keeps up once it makes a batch per step:

    predicted step(n) = max(train, preprocess per vCPU / (spare DNN vCPUs + n × v × efficiency))
    data hosts needed = the smallest n with preprocess per vCPU / (spare + n × v × efficiency) ≤ train

"One batch" is one training step's input: the batch of every trainer process together. The first figure
also comes from what bench/preprocess.py reports, images per second per vCPU: a step of ``b`` images costs
b × 1000 / (images/s per vCPU) vCPU-milliseconds (``ms_per_batch_per_vcpu``).

``efficiency`` (≤ 1) discounts the data service's own overhead (measured: bench/offload.py); the DNN
host's spare vCPUs count for the homogeneous configuration (n = 0), where its own CPUs preprocess.
Costs come from the same arithmetic as every result (lambdas/core/price_performance.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lambdas.core.catalog import instance_type
from lambdas.core.price_performance import Prices, cost_per_1k_steps, hourly_cost


class SizingError(ValueError):
    """The profile cannot give a prediction (a figure missing or not positive)."""


@dataclass(frozen=True)
class SizingProfile:
    preprocess_ms_per_batch_per_vcpu: float
    train_ms_per_step: float
    dnn_spare_vcpus: float = 0.0
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.preprocess_ms_per_batch_per_vcpu <= 0 or self.train_ms_per_step <= 0:
            raise SizingError(f"both profile figures must be positive, got {self.preprocess_ms_per_batch_per_vcpu} and {self.train_ms_per_step}")
        if not 0 < self.efficiency <= 1 or self.dnn_spare_vcpus < 0:
            raise SizingError(f"efficiency must be in (0, 1] and spare vCPUs ≥ 0, got {self.efficiency}, {self.dnn_spare_vcpus}")


def ms_per_batch_per_vcpu(images_per_s_per_vcpu: float, images_per_step: int) -> float:
    """The vCPU-milliseconds one step's input costs to preprocess, from the images per second one vCPU
    prepares (bench/preprocess.py's figure). Pure."""
    if not 0 < images_per_s_per_vcpu < float("inf") or images_per_step < 1:
        raise SizingError(f"images per second per vCPU must be positive and a step at least 1 image, got {images_per_s_per_vcpu}, {images_per_step}")
    return images_per_step * 1000 / images_per_s_per_vcpu


def predicted_step_ms(profile: SizingProfile, data_hosts: int, vcpus_per_data_host: float) -> float:
    capacity = profile.dnn_spare_vcpus + data_hosts * vcpus_per_data_host * profile.efficiency
    if capacity <= 0:
        return math.inf
    return max(profile.train_ms_per_step, profile.preprocess_ms_per_batch_per_vcpu / capacity)


def data_hosts_needed(profile: SizingProfile, vcpus_per_data_host: float) -> int:
    """The fewest data hosts with which preprocessing keeps up with training (0: the DNN host's own
    spare vCPUs already do)."""
    missing_vcpus = profile.preprocess_ms_per_batch_per_vcpu / profile.train_ms_per_step - profile.dnn_spare_vcpus
    if missing_vcpus <= 1e-9:
        return 0
    return math.ceil(missing_vcpus / (vcpus_per_data_host * profile.efficiency) - 1e-9)


@dataclass(frozen=True)
class Candidate:
    data_hosts: int
    predicted_step_ms: float
    usd_per_hour: float
    cost_per_1k_steps_usd: float


@dataclass(frozen=True)
class Advice:
    data_instance_type: str
    needed: int
    candidates: tuple[Candidate, ...]
    cheapest: Candidate

    @property
    def sweep_sizes(self) -> list[int]:
        """Data-group sizes worth measuring: none, one short of the prediction, it, and one more."""
        return sorted({0, max(self.needed - 1, 0), self.needed, self.needed + 1})


def advise(profile: SizingProfile, dnn_instance_type: str, data_instance_type: str, prices: Prices, max_hosts: int = 20) -> Advice:
    """Predicted step time and cost per 1k steps for 0..(needed + 1) data hosts; the cheapest of them."""
    data = instance_type(data_instance_type)
    if not data.is_cpu_only:
        raise SizingError(f"data hosts run on CPU instances; {data_instance_type} has accelerators")
    needed = data_hosts_needed(profile, data.vcpus)
    if needed > max_hosts:
        raise SizingError(f"{needed} × {data_instance_type} would be needed to keep up (more than {max_hosts}): use a larger data instance type")
    candidates = []
    for count in range(0, needed + 2):
        step = predicted_step_ms(profile, count, data.vcpus)
        if math.isinf(step):
            continue
        usd = hourly_cost([(dnn_instance_type, 1), (data_instance_type, count)], prices)
        candidates.append(Candidate(count, round(step, 3), round(usd, 4), round(cost_per_1k_steps(usd, step), 6)))
    cheapest = min(candidates, key=lambda candidate: (candidate.cost_per_1k_steps_usd, candidate.data_hosts))
    return Advice(data_instance_type, needed, tuple(candidates), cheapest)
