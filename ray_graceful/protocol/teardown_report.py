"""What one process's teardown did, as it reports it: the ``TeardownReport`` (JSON in
``report_dir``, one log line, and the coordinator's copy that goes into the outcome), with its
``PhaseRecord`` per teardown phase, the ranks it held and the shards it saved."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..checkpoint.records import ShardRecord
from .words import PhaseStatus, TeardownPhase

# How a process left: Ray's intended exit (status 0); Ray's kill of the actor, for a task that
# could not return (still recorded INTENDED_SYSTEM_EXIT, status 1); os._exit (outside Ray, or
# both of those failed); the deadline's watchdog; a second SIGTERM.
ExitPath = Literal["ray_intended", "ray_train", "ray_kill", "hard", "watchdog", "second-signal"]


@dataclass
class PhaseRecord:
    """One teardown step: what happened and when (seconds from the teardown's start)."""

    name: TeardownPhase
    status: PhaseStatus
    detail: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0


@dataclass(frozen=True)
class ReportedRank:
    """A rank the process held when it tore down."""

    group: str
    rank: int
    world_size: int


@dataclass
class TeardownReport:
    """What one process's teardown did; JSON in ``report_dir`` and one log line."""

    pid: int
    hostname: str
    node_id: str
    job_id: str
    ranks: list[ReportedRank]
    trigger: str
    cycle: int
    started_at: float
    deadline: float
    phases: list[PhaseRecord] = field(default_factory=list)
    saved: list[ShardRecord] = field(default_factory=list)  # the shards it saved (or reused)
    last_step: int | None = None  # the last step boundary the training loop reported
    # The step the training thread parked at (should_stop) and whose state it provably holds;
    # None where it was not parked there (inside a step, out of its loop, the device behind).
    # A warm restart's survivor trains on from its own state only at this step.
    parked_at: int | None = None
    exit_path: ExitPath | None = None
    exit_code: int | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        # not asdict(self): it deep-copies the lists below only for them to be made again
        data = _plain(self)
        data["phases"] = [_plain(s) for s in list(self.phases)]
        data["saved"] = [record.to_dict() for record in list(self.saved)]
        data["ranks"] = [_plain(rank) for rank in list(self.ranks)]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeardownReport:
        values = dict(data)
        values["phases"] = [
            PhaseRecord(
                **{**s, "name": TeardownPhase(s["name"]), "status": PhaseStatus(s["status"])}
            )
            for s in data.get("phases", [])
        ]
        values["saved"] = [ShardRecord.from_dict(record) for record in data.get("saved", [])]
        values["ranks"] = [ReportedRank(**rank) for rank in data.get("ranks", [])]
        return cls(**values)

    def phase(self, name: str) -> PhaseRecord:
        for record in self.phases:
            if record.name == name:
                return record
        names = [s.name for s in self.phases]
        raise KeyError(f"no phase {name!r} in this report; phases: {names}")

    def save_failure(self) -> str:
        """Why the save step saved nothing (or only part): its detail, else the exit path."""
        for record in self.phases:
            if record.name == "save":
                return f"save {record.status}: {record.detail}"[:300]
        return f"no save phase ran (exit: {self.exit_path})"

    def summary(self) -> str:
        ranks = ",".join(f"{r.group}/{r.rank}" for r in self.ranks) or "-"
        phases = " ".join(f"{s.name}={s.status}({s.duration_s * 1000:.0f}ms)" for s in self.phases)
        return f"pid={self.pid} ranks={ranks} trigger={self.trigger} {phases} exit={self.exit_path}"


@functools.cache
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _plain(record: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, one level deep: ``asdict`` without its deep copy, and
    without ``fields()`` asked again for every record - at 65,536 reports in an outcome the two
    cost 1.5 s of the coordinator's time. A report's phases and ranks hold only scalars."""
    return {name: getattr(record, name) for name in _field_names(record.__class__)}
