"""The public reference tables, reproduced from their inputs to the percent."""

from __future__ import annotations

import pytest

from lambdas.core.catalog import UnknownInstanceTypeError
from lambdas.core.price_performance import FALLBACK_PRICES, Prices, cost_per_1k_steps, hourly_cost, improvement


def test_resnet50_on_p4d_plus_two_c5_18xlarge_is_46_percent_cheaper_per_step() -> None:
    baseline = cost_per_1k_steps(hourly_cost([("ml.p4d.24xlarge", 1)], FALLBACK_PRICES), 192)
    hetero = cost_per_1k_steps(hourly_cost([("ml.p4d.24xlarge", 1), ("ml.c5.18xlarge", 2)], FALLBACK_PRICES), 86)
    assert hourly_cost([("ml.p4d.24xlarge", 1), ("ml.c5.18xlarge", 2)], FALLBACK_PRICES) == pytest.approx(45.032)
    assert round(improvement(hetero, baseline) * 100) == 46


def test_mnist_on_p3_plus_one_c5_9xlarge_is_77_percent_cheaper_per_step() -> None:
    baseline = cost_per_1k_steps(hourly_cost([("ml.p3.2xlarge", 1)], FALLBACK_PRICES), 1193)
    hetero = cost_per_1k_steps(hourly_cost([("ml.p3.2xlarge", 1), ("ml.c5.9xlarge", 1)], FALLBACK_PRICES), 184)
    assert hourly_cost([("ml.p3.2xlarge", 1), ("ml.c5.9xlarge", 1)], FALLBACK_PRICES) == pytest.approx(5.661)
    assert round(improvement(hetero, baseline) * 100) == 77


def test_cost_per_1k_steps_is_dollars_per_hour_times_step_hours() -> None:
    assert cost_per_1k_steps(3.6, 1000) == pytest.approx(1.0)  # 1 s steps at $3.6/h: 1000 s = $1


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        cost_per_1k_steps(1.0, 0)
    with pytest.raises(ValueError):
        improvement(1.0, 0)
    with pytest.raises(UnknownInstanceTypeError):
        hourly_cost([("ml.z9.mega", 1)], FALLBACK_PRICES)
    with pytest.raises(KeyError, match="no price for ml.p3.2xlarge"):
        hourly_cost([("ml.p3.2xlarge", 1)], Prices({}, "empty table", "2026-01-01"))
