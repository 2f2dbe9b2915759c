"""Instance types the platform knows: vCPUs and accelerators, plus a dated fallback price table.

Prices are SageMaker on-demand training prices in us-east-1 (USD per instance-hour), the figures of the
public heterogeneous-cluster benchmark tables that this project reproduces. They are the fallback: every
result records the source and date of the prices it used, so a figure from this table is never mistaken
for a live price.
"""

from __future__ import annotations

from dataclasses import dataclass

PRICE_SOURCE = "fallback table: SageMaker on-demand training, us-east-1, public heterogeneous-cluster benchmark tables"
PRICE_DATE = "2022-07-01"


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    accelerators: int  # GPUs or Trainium chips
    accelerator: str  # "" for CPU instances
    usd_per_hour: float | None  # None: no fallback price known
    neuron_cores: int = 0  # NeuronCores (2 per Trainium chip); one trainer process each

    @property
    def is_cpu_only(self) -> bool:
        return self.accelerators == 0

    @property
    def is_trainium(self) -> bool:
        return self.neuron_cores > 0


CATALOG: dict[str, InstanceType] = {
    item.name: item
    for item in (
        InstanceType("ml.c5.xlarge", 4, 0, "", 0.204),
        InstanceType("ml.c5.2xlarge", 8, 0, "", 0.408),
        InstanceType("ml.c5.4xlarge", 16, 0, "", 0.816),
        InstanceType("ml.c5.9xlarge", 36, 0, "", 1.836),
        InstanceType("ml.c5.18xlarge", 72, 0, "", 3.672),
        InstanceType("ml.p3.2xlarge", 8, 1, "NVIDIA V100", 3.825),
        InstanceType("ml.p4d.24xlarge", 96, 8, "NVIDIA A100", 37.688),
        # No fallback price: results on these use live prices only.
        InstanceType("ml.trn1.2xlarge", 8, 1, "AWS Trainium", None, neuron_cores=2),
        InstanceType("ml.trn1.32xlarge", 128, 16, "AWS Trainium", None, neuron_cores=32),
        InstanceType("ml.trn2.48xlarge", 192, 16, "AWS Trainium2", None, neuron_cores=64),
    )
}


class UnknownInstanceTypeError(KeyError):
    pass


def instance_type(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownInstanceTypeError(f"instance type {name!r} is not in the catalog; known: {sorted(CATALOG)}") from None
