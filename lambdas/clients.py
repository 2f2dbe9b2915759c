"""boto3 clients for the Lambda handlers, made on first use (never at import), one per service and
process, so that a warm Lambda reuses its connections and tests can run handlers under moto."""

from __future__ import annotations

import functools
from typing import Any

import boto3
from botocore.config import Config

# Standard retry mode backs off on throttling: up to 4 retries (5 attempts) per call; the state machine
# retries what still fails.
CONFIG = Config(retries={"mode": "standard", "total_max_attempts": 5})


@functools.cache
def client(service: str) -> Any:
    return boto3.client(service, config=CONFIG)


@functools.cache
def pricing_client() -> Any:
    """The Price List API answers only in a few regions (us-east-1 among them), for every region."""
    from lambdas.core.pricing import PRICING_REGION

    return boto3.client("pricing", region_name=PRICING_REGION, config=CONFIG)
