"""Metric log lines: the one format trainers print and SageMaker's MetricDefinitions capture.

A timed step prints ``step=42/500 loss=2.3010 step_time_ms=86.1 data_wait_ms=40.2 samples_per_s=2977.1``.
Warm-up steps print ``warmup_ms=`` instead of ``step_time_ms=``, so that start-up and compilation never
reach the step-time metric. The launch side builds the job's MetricDefinitions from METRIC_DEFINITIONS.
"""

from __future__ import annotations

import re

# A number as the trainers print it: decimals, exponents, and the non-finite values (nan, inf, -inf) that
# are the evidence of a failing run, kept rather than dropped.
NUMBER = r"[-+]?(?:nan|inf|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
# Metric name → regex with one group, for CreateTrainingJob's AlgorithmSpecification.MetricDefinitions.
# Each key is preceded by a space or the line start so that no key matches inside another one.
METRIC_DEFINITIONS: dict[str, str] = {
    name: rf"(?:^|\s){name}=({NUMBER})"
    for name in ("step_time_ms", "data_wait_ms", "samples_per_s", "loss", "warmup_ms", "eval_accuracy")
}


# Times and rates print with one decimal; everything else (losses, accuracies, a workload's own metrics)
# with four significant digits.
TIMINGS = frozenset({"step_time_ms", "data_wait_ms", "samples_per_s", "warmup_ms"})


def metric_line(step: int, total_steps: int, values: dict[str, float]) -> str:
    return " ".join([f"step={step}/{total_steps}", *(f"{name}={value:.1f}" if name in TIMINGS else f"{name}={value:.4g}" for name, value in values.items())])


def parse_metric_line(line: str) -> dict[str, float]:
    """The values a MetricDefinitions regex would capture from one log line."""
    return {name: float(match.group(1)) for name, pattern in METRIC_DEFINITIONS.items() if (match := re.search(pattern, line))}
