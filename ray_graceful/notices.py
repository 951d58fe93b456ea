"""One validated type for every eviction notice, whatever its source.

Sources: Ray's drain state (with the node's deadline), a SIGTERM seen by a worker's listener,
an explicit ``notify`` (the CLI: Kubernetes preStop, SLURM ``--signal``), a health verdict
turning FAULTY, a registered rank's process found dead without any notice ("lost": SIGKILL,
OOM, a crash - its peers would otherwise sit in their collective until the watchdog), and the
Python API. A notice targets a node or one (group, rank); it carries a
deadline (Unix seconds; 0 when the source gives none) and the cycle it belongs to.

``EvictionNotice.parse`` takes untrusted input (CLI, JSON) and raises ``NoticeError`` with what
was wrong and what is allowed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

SOURCES = ("drain", "sigterm", "cli", "health", "lost", "api")
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600


class NoticeError(ValueError):
    """A notice is malformed; the message says what and what is allowed."""


@dataclass(frozen=True)
class EvictionNotice:
    source: str
    reason: str
    cycle: int
    deadline: float = 0.0
    node_id: str | None = None
    rank: tuple[str, int] | None = None
    received_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise NoticeError(f"source {self.source!r} is not allowed: one of {', '.join(SOURCES)}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise NoticeError("reason must be a non-empty string (why the node or rank goes)")
        if len(self.reason) > 500:
            raise NoticeError(f"reason is {len(self.reason)} characters; at most 500 allowed")
        if not isinstance(self.cycle, int) or isinstance(self.cycle, bool) or self.cycle < 0:
            raise NoticeError(f"cycle {self.cycle!r} is not allowed: an integer >= 0")
        if (self.node_id is None) == (self.rank is None):
            raise NoticeError("a notice targets exactly one of node_id or rank")
        if self.node_id is not None and (
            not isinstance(self.node_id, str) or not self.node_id.strip()
        ):
            raise NoticeError(f"node_id {self.node_id!r} is not allowed: a Ray node id (hex)")
        if self.rank is not None:
            ok = (
                isinstance(self.rank, tuple)
                and len(self.rank) == 2
                and isinstance(self.rank[0], str)
                and bool(self.rank[0])
                and isinstance(self.rank[1], int)
                and not isinstance(self.rank[1], bool)
                and self.rank[1] >= 0
            )
            if not ok:
                raise NoticeError(f"rank {self.rank!r} is not allowed: a (group, rank >= 0) pair")
        deadline = self.deadline
        if (
            not isinstance(deadline, (int, float))
            or isinstance(deadline, bool)
            or not math.isfinite(deadline)
            or deadline < 0
        ):
            raise NoticeError(f"deadline {deadline!r} is not allowed: Unix seconds, or 0 for none")
        if deadline > self.received_at + MAX_DEADLINE_AHEAD_S:
            raise NoticeError(
                f"deadline {deadline} is more than 7 days ahead: it looks like milliseconds; "
                "give Unix seconds"
            )

    @property
    def target(self) -> str:
        return f"node {self.node_id}" if self.node_id else f"rank {self.rank[0]}/{self.rank[1]}"

    def effective_deadline(self, default_timeout_s: float) -> float:
        """The deadline, or ``received_at + default_timeout_s`` when the source gave none."""
        return self.deadline or self.received_at + default_timeout_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rank"] = list(self.rank) if self.rank else None
        return data

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> EvictionNotice:
        """Build from untrusted input (JSON, CLI); unknown keys and wrong types are errors."""
        if not isinstance(data, Mapping):
            raise NoticeError(f"a notice is a mapping, got {type(data).__name__}")
        allowed = {"source", "reason", "cycle", "deadline", "node_id", "rank", "received_at"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise NoticeError(f"unknown notice fields {unknown}; allowed: {sorted(allowed)}")
        missing = [k for k in ("source", "reason", "cycle") if k not in data]
        if missing:
            raise NoticeError(f"notice fields {missing} are required")
        values = dict(data)
        rank = values.get("rank")
        if rank is not None:
            if not isinstance(rank, (list, tuple)) or len(rank) != 2:
                raise NoticeError(f"rank {rank!r} is not allowed: [group, rank]")
            values["rank"] = (rank[0], rank[1])
        return cls(**values)
