"""Validate a job spec (the execution input) with the deployment's policy (allowed input buckets, cost
ceiling: lambdas/core/job_spec.py). A refusal raises JobSpecError, which the state machine turns into a
failed execution naming the field; nothing has been launched at that point."""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools import Logger

from lambdas.core.job_spec import SpecPolicy, cost_ceiling_usd, validate_job_spec, worst_case_cost_usd

logger = Logger(service="validate-spec")


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    policy = SpecPolicy.from_environment(os.environ)
    spec = validate_job_spec(event, policy)
    ceiling = cost_ceiling_usd(spec, policy)
    logger.info("valid spec", extra={"run_name": spec.run_name, "variant": spec.variant, "groups": len(spec.instance_groups)})
    return {
        "run_name": spec.run_name,
        "variant": spec.variant,
        "heterogeneous": spec.is_heterogeneous,
        "instances": sum(group.count for group in spec.instance_groups),
        "worst_case_cost_usd": round(worst_case_cost_usd(spec, policy), 2) if ceiling is not None else None,
        "cost_ceiling_usd": ceiling,
    }
