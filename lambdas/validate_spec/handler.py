"""Validate a job spec (the execution input). A refusal raises JobSpecError, which the state machine
turns into a failed execution naming the field; nothing has been launched at that point."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger

from lambdas.core.job_spec import validate_job_spec

logger = Logger(service="validate-spec")


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    spec = validate_job_spec(event)
    logger.info("valid spec", extra={"run_name": spec.run_name, "variant": spec.variant, "groups": len(spec.instance_groups)})
    return {
        "run_name": spec.run_name,
        "variant": spec.variant,
        "heterogeneous": spec.is_heterogeneous,
        "instances": sum(group.count for group in spec.instance_groups),
    }
