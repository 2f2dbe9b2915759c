"""SageMaker's own limits on the CreateTrainingJob fields a job spec becomes, read from botocore's
service model (the model every AWS SDK is generated from) rather than copied by hand, so that a spec the
platform accepts is one the service accepts, and a new botocore brings new limits with it.

botocore itself checks only types and minimums before sending; the maximum lengths, list sizes and
patterns below are what the service checks, and what a job spec is checked against before launch. The
service is Java: its patterns are Java regular expressions matched against the whole value, where ``.``
matches no line terminator (``\n``, ``\r``, U+0085, U+2028, U+2029), and its lengths count UTF-16 code
units (an emoji is two). ``java_pattern`` and ``java_length`` carry both over; the patterns used here
have no ``\\p{...}`` classes (a test holds that true). Pure once loaded.

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
    pattern_text: str = ""  # as the model writes it (Java), for messages

    def problem(self, value: str | list | dict) -> str | None:
        """What is wrong with ``value`` by this limit, or None. Pure."""
        size = java_length(value) if isinstance(value, str) else len(value)
        if self.min is not None and size < self.min:
            return f"SageMaker's {self.shape} takes at least {self.min}, got {size}"
        if self.max is not None and size > self.max:
            return f"SageMaker's {self.shape} takes at most {self.max}, got {size}"
        if self.pattern is not None and isinstance(value, str) and not self.pattern.fullmatch(value):
            return f"SageMaker's {self.shape} must match {self.pattern_text}"
        return None


@cache
def _model():
    return botocore.session.get_session().get_service_model("sagemaker")


@cache
def limit(shape: str) -> Limit:
    """The named shape's limits (e.g. ``ChannelName``, ``S3Uri``, ``InputDataConfig``)."""
    metadata = _model().shape_for(shape).metadata
    pattern = metadata.get("pattern")
    return Limit(shape, metadata.get("min"), metadata.get("max"), java_pattern(pattern) if pattern else None, pattern or "")


# What Java's "." does not match (java.util.regex without DOTALL).
LINE_TERMINATORS = "\n\r\u0085\u2028\u2029"


def java_pattern(pattern: str) -> re.Pattern[str]:
    """A Java pattern as Python must write it to match the same strings: every "." outside a character
    class becomes "any character but a line terminator" (Python's "." excludes only "\\n"). Pure."""
    out, in_class, index = [], False, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            out.append(pattern[index:index + 2])
            index += 2
            continue
        if char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        out.append(f"[^{LINE_TERMINATORS}]" if char == "." and not in_class else char)
        index += 1
    return re.compile("".join(out))


def java_length(text: str) -> int:
    """A string's length as Java counts it: UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


@cache
def training_instance_types() -> frozenset[str]:
    """Every instance type CreateTrainingJob accepts (the TrainingInstanceType enum)."""
    return frozenset(_model().shape_for("TrainingInstanceType").enum)
