"""What each setting of ``GracefulConfig`` allows: one check per kind of value.

Each check returns None when a value is fine, else a description of what is allowed - the
words a ``ConfigError`` (and an environment variable's error) shows the user.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# The longest duration any setting may have: a day. Longer is a unit mistake (ms for s).
MAX_SECONDS = 86_400.0
HEALTH_PROBES = ("auto", "nvml", "none", "scripted")


def between(low: float, high: float, low_open: bool = True) -> Callable[[Any], str | None]:
    """A check for a number of seconds in (low, high] (or [low, high] with low_open=False)."""
    sign = ">" if low_open else ">="

    def check(value: Any) -> str | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        above = ok and math.isfinite(value) and (value > low if low_open else value >= low)
        if above and value <= high:
            return None
        return f"a number of seconds {sign} {low:g} and <= {high:g}"

    return check


seconds = between(0.0, MAX_SECONDS)
seconds_or_zero = between(0.0, MAX_SECONDS, low_open=False)


def exit_code(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255:
        return None
    return "an integer from 0 to 255"


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def name(value: Any) -> str | None:
    if isinstance(value, str) and value.strip() and value == value.strip():
        return None
    return "a non-empty name without surrounding spaces"


def optional_name(value: Any) -> str | None:
    return None if value == "" else name(value)


def path(value: Any) -> str | None:
    if isinstance(value, str) and value.strip() and value == value.strip() and "\0" not in value:
        return None
    return "a non-empty path without surrounding spaces"


def optional_path(value: Any) -> str | None:
    return None if value is None else path(value)


def xids(value: Any) -> str | None:
    if isinstance(value, tuple) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 < x < 65536 for x in value
    ):
        return None
    return "a tuple of XID numbers from 1 to 65535 (in the environment: '48,79,95')"


def probe(value: Any) -> str | None:
    if value in HEALTH_PROBES:
        return None
    return "one of " + ", ".join(repr(p) for p in HEALTH_PROBES)


def cloud(value: Any) -> str | None:
    allowed = ("off", "auto", "aws", "gce", "azure")
    return None if value in allowed else "one of " + ", ".join(repr(a) for a in allowed)


def train_shards(value: Any) -> str | None:
    return None if value in ("per_rank", "replicated") else "'per_rank' or 'replicated'"


def count(low: int, high: int, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
            return None
        return f"{what}: an integer from {low} to {high}"

    return check
