"""What one process's teardown did, as it reports it: the ``TeardownReport`` (JSON in
``report_dir``, one log line, and the coordinator's copy that goes into the outcome), with its
``StepRecord`` per teardown step, the ranks it held and the shards it saved."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..checkpoint.records import ShardRecord
from .words import StepStatus, TeardownStep

# How a process left: Ray's intended exit (status 0); Ray's kill of the actor, for a task that
# could not return (still recorded INTENDED_SYSTEM_EXIT, status 1); os._exit (outside Ray, or
# both of those failed); the deadline's watchdog; a second SIGTERM.
ExitPath = Literal["ray_intended", "ray_kill", "hard", "watchdog", "second-signal"]


@dataclass
class StepRecord:
    """One teardown step: what happened and when (seconds from the teardown's start)."""

    name: TeardownStep
    status: StepStatus
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
    steps: list[StepRecord] = field(default_factory=list)
    saved: list[ShardRecord] = field(default_factory=list)  # the shards it saved (or reused)
    last_step: int | None = None  # the last step boundary the training loop reported
    exit_path: ExitPath | None = None
    exit_code: int | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["steps"] = [asdict(s) for s in list(self.steps)]
        data["saved"] = [record.to_dict() for record in list(self.saved)]
        data["ranks"] = [asdict(rank) for rank in list(self.ranks)]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeardownReport:
        values = dict(data)
        values["steps"] = [
            StepRecord(**{**s, "name": TeardownStep(s["name"]), "status": StepStatus(s["status"])})
            for s in data.get("steps", [])
        ]
        values["saved"] = [ShardRecord.from_dict(record) for record in data.get("saved", [])]
        values["ranks"] = [ReportedRank(**rank) for rank in data.get("ranks", [])]
        return cls(**values)

    def step(self, name: str) -> StepRecord:
        for record in self.steps:
            if record.name == name:
                return record
        raise KeyError(f"no step {name!r} in this report; steps: {[s.name for s in self.steps]}")

    def save_failure(self) -> str:
        """Why the save step saved nothing (or only part): its detail, else the exit path."""
        for record in self.steps:
            if record.name == "save":
                return f"save {record.status}: {record.detail}"[:300]
        return f"no save step ran (exit: {self.exit_path})"

    def summary(self) -> str:
        ranks = ",".join(f"{r.group}/{r.rank}" for r in self.ranks) or "-"
        steps = " ".join(f"{s.name}={s.status}({s.duration_s * 1000:.0f}ms)" for s in self.steps)
        return f"pid={self.pid} ranks={ranks} trigger={self.trigger} {steps} exit={self.exit_path}"
