"""Instance types the platform knows: every type SageMaker accepts for training, with its hardware, plus a
dated fallback price table.

The hardware (vCPUs, memory, accelerators, their memory, NeuronCores) is AWS's published EC2 instance-type
specifications, which SageMaker's ml.* types share with their EC2 namesakes; the newest families (G7, G7e,
P6) from AWS's launch announcements. HARDWARE_DATE is when the table was compiled. A test holds the
catalog equal to the TrainingInstanceType enum of botocore's SageMaker model, so a botocore that knows a
new training type fails the tests until the type is added here, and a misspelt type fails too.

Prices are SageMaker on-demand training prices in us-east-1 (USD per instance-hour), the figures of the
public heterogeneous-cluster benchmark tables that this project reproduces. They are the fallback: every
result records the source and date of the prices it used, so a figure from this table is never mistaken
for a live price. A type with no sourced figure has none (``usd_per_hour`` None): results and `hetero
prices --live` price it from the Price List API, and a deployment's cost ceiling from cdk.json's
ceiling_prices_usd_per_hour.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRICE_SOURCE = "fallback table: SageMaker on-demand training, us-east-1, public heterogeneous-cluster benchmark tables"
PRICE_DATE = "2022-07-01"
HARDWARE_SOURCE = ("AWS's EC2 instance-type specifications (docs.aws.amazon.com/ec2/latest/instancetypes), shared by SageMaker's "
                   "ml.* types; G7, G7e and P6 from AWS's launch announcements; NeuronCores from the AWS Neuron documentation")
HARDWARE_DATE = "2026-12-03"

# Accelerator kinds (InstanceType.accelerator_kind).
CPU_ONLY, GPU, TRAINIUM = "", "gpu", "trainium"
# Families whose host CPUs are Arm (NVIDIA Grace): SageMaker trains on them, the platform's x86_64 images cannot.
ARM64_FAMILIES = frozenset({"ml.p6e-gb200"})


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    accelerators: int  # GPUs or Trainium chips
    accelerator: str  # "" for CPU instances
    usd_per_hour: float | None  # None: no fallback price known
    # NeuronCores the Neuron runtime exposes by default, one trainer process each: 2 per Trainium chip, 4
    # logical ones per Trainium2 chip (8 physical NeuronCore-v3, paired by the default LNC=2).
    neuron_cores: int = 0
    memory_gib: float = 0.0
    accelerator_kind: str = CPU_ONLY  # or GPU, TRAINIUM
    accelerator_memory_gb: float = 0.0  # per accelerator, as AWS's specifications give it

    @property
    def is_cpu_only(self) -> bool:
        return self.accelerators == 0

    @property
    def is_trainium(self) -> bool:
        return self.neuron_cores > 0

    @property
    def is_arm64(self) -> bool:
        """Arm host CPUs (Grace): the platform's images are built for x86_64 and would not start there."""
        return self.family in ARM64_FAMILIES

    @property
    def family(self) -> str:
        """"ml.g5" of "ml.g5.xlarge"."""
        return self.name.rsplit(".", 1)[0]


# vCPUs of a size in AWS's naming: large 2, xlarge 4, Nxlarge 4N.
def size_vcpus(size: str) -> int:
    if size == "large":
        return 2
    if size == "xlarge":
        return 4
    return 4 * int(size.removesuffix("xlarge"))


