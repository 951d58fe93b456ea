"""One validated type for every eviction notice, whatever its source.

Sources: Ray's drain state (with the node's deadline), a SIGTERM seen by a worker's listener,
an explicit ``notify`` (the CLI: Kubernetes preStop, SLURM ``--signal``), a health verdict
turning FAULTY, a registered rank's process found dead without any notice ("lost": SIGKILL,
OOM, a crash - its peers would otherwise sit in their collective until the watchdog), a host
gone silent ("host_lost": the coordinator's host watch, about a second after it went quiet),
and the Python API. A notice targets a node or one (group, rank); it carries a
deadline (Unix seconds; 0 when the source gives none) and the cycle it belongs to.

``EvictionNotice.parse`` takes untrusted input (CLI, JSON) and raises ``NoticeError`` with what
was wrong and what is allowed. Untrusted input may not give a deadline that has already passed
(a Unix time given where seconds-from-now were meant - ``--deadline 30`` - would otherwise fire
every rank's watchdog at once, with no save); the message names the fix.
"""

from __future__ import annotations

import math
import reprlib
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .word import Word


class Source(Word):
    """Who gave a notice; compares and serialises as its string."""

    DRAIN = "drain"  # Ray drains the node (autoscaler, preemption, ``ray drain-node``)
    SIGTERM = "sigterm"  # a rank's process got SIGTERM
    CLI = "cli"  # ``ray-graceful notify``, a preStop hook, SLURM
    HEALTH = "health"  # NVML found the GPU FAULTY
    LOST = "lost"  # a rank's actor died without a word
    HOST_LOST = "host_lost"  # the host watch: a host went silent and did not answer the probe
    API = "api"  # ``Coordinator.notify``
    CLOUD = "cloud"  # a cloud's metadata service
    REJOIN = "rejoin"  # a warm restart failed: its members are ended through a cycle

    @property
    def planned_at_once(self) -> bool:
        """Whether a node noticed this way is planned for as soon as every process on it is
        counted (``Cycle.cover``): a drain and a SIGTERM reach every process of the node at
        once; the others may be followed by more within the gathering window."""
        return self in (Source.DRAIN, Source.SIGTERM)


SOURCES = tuple(source.value for source in Source)
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600
MAX_NAME = 200  # a node id or group name: Ray's node ids are 56 hex digits
MAX_RANK = 1 << 24  # 16,777,216 ranks in one group


def short(value: Any, limit: int = 120) -> str:
    """A bounded ``repr(value)``: error messages stay small whatever came in.

    ``reprlib`` stops at a few levels and items, so even a YAML alias bomb (a few lines that
    expand to gigabytes when printed in full) costs nothing to show.
    """
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 80, 80


def _finite_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class NoticeError(ValueError):
    """A notice is malformed; the message says what and what is allowed."""


@dataclass(frozen=True)
class EvictionNotice:
    source: Source  # given as its string too ("drain"), and checked
    reason: str
    cycle: int
    deadline: float = 0.0
    node_id: str | None = None
    rank: tuple[str, int] | None = None
    received_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or self.source not in SOURCES:
            raise NoticeError(
                f"source {short(self.source)} is not allowed: one of {', '.join(SOURCES)}"
            )
        object.__setattr__(self, "source", Source(self.source))
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise NoticeError("reason must be a non-empty string (why the node or rank goes)")
        if len(self.reason) > 500:
            raise NoticeError(f"reason is {len(self.reason)} characters; at most 500 allowed")
        if not isinstance(self.cycle, int) or isinstance(self.cycle, bool) or self.cycle < 0:
            raise NoticeError(f"cycle {short(self.cycle)} is not allowed: an integer >= 0")
        if not _finite_seconds(self.received_at) or self.received_at <= 0:
            raise NoticeError(
                f"received_at {short(self.received_at)} is not allowed: Unix seconds (a finite "
                "number > 0) when the notice was received"
            )

        if (self.node_id is None) == (self.rank is None):
            raise NoticeError("a notice targets exactly one of node_id or rank")
        if self.node_id is not None and (
            not isinstance(self.node_id, str)
            or not self.node_id.strip()
            or len(self.node_id) > MAX_NAME
        ):
            raise NoticeError(
                f"node_id {short(self.node_id)} is not allowed: a Ray node id (hex, at most "
                f"{MAX_NAME} characters)"
            )
        if self.rank is not None:
            ok = (
                isinstance(self.rank, tuple)
                and len(self.rank) == 2
                and isinstance(self.rank[0], str)
                and 0 < len(self.rank[0]) <= MAX_NAME
                and isinstance(self.rank[1], int)
                and not isinstance(self.rank[1], bool)
                and 0 <= self.rank[1] < MAX_RANK
            )
            if not ok:
                raise NoticeError(
                    f"rank {short(self.rank)} is not allowed: a (group, rank) pair, the group "
                    f"a name of 1 to {MAX_NAME} characters, the rank from 0 to {MAX_RANK - 1}"
                )
        deadline = self.deadline
        if not _finite_seconds(deadline) or deadline < 0:
            raise NoticeError(
                f"deadline {short(deadline)} is not allowed: Unix seconds, or 0 for none"
            )
        if deadline > self.received_at + MAX_DEADLINE_AHEAD_S:
            looks_like_ms = deadline > self.received_at * 100  # Unix ms are 1000x Unix seconds
            raise NoticeError(
                f"deadline {deadline} is more than 7 days ahead"
                + (": it looks like milliseconds; give Unix seconds" if looks_like_ms else "")
                + f" (at most {MAX_DEADLINE_AHEAD_S} s from now)"
            )

    @property
    def target(self) -> str:
        if self.node_id or self.rank is None:
            return f"node {self.node_id}"
        return f"rank {self.rank[0]}/{self.rank[1]}"

    def effective_deadline(self, default_timeout_s: float) -> float:
        """The deadline, or ``received_at + default_timeout_s`` when the source gave none."""
        return self.deadline or self.received_at + default_timeout_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rank"] = list(self.rank) if self.rank else None
        return data

    @classmethod
    def parse(cls, data: Mapping[str, Any], now: float | None = None) -> EvictionNotice:
        """Build from untrusted input (JSON, CLI); unknown keys and wrong types are errors.

        A deadline (other than 0, none) must lie after ``now`` (default: the current time).
        """
        if not isinstance(data, Mapping):
            raise NoticeError(f"a notice is a mapping, got {type(data).__name__}")
        allowed = {"source", "reason", "cycle", "deadline", "node_id", "rank", "received_at"}
        unknown = sorted(short(k, 40) for k in set(data) - allowed)[:10]
        if unknown:
            raise NoticeError(f"unknown notice fields {unknown}; allowed: {sorted(allowed)}")
        missing = [k for k in ("source", "reason", "cycle") if k not in data]
        if missing:
            raise NoticeError(f"notice fields {missing} are required")
        values = dict(data)
        rank = values.get("rank")
        if rank is not None:
            if not isinstance(rank, (list, tuple)) or len(rank) != 2:
                raise NoticeError(f"rank {short(rank)} is not allowed: [group, rank]")
            values["rank"] = (rank[0], rank[1])
        notice = cls(**values)
        now = time.time() if now is None else now
        if notice.deadline and notice.deadline <= now:
            raise NoticeError(
                f"deadline {notice.deadline:.0f} is {now - notice.deadline:.0f}s in the past "
                f"(Unix seconds; now is {now:.0f}): for a time from now give seconds ahead "
                "(ray-graceful notify --deadline-in SECONDS), or 0 for none"
            )
        return notice
