"""SageMaker training prices: the AWS Price List API, cached in S3 for the day, else the dated fallback.

Every Prices value says where its figures came from and when, so a report never passes off a 2022 table
as today's price:

* "AWS Price List API" with the day it was read (the first sweep of a day asks the API and stores the
  answer under ``prices/<region>/<day>.json``; later ones that day read that file);
* the fallback table (lambdas/core/catalog.py) with its date, when the API fails or has no price for a
  type; a type priced from the fallback while others are live is named in the source.

The Price List API answers in us-east-1 (and a few other regions) for every region; products are
filtered by region code and instance name, and only SageMaker *training* usage (``...-Train:<type>``)
counts.

``parse_price_list`` is pure; ``prices_for`` does the I/O, with clients passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from lambdas.core.price_performance import FALLBACK_PRICES, Prices

API_SOURCE = "AWS Price List API (SageMaker on-demand training)"
# The Price List API's own endpoint region; it prices every region.
PRICING_REGION = "us-east-1"


class PriceListError(RuntimeError):
    """The Price List API answered with something we cannot read."""


def parse_price_list(price_list: Iterable[str], region: str) -> dict[str, float]:
    """$/hour of each instance type's on-demand SageMaker training usage in ``region``, from GetProducts'
    PriceList entries (JSON strings)."""
    prices: dict[str, float] = {}
    for entry in price_list:
        product = json.loads(entry) if isinstance(entry, str) else entry
        attributes = product.get("product", {}).get("attributes", {})
        name = attributes.get("instanceName") or attributes.get("instanceType")
        usage = attributes.get("usagetype", "")
        if not name or attributes.get("regionCode", region) != region or f"Train:{name}" not in usage:
            continue
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                if dimension.get("unit") not in ("Hrs", "Hours", "hour"):
                    continue
                try:
                    usd = float(dimension["pricePerUnit"]["USD"])
                except (KeyError, ValueError) as error:
                    raise PriceListError(f"unreadable price for {name}: {dimension}") from error
                if usd > 0:
                    prices[name] = usd
    return prices


def live_prices(pricing: Any, region: str, instance_types: Iterable[str]) -> dict[str, float]:
    """What the Price List API says today for each type (types it does not price are left out)."""
    prices: dict[str, float] = {}
    for name in sorted(set(instance_types)):
        filters = [
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "instanceName", "Value": name},
        ]
        for page in pricing.get_paginator("get_products").paginate(ServiceCode="AmazonSageMaker", Filters=filters):
            prices |= {key: value for key, value in parse_price_list(page["PriceList"], region).items() if key == name}
    return prices


def combine(live: dict[str, float], day: str, instance_types: Iterable[str], cached: bool = False) -> Prices:
    """Live prices where known, the fallback for the rest; the source says which is which."""
    wanted = sorted(set(instance_types))
    missing = [name for name in wanted if name not in live and name in FALLBACK_PRICES.usd_per_hour]
    source = API_SOURCE + (" (cached)" if cached else "")
    if missing:
        source += f"; {FALLBACK_PRICES.source} ({FALLBACK_PRICES.date}) for {', '.join(missing)}"
    return Prices(usd_per_hour=dict(live) | {name: FALLBACK_PRICES.usd_per_hour[name] for name in missing}, source=source, date=day)


def fallback(reason: str) -> Prices:
    return Prices(usd_per_hour=dict(FALLBACK_PRICES.usd_per_hour), source=f"{FALLBACK_PRICES.source} (live prices unavailable: {reason})",
                  date=FALLBACK_PRICES.date)


def cache_key(region: str, day: str) -> str:
    return f"prices/{region}/{day}.json"


def prices_for(instance_types: Iterable[str], *, region: str, day: str, pricing: Any, s3: Any, bucket: str) -> Prices:
    """Today's prices for these types: the day's cached answer, else the API (then cached), else the
    fallback table. Never raises for an API or cache failure: a sweep's report still comes out."""
    wanted = sorted(set(instance_types))
    key = cache_key(region, day)
    try:
        cached = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        if set(wanted) <= set(cached["usd_per_hour"]) | set(cached.get("unpriced", [])):
            return combine(cached["usd_per_hour"], day, wanted, cached=True)
    except ClientError as error:
        if error.response["Error"]["Code"] not in ("NoSuchKey", "404"):
            return fallback(f"price cache unreadable: {error.response['Error']['Code']}")
    try:
        live = live_prices(pricing, region, wanted)
    except (ClientError, BotoCoreError, PriceListError) as error:
        return fallback(_reason(error))
    document = {"usd_per_hour": live, "unpriced": [name for name in wanted if name not in live], "source": API_SOURCE, "date": day}
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(document, indent=2).encode(), ContentType="application/json")
    except ClientError:
        pass  # the prices are good; only tomorrow's first sweep asks the API again
    return combine(live, day, wanted)


def _reason(error: Exception) -> str:
    if isinstance(error, ClientError):
        return f"{error.response['Error']['Code']}: {error.response['Error'].get('Message', '')}".strip()
    return f"{type(error).__name__}: {error}"
