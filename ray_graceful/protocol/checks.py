"""What every message is checked against where it arrives: its protocol version and the bounds
of its fields. A message that fails raises ``ProtocolError``, whose text names the field and
what is allowed; the coordinator turns that into a refusal, never a traceback."""

from __future__ import annotations

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message is malformed; the message says which field and what is allowed."""


def check_version(message: object) -> None:
    version = getattr(message, "version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{type(message).__name__} has protocol version {version!r}, this coordinator speaks "
            f"{PROTOCOL_VERSION}: run the same ray_graceful on the driver and the workers"
        )


def check_text(value: object, name: str, limit: int = 200) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{name} must be a string of at most {limit} characters")


def check_count(value: object, name: str) -> None:
    """An integer >= 0 (a rank, a size, a pid); a bool is not one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{name} must be an integer >= 0")
