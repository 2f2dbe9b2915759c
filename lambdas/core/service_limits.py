"""SageMaker's own limits on the CreateTrainingJob fields a job spec becomes, read from botocore's
service model (the model every AWS SDK is generated from) rather than copied by hand, so that a spec the
platform accepts is one the service accepts, and a new botocore brings new limits with it.

botocore itself checks only types and minimums before sending; the maximum lengths, list sizes and
patterns below are what the service checks, and what a job spec is checked against before launch. The
model's patterns are Java regular expressions matched against the whole value; Python's ``re.fullmatch``
does the same for the ones used here (no ``\\p{...}`` classes; a test holds that true). Pure once loaded.

    python -c "from lambdas.core.service_limits import limit; print(limit('S3Uri'))"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import botocore.session


@dataclass(frozen=True)
class Limit:
    """One shape of the SageMaker model: a string's length and pattern, a list's or map's size, a
    number's minimum (the model gives some no maximum)."""

    shape: str
    min: int | None
    max: int | None
    pattern: re.Pattern[str] | None

    def problem(self, value: str | list | dict) -> str | None:
        """What is wrong with ``value`` by this limit, or None. Pure."""
        size = len(value)
        if self.min is not None and size < self.min:
            return f"SageMaker's {self.shape} takes at least {self.min}, got {size}"
        if self.max is not None and size > self.max:
            return f"SageMaker's {self.shape} takes at most {self.max}, got {size}"
        if self.pattern is not None and isinstance(value, str) and not self.pattern.fullmatch(value):
            return f"SageMaker's {self.shape} must match {self.pattern.pattern}"
        return None


@cache
def _model():
    return botocore.session.get_session().get_service_model("sagemaker")


@cache
def limit(shape: str) -> Limit:
    """The named shape's limits (e.g. ``ChannelName``, ``S3Uri``, ``InputDataConfig``)."""
    metadata = _model().shape_for(shape).metadata
    pattern = metadata.get("pattern")
    return Limit(shape, metadata.get("min"), metadata.get("max"), re.compile(pattern) if pattern else None)


@cache
def training_instance_types() -> frozenset[str]:
    """Every instance type CreateTrainingJob accepts (the TrainingInstanceType enum)."""
    return frozenset(_model().shape_for("TrainingInstanceType").enum)
