"""What each setting of ``GracefulConfig`` allows: one check per kind of value.

Each check returns None when a value is fine, else a description of what is allowed - the
words a ``ConfigError`` (and an environment variable's error) shows the user.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .notices import short

# The longest duration any setting may have: a day. Longer is a unit mistake (ms for s).
MAX_SECONDS = 86_400.0
HEALTH_PROBES = ("auto", "nvml", "none", "scripted")
NODE_AGENT_MODES = ("auto", "on", "off")


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names it and what is allowed."""


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


def node_agent(value: Any) -> str | None:
    return None if value in NODE_AGENT_MODES else "one of " + ", ".join(map(repr, NODE_AGENT_MODES))


def train_shards(value: Any) -> str | None:
    return None if value in ("per_rank", "replicated") else "'per_rank' or 'replicated'"


def count(low: int, high: int, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
            return None
        return f"{what}: an integer from {low} to {high}"

    return check


def env_text(value: Any) -> str:
    """A value as its ``RAY_GRACEFUL_*`` variable writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(x) for x in value)
    return "" if value is None else str(value)


def parse_env_text(name: str, raw: str, f: dataclasses.Field) -> Any:
    """The value of setting ``f`` that variable ``name`` holds as ``raw``, or ConfigError."""
    text = raw.strip()
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))

    def bad(allowed: str) -> ConfigError:
        return ConfigError(f"{name}={short(raw)} is not allowed: must be {allowed}.")

    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise bad(f.metadata["check"]("x") or "a number") from None
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise bad(f.metadata["check"]("x") or "an integer") from None
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise bad("one of 1, true, yes, on, 0, false, no, off")
    if kind.startswith("tuple"):
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise bad("comma-separated XID numbers, e.g. '48,79,95'") from None
    if kind == "str | None":
        if raw == "":
            return None  # set but empty: unset, as for any optional setting
        if not text:
            raise bad("a non-empty path, or the empty string for none")
        return raw
    return raw
