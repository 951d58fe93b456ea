"""What a cycle's termination came to: one record, as JSON, as a log line and as metrics."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from .protocol import Result

logger = logging.getLogger(__name__)

LOG_PREFIX = "ray_graceful outcome "
# Past this many characters the log line is a summary that names the file with the whole record
# (at 65,536 ranks the record is tens of MB: a log line that size floods the driver's log).


@dataclass(frozen=True)
class TerminationOutcome:
    """Per cycle: the notices, the plan, each rank's report, and what a restart loads.

    Immutable, written when the cycle concludes: the file and the API say the same. One
    exception keeps it true: a *held* cycle's step (the survivors hold their shards) becomes a
    checkpoint later, and as it moves - in the keepers, on disk, or lost - the outcome is
    written again with ``held`` and ``resume_from`` as they are then (``OutcomeBoard.held``).
    What else happens to a memory-tier checkpoint afterwards - its durable copy landing, a shard
    handed on or lost - is the memory tier's own record (``Coordinator.wait_durable``,
    ``Coordinator.memory_record``; ``durable-cycle-N.json`` and ``memory-cycle-N.json``).
    """

    cycle: int
    job_id: str
    result: Result
    notices: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    plan_table: str = ""
    reports: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # processes that sent no report
    committed: dict[str, Any] | None = None  # {"step", "path"}, or the memory tier's, at commit
    resume_from: dict[str, Any] | None = None  # the committed checkpoint a restart loads
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # seconds from the first notice
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # shards a backup saved
    # Warm restart: who rejoins as which rank, which spare took which slot, the resume step -
    # or why every survivor was told to leave (coordinator/warm_restarts.py). None without one.
    warm: dict[str, Any] | None = None
    # The memory tier's disk copies as this outcome went out: the newest durable step, and a
    # newer one whose copy failed after every try ("no durable step since k").
    durable: dict[str, Any] | None = None
    # A held cycle's step as it stands (``Coordinator.durability``): its stage - held, in the
    # keepers, on disk, durable-failed or lost - its step, and why. None unless the cycle held.
    held: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data: its fields are plain data already (made for it when the
        cycle concluded), so no deep copy - ``asdict``'s took seconds at 16,384 reports."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TerminationOutcome:
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**values, "result": Result(values["result"])})

    def summary(self) -> str:
        where = self.resume_from or {}
        if where:
            resume = f"resume from step {where['step']} ({where.get('path') or where.get('tier')})"
        elif self.held and self.held.get("stage") == "held":
            resume = (
                f"step {self.held['step']} held by the survivors, committed once their copies "
                "land in the keepers"
            )
        elif self.held:
            resume = f"held step {self.held['step']} {self.held['stage']}: {self.held['reason']}"
        else:
            resume = "no committed checkpoint to resume from"
        head = f"cycle {self.cycle}: {self.result}"
        if self.reason:
            head += f" ({self.reason})"
        tail = f"{head}; {len(self.reports)} report(s), {len(self.missing)} missing; {resume}"
        if self.durable and self.durable.get("says"):
            tail += f"; {self.durable['says']}"
        if self.warm:
            members = len(self.warm.get("members", []))
            tail += f"; warm restart: {self.warm['result']}" + (
                f" ({members} member(s))" if members else f" ({self.warm.get('reason')})"
            )
        return tail

    def publish(self, report_dir: str) -> str | None:
        """Write the JSON file and the log line, the same JSON encoded once (compact: the
        indented form is encoded in pure Python, seconds at 16,384 ranks); the file's path.

        The log line is ``log_summary`` - the verdict, what a restart loads, the counts, and the
        file that holds the whole record: one short line however many ranks (the whole record
        was 10 kB for four ranks, and could reach 1 MiB). Where the file could not be written,
        the whole record goes to the log instead."""
        text = self.to_json()
        path: str | None = None
        try:
            directory = os.path.join(report_dir, self.job_id or "no-job")
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"outcome-cycle-{self.cycle}.json")
            with open(path, "w") as f:
                f.write(text)
        except OSError as exc:
            logger.error("ray_graceful: could not write the outcome under %s: %s", report_dir, exc)
            path = None
        if path is not None:  # the file holds it all: the log line says what happened, and where
            text = json.dumps(self.log_summary(path, len(text)), sort_keys=True)
        sys.stderr.write(f"{LOG_PREFIX}{text}\n")
        sys.stderr.flush()
        return path

    def log_summary(self, path: str, length: int) -> dict[str, Any]:
        """What the log line says: the verdict and what a restart loads, the notices, reports
        and missing processes counted (the first 20 missing named), and the file that holds the
        whole record."""
        return {
            "cycle": self.cycle,
            "job_id": self.job_id,
            "result": self.result,
            "reason": self.reason,
            "committed": self.committed,
            "resume_from": self.resume_from,
            "timings": self.timings,
            "notices": len(self.notices),
            "rejected": len(self.rejected),
            "reports": len(self.reports),
            "missing": len(self.missing),
            "missing_first": self.missing[:20],
            "fallbacks": len(self.fallbacks),
            "warm": self.warm.get("result") if self.warm else None,
            "summary": self.summary(),
            "record": path,
            "record_chars": length,
        }


def publish_record(report_dir: str, job_id: str, name: str, record: dict[str, Any]) -> None:
    """A record beside the outcomes (the memory tier's ``durable-cycle-N``, ``memory-cycle-N``),
    replaced whole and atomically each time it changes."""
    directory = os.path.join(report_dir, job_id or "no-job")
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(directory, f"{name}.json"))
    except OSError as exc:
        logger.error("ray_graceful: could not write %s under %s: %s", name, report_dir, exc)
