"""Cost per step and price-performance: the figures the platform exists to prove.

cost per 1k steps = Σ over groups (count × $/hour) × step seconds × 1000 / 3600
improvement vs a baseline = 1 − cost / baseline cost

Pure arithmetic; the prices' source and date travel with every figure that uses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lambdas.core.catalog import CATALOG, PRICE_DATE, PRICE_SOURCE, instance_type


@dataclass(frozen=True)
class Prices:
    usd_per_hour: dict[str, float]
    source: str
    date: str


FALLBACK_PRICES = Prices(
    usd_per_hour={name: item.usd_per_hour for name, item in CATALOG.items() if item.usd_per_hour is not None},
    source=PRICE_SOURCE,
    date=PRICE_DATE,
)


def hourly_cost(groups: Iterable[tuple[str, int]], prices: Prices) -> float:
    """$/hour of a cluster given as (instance type, count) pairs."""
    total = 0.0
    for name, count in groups:
        instance_type(name)  # unknown types are refused by name
        if name not in prices.usd_per_hour:
            raise KeyError(f"no price for {name} in {prices.source} ({prices.date})")
        total += count * prices.usd_per_hour[name]
    return total


def cost_per_1k_steps(usd_per_hour: float, step_ms: float) -> float:
    if usd_per_hour < 0 or step_ms <= 0:
        raise ValueError(f"need a non-negative price and a positive step time, got {usd_per_hour} $/h, {step_ms} ms")
    return usd_per_hour * (step_ms / 1000) * 1000 / 3600


def improvement(cost: float, baseline_cost: float) -> float:
    """Fraction saved against the baseline (0.46 = 46% cheaper per step; negative = dearer)."""
    if baseline_cost <= 0:
        raise ValueError(f"baseline cost must be positive, got {baseline_cost}")
    return 1 - cost / baseline_cost
