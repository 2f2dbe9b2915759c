"""lambdas/core/pricing.py: Price List API answers parsed, cached in S3 for the day, and the dated
fallback when the API fails. The Price List API is stubbed at the network boundary with botocore's
Stubber (which validates every request against the service model); S3 is moto's."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import Stubber

from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.pricing import API_SOURCE, cache_key, parse_price_list, prices_for
from tests.lambdas.conftest import RESULTS_BUCKET

DAY = "2026-11-29"


def product(instance: str, usd: str, usage: str | None = None, region: str = "us-east-1") -> str:
    """One PriceList entry, shaped as GetProducts returns it for SageMaker."""
    return json.dumps({
        "product": {"productFamily": "ML Instance", "attributes": {
            "instanceName": instance, "regionCode": region, "usagetype": usage or f"USE1-Train:{instance}", "component": "Training",
        }},
        "terms": {"OnDemand": {"SKU.JRTCKXETXF": {"priceDimensions": {"SKU.JRTCKXETXF.6YS6EN2CT7": {
            "unit": "Hrs", "pricePerUnit": {"USD": usd}, "description": f"${usd} per {instance} training hour",
        }}}}},
    })


def test_only_training_usage_in_the_region_counts() -> None:
    entries = [
        product("ml.p4d.24xlarge", "37.6880000000"),
        product("ml.p4d.24xlarge", "40.1", usage="USE1-Host:ml.p4d.24xlarge"),  # hosting, not training
        product("ml.c5.18xlarge", "3.9", region="eu-west-1"),  # another region
        product("ml.c5.18xlarge", "3.672"),
    ]
    assert parse_price_list(entries, "us-east-1") == {"ml.p4d.24xlarge": 37.688, "ml.c5.18xlarge": 3.672}


def stubbed_pricing(answers: dict[str, str]) -> tuple[object, Stubber]:
    pricing = boto3.client("pricing", region_name="us-east-1")
    stubber = Stubber(pricing)
    for instance in sorted(answers):
        stubber.add_response(
            "get_products",
            {"PriceList": [product(instance, answers[instance])], "FormatVersion": "aws_v1"},
            {"ServiceCode": "AmazonSageMaker", "Filters": [
                {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-1"},
                {"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance},
            ]},
        )
    return pricing, stubber


def test_live_prices_are_cached_for_the_day_and_read_back(aws) -> None:
    pricing, stubber = stubbed_pricing({"ml.c5.9xlarge": "1.944", "ml.p3.2xlarge": "3.825"})
    with stubber:
        prices = prices_for(["ml.p3.2xlarge", "ml.c5.9xlarge"], region="us-east-1", day=DAY, pricing=pricing, s3=aws.s3, bucket=RESULTS_BUCKET)
        stubber.assert_no_pending_responses()
    assert prices.usd_per_hour == {"ml.c5.9xlarge": 1.944, "ml.p3.2xlarge": 3.825}
    assert (prices.source, prices.date) == (API_SOURCE, DAY)
    cached = json.loads(aws.s3.get_object(Bucket=RESULTS_BUCKET, Key=cache_key("us-east-1", DAY))["Body"].read())
    assert cached["usd_per_hour"]["ml.c5.9xlarge"] == 1.944
    # Same day again: read from the cache, no API call (the stubber has no response left to give).
    again = prices_for(["ml.c5.9xlarge"], region="us-east-1", day=DAY, pricing=pricing, s3=aws.s3, bucket=RESULTS_BUCKET)
    assert again.usd_per_hour["ml.c5.9xlarge"] == 1.944 and again.source == API_SOURCE + " (cached)"


def test_a_type_the_api_does_not_price_falls_back_by_name(aws) -> None:
    pricing = boto3.client("pricing", region_name="us-east-1")
    with Stubber(pricing) as stubber:
        stubber.add_response("get_products", {"PriceList": [product("ml.p4d.24xlarge", "37.688")], "FormatVersion": "aws_v1"})
        stubber.add_response("get_products", {"PriceList": [], "FormatVersion": "aws_v1"})
        prices = prices_for(["ml.p4d.24xlarge", "ml.c5.18xlarge"], region="us-east-1", day=DAY, pricing=pricing, s3=aws.s3, bucket=RESULTS_BUCKET)
    assert prices.usd_per_hour == {"ml.p4d.24xlarge": 37.688, "ml.c5.18xlarge": FALLBACK_PRICES.usd_per_hour["ml.c5.18xlarge"]}
    assert "for ml.c5.18xlarge" in prices.source and FALLBACK_PRICES.date in prices.source


@pytest.mark.parametrize("code", ["ThrottlingException", "AccessDeniedException", "InternalErrorException"])
def test_an_api_error_gives_the_dated_fallback_and_says_why(aws, code: str) -> None:
    pricing = boto3.client("pricing", region_name="us-east-1")
    with Stubber(pricing) as stubber:
        stubber.add_client_error("get_products", service_error_code=code, service_message="no prices today")
        prices = prices_for(["ml.p3.2xlarge"], region="us-east-1", day=DAY, pricing=pricing, s3=aws.s3, bucket=RESULTS_BUCKET)
    assert prices.usd_per_hour == FALLBACK_PRICES.usd_per_hour and prices.date == FALLBACK_PRICES.date
    assert f"live prices unavailable: {code}: no prices today" in prices.source
    assert "Contents" not in aws.s3.list_objects_v2(Bucket=RESULTS_BUCKET, Prefix="prices/")  # nothing cached from a failure
