"""What a rank's teardown did: the ``TeardownReport``, and where it is written.

One report per process: each step with its status (ran / skipped with the reason / failed with
the error / interrupted by the watchdog), its start and duration; the shards it saved; how the
process left. It is written as JSON under ``report_dir/<job id>/`` with os-level calls only
(the watchdog writes it too, from a thread that must not take ``logging``'s lock), printed as
one log line, and sent to the coordinator, which puts every rank's report in the outcome.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LOG_PREFIX = "ray_graceful teardown "

# How a process left: Ray's intended exit (status 0); Ray's kill of the actor, for a task that
# could not return (still recorded INTENDED_SYSTEM_EXIT, status 1); os._exit (outside Ray, or
# both of those failed); the deadline's watchdog; a second SIGTERM.
ExitPath = Literal["ray_intended", "ray_kill", "hard", "watchdog", "second-signal"]


@dataclass
class StepRecord:
    """One teardown step: what happened and when (seconds from the teardown's start)."""

    name: str
    status: str  # "ran" | "skipped" | "failed" | "running" | "interrupted"
    detail: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class TeardownReport:
    """What one process's teardown did; JSON in ``report_dir`` and one log line."""

    pid: int
    hostname: str
    node_id: str
    job_id: str
    ranks: list[dict[str, Any]]
    trigger: str
    cycle: int
    started_at: float
    deadline: float
    steps: list[StepRecord] = field(default_factory=list)
    saved: list[dict[str, Any]] = field(default_factory=list)
    last_step: int | None = None  # the last step boundary the training loop reported
    exit_path: ExitPath | None = None
    exit_code: int | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["steps"] = [asdict(s) for s in list(self.steps)]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeardownReport:
        values = dict(data)
        values["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
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
        ranks = ",".join(f"{r['group']}/{r['rank']}" for r in self.ranks) or "-"
        steps = " ".join(f"{s.name}={s.status}({s.duration_s * 1000:.0f}ms)" for s in self.steps)
        return f"pid={self.pid} ranks={ranks} trigger={self.trigger} {steps} exit={self.exit_path}"


def write_report_file(report: TeardownReport, report_dir: str) -> str | None:
    """Write the report JSON with os-level calls only (the watchdog uses this too)."""
    try:
        directory = os.path.join(report_dir, report.job_id or "no-job")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"teardown-{report.hostname}-{report.pid}.json")
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, report.to_json().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def read_reports(report_dir: str, job_id: str | None = None) -> list[TeardownReport]:
    """Every TeardownReport under ``report_dir`` (for one job, if given), oldest first."""
    reports = []
    roots = (
        [os.path.join(report_dir, job_id)]
        if job_id
        else [os.path.join(report_dir, d) for d in sorted(os.listdir(report_dir))]
        if os.path.isdir(report_dir)
        else []
    )
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            if name.startswith("teardown-") and name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    reports.append(TeardownReport.from_dict(json.load(f)))
    return sorted(reports, key=lambda r: r.started_at)


def ray_identity() -> dict[str, str]:
    """Job id and node id when running inside Ray, else empty strings."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return {"job_id": ctx.get_job_id() or "", "node_id": ctx.get_node_id() or ""}
    except Exception:
        pass
    return {"job_id": "", "node_id": ""}
