"""``Word``: a closed set of words, as an enum that is also its plain string.

A ``Word`` compares equal to, prints as and serialises (JSON) as its value, so a record read
back from an outcome file or a log still matches ``Result.COMMITTED`` or ``"committed"``, and
a setting given as ``"on"`` is ``NodeAgentMode.ON``. A leaf module: the protocol's words, the
config's modes, a shard's tier and a call's failure all build on it without importing each
other.
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A closed set of words: compares, prints and serialises (JSON) as its plain string."""

    def __str__(self) -> str:
        return str(self.value)
