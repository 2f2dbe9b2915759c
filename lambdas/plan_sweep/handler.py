"""Plan a benchmark sweep: validate its input and expand it into job specs, one per configuration.

Event: {"input": <sweep input, see lambdas/core/sweep.py>, "execution_name": <the sweep execution's name>}.
A refusal raises SweepSpecError naming the field; the state machine fails before any job is launched.
Each configuration gets the name of the training-run execution that will run it
(``<sweep id>-<index>``), so its results land under results/<that name>/.
"""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools import Logger

from lambdas.core.job_spec import RUN_ID, SpecPolicy
from lambdas.core.sweep import SweepSpecError, plan_sweep

logger = Logger(service="plan-sweep")

# Step Functions execution names are at most 80 characters; "-<index>" takes up to 3.
MAX_SWEEP_ID = 77


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    plan = plan_sweep(event["input"], SpecPolicy.from_environment(os.environ)).to_json()
    sweep_id = event["execution_name"]
    # Never cut: two sweeps whose names share their first 77 characters would share configurations'
    # executions and benchmarks/<sweep id>/.
    if not RUN_ID.fullmatch(sweep_id) or len(sweep_id) > MAX_SWEEP_ID:
        raise SweepSpecError("execution_name", f"{sweep_id!r}: each configuration runs as <execution name>-<index>, which must be "
                                               f"letters, digits, '-' and '_', at most {MAX_SWEEP_ID + 3} in all: start the sweep "
                                               f"under such a name (≤ {MAX_SWEEP_ID} characters)")
    for configuration in plan["configurations"]:
        configuration["execution_name"] = f"{sweep_id}-{configuration['index']}"
    logger.info("sweep planned", extra={"sweep_id": sweep_id, "configurations": [c["name"] for c in plan["configurations"]]})
    return plan | {"sweep_id": sweep_id}
