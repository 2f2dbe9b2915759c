"""Cost per step and price-performance: the figures the platform exists to prove.

cost per 1k steps = Σ over groups (count × $/hour) × step seconds × 1000 / 3600
improvement vs a baseline = 1 − cost / baseline cost

Pure arithmetic; the prices' source and date travel with every figure that uses them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
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


def given_price(text: str) -> tuple[str, float]:
    """``TYPE=USD_PER_HOUR`` (a `--price` option) as (instance type, $/hour): a type the catalog knows and a
    positive, finite price; ValueError naming what is wrong. Pure."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"--price takes TYPE=USD_PER_HOUR (ml.g5.xlarge=1.41), got {text!r}")
    try:
        instance_type(name)
    except LookupError as error:  # UnknownInstanceTypeError: the name, and the families the catalog has
        raise ValueError(f"--price {text}: {error.args[0]}") from None
    try:
        usd = float(value)
    except ValueError:
        usd = math.nan
    if not math.isfinite(usd) or usd <= 0:
        raise ValueError(f"--price {text}: the $/hour must be a positive number")
    return name, usd


def with_given(prices: Prices, given: Mapping[str, float]) -> Prices:
    """``prices`` with the $/hour a user gave (``--price``) in place of the table's, its source saying so. Pure."""
    if not given:
        return prices
    return Prices({**prices.usd_per_hour, **given}, f"{prices.source}; given with --price for {', '.join(sorted(given))}", prices.date)


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