# CPU families whose every size has the same memory per vCPU: family → (GiB per vCPU, sizes).
_REGULAR_CPU_FAMILIES: dict[str, tuple[int, str]] = {
    "ml.c5": (2, "xlarge 2xlarge 4xlarge 9xlarge 18xlarge"),
    "ml.c6i": (2, "xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge"),
    "ml.c7i": (2, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 48xlarge"),
    "ml.c7i-flex": (2, "xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
    "ml.c8i": (2, "xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge 48xlarge 96xlarge"),
    "ml.c8i-flex": (2, "xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
    "ml.m4": (4, "xlarge 2xlarge 4xlarge 10xlarge 16xlarge"),
    "ml.m5": (4, "large xlarge 2xlarge 4xlarge 12xlarge 24xlarge"),
    "ml.m6i": (4, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge"),
    "ml.m7i": (4, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 48xlarge"),
    "ml.m7i-flex": (4, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
    "ml.m8i": (4, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge 48xlarge 96xlarge"),
    "ml.m8i-flex": (4, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
    "ml.r5": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge"),
    "ml.r5d": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge"),
    "ml.r6i": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge"),
    "ml.r7i": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 48xlarge"),
    "ml.r8i": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge 24xlarge 32xlarge 48xlarge 96xlarge"),
    "ml.r8i-flex": (8, "large xlarge 2xlarge 4xlarge 8xlarge 12xlarge 16xlarge"),
}

# CPU types whose memory follows no ratio: name → (vCPUs, GiB).
_IRREGULAR_CPU_TYPES: dict[str, tuple[int, float]] = {
    "ml.c4.xlarge": (4, 7.5), "ml.c4.2xlarge": (8, 15), "ml.c4.4xlarge": (16, 30), "ml.c4.8xlarge": (36, 60),
    "ml.c5n.xlarge": (4, 10.5), "ml.c5n.2xlarge": (8, 21), "ml.c5n.4xlarge": (16, 42), "ml.c5n.9xlarge": (36, 96),
    "ml.c5n.18xlarge": (72, 192),
    "ml.t3.medium": (2, 4), "ml.t3.large": (2, 8), "ml.t3.xlarge": (4, 16), "ml.t3.2xlarge": (8, 32),
}

# Accelerated families: family → (kind, accelerator, memory per accelerator in GB, NeuronCores per chip,
# {size: (vCPUs, GiB, accelerators)}).
_ACCELERATED_FAMILIES: dict[str, tuple[str, str, float, int, dict[str, tuple[int, float, int]]]] = {
    "ml.p2": (GPU, "NVIDIA K80", 12, 0, {"xlarge": (4, 61, 1), "8xlarge": (32, 488, 8), "16xlarge": (64, 732, 16)}),
    "ml.p3": (GPU, "NVIDIA V100", 16, 0, {"2xlarge": (8, 61, 1), "8xlarge": (32, 244, 4), "16xlarge": (64, 488, 8)}),
    "ml.p3dn": (GPU, "NVIDIA V100", 32, 0, {"24xlarge": (96, 768, 8)}),
    "ml.p4d": (GPU, "NVIDIA A100", 40, 0, {"24xlarge": (96, 1152, 8)}),
    "ml.p4de": (GPU, "NVIDIA A100", 80, 0, {"24xlarge": (96, 1152, 8)}),
    "ml.p5": (GPU, "NVIDIA H100", 80, 0, {"4xlarge": (16, 256, 1), "48xlarge": (192, 2048, 8)}),
    "ml.p5e": (GPU, "NVIDIA H200", 141, 0, {"48xlarge": (192, 2048, 8)}),
    "ml.p5en": (GPU, "NVIDIA H200", 141, 0, {"48xlarge": (192, 2048, 8)}),
    "ml.p6-b200": (GPU, "NVIDIA B200", 179, 0, {"48xlarge": (192, 2048, 8)}),  # 1,432 GB in all
    "ml.p6-b300": (GPU, "NVIDIA B300", 268, 0, {"48xlarge": (192, 4096, 8)}),  # 2,144 GB in all
    "ml.p6e-gb200": (GPU, "NVIDIA GB200", 185, 0, {"36xlarge": (144, 960, 4)}),  # 740 GB in all; Grace (Arm) CPUs
    "ml.g4dn": (GPU, "NVIDIA T4", 16, 0, {"xlarge": (4, 16, 1), "2xlarge": (8, 32, 1), "4xlarge": (16, 64, 1), "8xlarge": (32, 128, 1),
                                         "12xlarge": (48, 192, 4), "16xlarge": (64, 256, 1)}),
    "ml.g5": (GPU, "NVIDIA A10G", 24, 0, {"xlarge": (4, 16, 1), "2xlarge": (8, 32, 1), "4xlarge": (16, 64, 1), "8xlarge": (32, 128, 1),
                                         "16xlarge": (64, 256, 1), "12xlarge": (48, 192, 4), "24xlarge": (96, 384, 4), "48xlarge": (192, 768, 8)}),
    "ml.g6": (GPU, "NVIDIA L4", 24, 0, {"xlarge": (4, 16, 1), "2xlarge": (8, 32, 1), "4xlarge": (16, 64, 1), "8xlarge": (32, 128, 1),
                                       "16xlarge": (64, 256, 1), "12xlarge": (48, 192, 4), "24xlarge": (96, 384, 4), "48xlarge": (192, 768, 8)}),
    "ml.g6e": (GPU, "NVIDIA L40S", 48, 0, {"xlarge": (4, 32, 1), "2xlarge": (8, 64, 1), "4xlarge": (16, 128, 1), "8xlarge": (32, 256, 1),
                                          "16xlarge": (64, 512, 1), "12xlarge": (48, 384, 4), "24xlarge": (96, 768, 4), "48xlarge": (192, 1536, 8)}),
    "ml.g7": (GPU, "NVIDIA RTX PRO 4500 Blackwell", 32, 0, {"2xlarge": (8, 32, 1), "4xlarge": (16, 64, 1), "8xlarge": (32, 128, 1),
                                                           "12xlarge": (48, 192, 2), "24xlarge": (96, 384, 4), "48xlarge": (192, 768, 8)}),
    "ml.g7e": (GPU, "NVIDIA RTX PRO 6000 Blackwell", 96, 0, {"2xlarge": (8, 64, 1), "4xlarge": (16, 128, 1), "8xlarge": (32, 256, 1),
                                                            "12xlarge": (48, 512, 2), "24xlarge": (96, 1024, 4), "48xlarge": (192, 2048, 8)}),
    "ml.trn1": (TRAINIUM, "AWS Trainium", 32, 2, {"2xlarge": (8, 32, 1), "32xlarge": (128, 512, 16)}),
    "ml.trn1n": (TRAINIUM, "AWS Trainium", 32, 2, {"32xlarge": (128, 512, 16)}),
    "ml.trn2": (TRAINIUM, "AWS Trainium2", 96, 4, {"48xlarge": (192, 2048, 16)}),
}

# The fallback prices (PRICE_SOURCE, PRICE_DATE). Types not here are priced live only.
_FALLBACK_USD_PER_HOUR: dict[str, float] = {
    "ml.c5.xlarge": 0.204, "ml.c5.2xlarge": 0.408, "ml.c5.4xlarge": 0.816, "ml.c5.9xlarge": 1.836, "ml.c5.18xlarge": 3.672,
    "ml.p3.2xlarge": 3.825, "ml.p4d.24xlarge": 37.688,
}


def _build() -> dict[str, InstanceType]:
    items: list[InstanceType] = []
    for family, (gib_per_vcpu, sizes) in _REGULAR_CPU_FAMILIES.items():
        for size in sizes.split():
            vcpus = size_vcpus(size)
            items.append(InstanceType(f"{family}.{size}", vcpus, 0, "", None, memory_gib=vcpus * gib_per_vcpu))
    items += [InstanceType(name, vcpus, 0, "", None, memory_gib=gib) for name, (vcpus, gib) in _IRREGULAR_CPU_TYPES.items()]
    for family, (kind, accelerator, memory_gb, cores_per_chip, sizes) in _ACCELERATED_FAMILIES.items():
        items += [InstanceType(f"{family}.{size}", vcpus, count, accelerator, None, neuron_cores=count * cores_per_chip, memory_gib=gib,
                               accelerator_kind=kind, accelerator_memory_gb=memory_gb)
                  for size, (vcpus, gib, count) in sizes.items()]
    catalog = {item.name: item for item in items}
    for name, usd in _FALLBACK_USD_PER_HOUR.items():
        catalog[name] = dataclasses.replace(catalog[name], usd_per_hour=usd)
    # Family by family, each from its smallest size up (as AWS's tables list them).
    return {item.name: item for item in sorted(catalog.values(), key=lambda item: (item.family, item.vcpus, item.accelerators, item.name))}


CATALOG: dict[str, InstanceType] = _build()


class UnknownInstanceTypeError(KeyError):
    pass


def instance_type(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownInstanceTypeError(f"instance type {name!r} is not in the catalog; known: {families()}") from None


def families(kind: str | None = None) -> list[str]:
    """The catalog's families ("ml.c5", "ml.g5", ...), sorted; with ``kind``, those of that accelerator
    kind only (CPU_ONLY, GPU, TRAINIUM)."""
    return sorted({item.family for item in CATALOG.values() if kind is None or item.accelerator_kind == kind})


def select(names: list[str] | tuple[str, ...]) -> list[InstanceType]:
    """The types each name means: a type ("ml.g5.xlarge"), or a family with or without its prefix ("ml.g5",
    "g5"), in the catalog's order; every type when none is given. Raises UnknownInstanceTypeError for a
    name that is neither. Pure."""
    if not names:
        return list(CATALOG.values())
    wanted: set[str] = set()
    for name in names:
        full = name if name.startswith("ml.") else f"ml.{name}"
        matched = {item.name for item in CATALOG.values() if full in (item.name, item.family)}
        if not matched:
            raise UnknownInstanceTypeError(f"{name!r} is neither an instance type nor a family of the catalog; families: {', '.join(families())}")
        wanted |= matched
    return [item for item in CATALOG.values() if item.name in wanted]
