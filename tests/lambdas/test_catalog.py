"""The instance-type catalog: exactly SageMaker's training types, with hardware facts that hold together."""

from __future__ import annotations

import pytest

from lambdas.core.catalog import (
    CATALOG,
    CPU_ONLY,
    GPU,
    PRICE_DATE,
    TRAINIUM,
    UnknownInstanceTypeError,
    families,
    instance_type,
    select,
    size_vcpus,
)
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.service_limits import training_instance_types


def test_the_catalog_is_every_type_botocore_trains_on_and_no_other() -> None:
    """A botocore with a new training type fails here until the type is in lambdas/core/catalog.py; a
    misspelt catalog entry fails too."""
    botocore_types = training_instance_types()
    assert not botocore_types - CATALOG.keys(), f"add to the catalog: {sorted(botocore_types - CATALOG.keys())}"
    assert not CATALOG.keys() - botocore_types, f"not SageMaker training types: {sorted(CATALOG.keys() - botocore_types)}"


@pytest.mark.parametrize("item", CATALOG.values(), ids=list(CATALOG))
def test_each_types_hardware_holds_together(item) -> None:
    assert item.vcpus > 0 and item.memory_gib >= item.vcpus  # every type has at least 1 GiB per vCPU
    assert item.is_cpu_only == (item.accelerator_kind == CPU_ONLY) == (item.accelerator == "") == (item.accelerator_memory_gb == 0)
    assert item.accelerator_kind in (CPU_ONLY, GPU, TRAINIUM)
    assert item.is_trainium == (item.accelerator_kind == TRAINIUM) == item.accelerator.startswith("AWS Trainium")
    if item.accelerator_kind == GPU:
        assert item.accelerator.startswith("NVIDIA") and item.neuron_cores == 0
    if item.is_trainium:
        # Default NeuronCores: 2 per Trainium chip, 4 logical per Trainium2 chip (8 physical, LNC=2).
        assert item.neuron_cores == item.accelerators * (4 if item.accelerator == "AWS Trainium2" else 2)


@pytest.mark.parametrize("item", CATALOG.values(), ids=list(CATALOG))
def test_sizes_have_the_vcpus_their_names_say(item) -> None:
    size = item.name.rsplit(".", 1)[1]
    if size == "medium" or item.name == "ml.c4.8xlarge":  # t3.medium: 2; c4.8xlarge: 36, AWS's own exception
        return
    assert item.vcpus == size_vcpus(size)


def test_published_figures_spot_checked() -> None:
    """A few figures as AWS publishes them, so that a slip in a family's table shows."""
    facts = {
        "ml.p4d.24xlarge": (96, 1152, 8, 40), "ml.p5.48xlarge": (192, 2048, 8, 80), "ml.p5.4xlarge": (16, 256, 1, 80),
        "ml.g5.12xlarge": (48, 192, 4, 24), "ml.g4dn.16xlarge": (64, 256, 1, 16), "ml.g6e.48xlarge": (192, 1536, 8, 48),
        "ml.g7.12xlarge": (48, 192, 2, 32), "ml.g7e.48xlarge": (192, 2048, 8, 96), "ml.p6-b300.48xlarge": (192, 4096, 8, 268),
        "ml.trn1.32xlarge": (128, 512, 16, 32), "ml.trn2.48xlarge": (192, 2048, 16, 96),
        "ml.c5.18xlarge": (72, 144, 0, 0), "ml.c5n.18xlarge": (72, 192, 0, 0), "ml.r7i.48xlarge": (192, 1536, 0, 0), "ml.t3.medium": (2, 4, 0, 0),
    }
    for name, expected in facts.items():
        item = instance_type(name)
        assert (item.vcpus, item.memory_gib, item.accelerators, item.accelerator_memory_gb) == expected, name
    assert instance_type("ml.trn1.2xlarge").neuron_cores == 2 and instance_type("ml.trn1n.32xlarge").neuron_cores == 32
    assert instance_type("ml.trn2.48xlarge").neuron_cores == 64


def test_the_fallback_prices_are_the_dated_benchmark_tables_and_nothing_else() -> None:
    assert FALLBACK_PRICES.date == PRICE_DATE == "2022-07-01"
    assert FALLBACK_PRICES.usd_per_hour == {
        "ml.c5.xlarge": 0.204, "ml.c5.2xlarge": 0.408, "ml.c5.4xlarge": 0.816, "ml.c5.9xlarge": 1.836, "ml.c5.18xlarge": 3.672,
        "ml.p3.2xlarge": 3.825, "ml.p4d.24xlarge": 37.688,
    }
    assert all(item.usd_per_hour is None for item in CATALOG.values() if item.is_trainium)  # live prices only


def test_select_takes_types_and_families_in_the_catalogs_order() -> None:
    g5 = [item.name for item in select(("g5",))]
    assert g5 == [item.name for item in select(("ml.g5",))] and len(g5) == 8
    assert g5[0] == "ml.g5.xlarge" and g5[-1] == "ml.g5.48xlarge"  # smallest first, not "12xlarge" before "2xlarge"
    assert [item.name for item in select(("ml.c6i.8xlarge", "ml.g5.xlarge"))] == ["ml.c6i.8xlarge", "ml.g5.xlarge"]
    assert len(select(())) == len(CATALOG)
    with pytest.raises(UnknownInstanceTypeError, match="neither an instance type nor a family"):
        select(("ml.g5.huge",))
    assert "ml.g5" in families() and families(TRAINIUM) == ["ml.trn1", "ml.trn1n", "ml.trn2"]
    assert "ml.c6i" in families(CPU_ONLY) and "ml.g5" not in families(CPU_ONLY)
