"""The kinds of value a ``GracefulConfig`` setting takes: pydantic types that say what is allowed.

Each kind is an ``Annotated`` type: pydantic's constraints check the value, and an ``Allowed``
marker carries the words a ``ConfigError`` shows the user ("a number of seconds > 0 and <=
86400"). The same words serve a bad ``RAY_GRACEFUL_*`` variable, which ``from_text`` parses.
"""

from __future__ import annotations

import os
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field

from .notices import short
from .word import Word

# The longest duration any setting may have: a day. Longer is a unit mistake (ms for s).
MAX_SECONDS = 86_400.0


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names it and what is allowed."""


@dataclass(frozen=True)
class Allowed:
    """What a setting allows, in the words its error shows (pydantic keeps it in the metadata)."""

    text: str


def allowed_text(metadata: list[Any]) -> str:
    """The ``Allowed`` words among a field's metadata."""
    return next(m.text for m in metadata if isinstance(m, Allowed))


# --- closed sets ---------------------------------------------------------------------------


class NodeAgentMode(Word):
    """Whether a node's ranks relay through one node agent."""

    AUTO = "auto"  # on for groups of 32 ranks or more
    ON = "on"
    OFF = "off"


class HealthProbe(Word):
    """Where a node's GPU health comes from."""

    AUTO = "auto"
    NVML = "nvml"
    NONE = "none"
    SCRIPTED = "scripted"  # tests and the demo


class TrainShards(Word):
    """What each rank of a Ray Train job holds."""

    PER_RANK = "per_rank"
    REPLICATED = "replicated"


class CloudNotices(Word):
    """Which cloud's metadata service a node polls for eviction notices."""

    OFF = "off"
    AUTO = "auto"
    AWS = "aws"
    GCE = "gce"
    AZURE = "azure"


def _one_of(modes: type[Word]) -> str:
    names = [repr(m.value) for m in modes]
    return " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)


def mode(modes: type[Word]) -> Any:
    """A setting that is one of ``modes``; the plain string works as well as the member."""
    return Annotated[modes, Field(strict=False), Allowed(_one_of(modes))]


# --- numbers -------------------------------------------------------------------------------


def seconds(low: float = 0.0, high: float = MAX_SECONDS, low_open: bool = True) -> Any:
    """A number of seconds in (low, high], or [low, high] with ``low_open=False``."""
    if low_open:
        bound = Field(gt=low, le=high, allow_inf_nan=False)
    else:
        bound = Field(ge=low, le=high, allow_inf_nan=False)
    sign = ">" if low_open else ">="
    return Annotated[float, bound, Allowed(f"a number of seconds {sign} {low:g} and <= {high:g}")]


def count(low: int, high: int, what: str) -> Any:
    """An integer in [low, high], ``what`` saying what it counts."""
    return Annotated[
        int, Field(ge=low, le=high), Allowed(f"{what}: an integer from {low} to {high}")
    ]


if TYPE_CHECKING:  # a checker sees the plain type; pydantic, the bounds
    Seconds = float
    SecondsOrZero = float
else:
    Seconds = seconds()
    SecondsOrZero = seconds(low_open=False)
ExitCode = Annotated[int, Field(ge=0, le=255), Allowed("an integer from 0 to 255")]
Switch = Annotated[bool, Allowed("true or false")]
Xids = Annotated[
    tuple[Annotated[int, Field(gt=0, lt=65536)], ...],
    Allowed("a tuple of XID numbers from 1 to 65535 (in the environment: '48,79,95')"),
]

# --- names and paths -----------------------------------------------------------------------


def _trimmed(value: str) -> str:
    if not value.strip() or value != value.strip() or "\0" in value:
        raise ValueError("empty, surrounded by spaces, or with a NUL")
    return value


def _trimmed_or_empty(value: str) -> str:
    return value if value == "" else _trimmed(value)


def _trimmed_or_none(value: str | None) -> str | None:
    return value if value is None else _trimmed(value)


Name = Annotated[
    str, AfterValidator(_trimmed), Allowed("a non-empty name without surrounding spaces")
]
NameOrEmpty = Annotated[
    str, AfterValidator(_trimmed_or_empty), Allowed("a non-empty name without surrounding spaces")
]
Path = Annotated[
    str, AfterValidator(_trimmed), Allowed("a non-empty path without surrounding spaces")
]
OptionalPath = Annotated[
    str | None,
    AfterValidator(_trimmed_or_none),
    Allowed("a non-empty path without surrounding spaces"),
]


def _absolute_dir_or_none(value: str | None) -> str | None:
    """``~`` expanded where it is given (the driver's home, not each rank's), then absolute: a
    relative path resolves against each process's own working directory."""
    if value is None:
        return None
    expanded = os.path.expanduser(_trimmed(value))
    if not os.path.isabs(expanded):
        raise ValueError("a relative path: each process would resolve it on its own")
    return os.path.normpath(expanded)


CheckpointDir = Annotated[
    str | None,
    AfterValidator(_absolute_dir_or_none),
    Allowed("an absolute path (~ is expanded), the same directory for every process of the job"),
]

# --- the environment's text ----------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_text(value: Any) -> str:
    """A value as its ``RAY_GRACEFUL_*`` variable writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(x) for x in value)
    return "" if value is None else str(value)


def from_text(name: str, raw: str, annotation: Any, allowed: str) -> Any:
    """The value a ``RAY_GRACEFUL_*`` variable ``name`` holds as ``raw``, or ConfigError.

    Only the text is read here; the range is the model's to check, so an out-of-range number
    gets the same error as it would as a keyword argument.
    """
    text = raw.strip()

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{name}={short(raw)} is not allowed: must be {what}.")

    base = (
        typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
    )
    optional = typing.get_origin(base) in (typing.Union, types.UnionType)
    if base is float or base is int:
        try:
            return base(text)
        except ValueError:
            raise bad(allowed) from None
    if base is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise bad("one of " + ", ".join(_TRUE + _FALSE))
    if typing.get_origin(base) is tuple:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise bad("comma-separated XID numbers, e.g. '48,79,95'") from None
    if optional:
        if raw == "":
            return None  # set but empty: unset, as for any optional setting
        if not text:
            raise bad("a non-empty path, or the empty string for none")
    return raw
