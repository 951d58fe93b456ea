"""One cycle of the coordinator, as an explicit state machine, and how a cycle concludes.

::

    IDLE --first notice--> GATHERING --notice_gather_s, or--> TEARING_DOWN --all reported, or the
     ^                                  every touched node         last deadline passed--+
     |                                  covered                                          |
     +------------- the next cycle opens <------------- CONCLUDED (outcome published) <---+

Each transition is one method of the coordinator actor (``actor.py``); this module holds the
cycle's state and the conclusion, a plain function of what the cycle saw: which processes were
ordered, what they reported, whether every shard was saved at one step (then the manifest is
written: the checkpoint is committed). A cycle always concludes: an error on the way becomes an
outcome with ``result="failed"`` and its reason, and the next cycle opens all the same.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import CheckpointError, ShardRecord, commit, latest_committed
from ..config import GracefulConfig
from ..memory.commit import MemoryCheckpoint, commit_in_memory
from ..notices import EvictionNotice
from ..outcome import TerminationOutcome
from ..plan import TerminationPlan
from ..protocol import shard_key
from .registry import Process, Registry


class Phase(str, enum.Enum):
    IDLE = "idle"
    GATHERING = "gathering"
    TEARING_DOWN = "tearing down"
    CONCLUDED = "concluded"


@dataclass
class Cycle:
    """What one cycle has seen so far."""

    number: int
    phase: Phase = Phase.IDLE
    notices: list[EvictionNotice] = field(default_factory=list)
    late_notices: list[EvictionNotice] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    plan: TerminationPlan | None = None
    cooperative: bool = False  # the savers report to Ray Train, not to a checkpoint dir
    first_notice_at: float | None = None
    plan_at: float | None = None
    orders_at: float | None = None
    task: asyncio.Task | None = None
    all_reported: asyncio.Event = field(default_factory=asyncio.Event)
    # Gathering ends early once every process on every node a notice touched is covered by a
    # notice: nothing more can be learned about those nodes (node -> processes not yet covered).
    uncovered: dict[str, set[str]] = field(default_factory=dict)
    noticed_ranks: set[tuple[str, int]] = field(default_factory=set)
    gathered: asyncio.Event = field(default_factory=asyncio.Event)
    # Backup savers (fallback.py): each shard's saver's fate, once known, and who waits on it.
    save_results: dict[str, tuple[bool, str]] = field(default_factory=dict)
    save_resolved: dict[str, asyncio.Event] = field(default_factory=dict)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    memory_checkpoint: MemoryCheckpoint | None = None  # committed in the keepers' memory

    @property
    def tearing_down(self) -> bool:
        return self.phase in (Phase.GATHERING, Phase.TEARING_DOWN)

    def all_notices(self) -> list[dict[str, Any]]:
        return [n.to_dict() for n in self.notices + self.late_notices]

    def cover(self, notice: EvictionNotice, registry: Registry) -> None:
        """Count what ``notice`` tells about its node; all touched nodes covered: plan now.

        The gathering window is for notices that belong together (a SIGTERM to every rank of a
        pod, a drain and a fault). When every notice so far is a SIGTERM - the shortest grace
        there is - and every process on each node they touched has one, waiting longer learns
        nothing more about those nodes, and each millisecond is one the ranks do not have. A
        drain or a fault keeps the whole window: a drain brings its own deadline, and a fault
        elsewhere arriving with it must change who saves.
        """
        if notice.node_id is not None:
            node = notice.node_id
            self.uncovered[node] = set()
        else:
            if notice.rank is None:
                return
            self.noticed_ranks.add(notice.rank)
            process = registry.process_of(notice.rank)
            if process is None:
                return
            node = process.node_id
            if node not in self.uncovered:
                self.uncovered[node] = {
                    p.process_id for p in registry.active(self.number) if p.node_id == node
                }
            if all(key in self.noticed_ranks for key in process.keys):
                self.uncovered[node].discard(process.process_id)
        if not any(self.uncovered.values()) and all(n.source == "sigterm" for n in self.notices):
            self.gathered.set()


def conclude(
    cycle: Cycle,
    involved: list[Process],
    config: GracefulConfig,
    job_id: str,
    save_times: dict[tuple[str, str], float],
) -> TerminationOutcome:
    """The outcome of a cycle whose orders are out: commit if every shard was saved at one step.

    Runs on a thread (it reads and writes the checkpoint directory). Raises on what it cannot
    make sense of; the caller turns that into a "failed" outcome.
    """
    plan = cycle.plan
    assert plan is not None
    t0 = cycle.first_notice_at or cycle.plan_at or time.time()
    reports = [p.report for p in involved if p.report is not None]
    missing = [
        p.name + (" (died without a notice)" if p.lost else "")
        for p in involved
        if p.report is None
    ]
    records = [ShardRecord.from_dict(s) for r in reports for s in r.saved]
    for record in records:
        group, _, label = record.shard.partition("/")
        save_times[(group, label)] = record.seconds
    root = config.checkpoint_dir
    committed, reason = None, ""
    expected = [shard_key(g, s) for g, s in plan.savers]
    if plan.abandoned:
        result, reason = "abandoned", plan.abandoned
    elif cycle.cooperative:
        result = "ray-train"
        reason = "the savers reported their shards to Ray Train: ray.train.get_checkpoint()"
    elif any(r.tier == "memory" for r in records):
        try:
            memory = commit_in_memory(
                job_id,
                cycle.number,
                expected,
                records,
                config.memory_replicas,
                evicted_nodes(cycle, involved),
            )
            cycle.memory_checkpoint = memory
            result, committed = "committed", memory.describe()
        except CheckpointError as exc:
            result, reason = "abandoned", "; ".join([str(exc), *failed_saves(reports)[:3]])
    elif root is None and config.memory_replicas > 0:
        result, reason = (
            "abandoned",
            (
                "no shard is held in memory and no checkpoint_dir is configured (memory-only): "
                + ("; ".join(failed_saves(reports)[:3]) or "no saver reported a save")
            ),
        )
    elif root is None:
        result, reason = "no-checkpoint", "no checkpoint_dir is configured"
    else:
        step = records[0].step if records else -1
        try:
            path = commit(
                root, step, expected, records, cycle=cycle.number, extra={"job_id": job_id}
            )
            result, committed = "committed", {"step": step, "path": os.path.dirname(path)}
        except CheckpointError as exc:
            result, reason = "abandoned", str(exc)
    if plan.incomplete and result == "committed":
        reason = "; ".join(
            f"group {group} not in the checkpoint: {why}" for group, why in plan.incomplete.items()
        )
    latest = latest_committed(root) if root else None
    resume_from = {"step": latest.step, "path": latest.path} if latest else None
    if cycle.memory_checkpoint is not None:
        resume_from = {"step": cycle.memory_checkpoint.step, "tier": "memory"}
    report_times = [r.started_at + (r.finished_s or 0) for r in reports]
    timings = {"plan": (cycle.plan_at or t0) - t0, "orders": (cycle.orders_at or t0) - t0}
    if report_times:
        timings["first_report"] = min(report_times) - t0
        timings["last_report"] = max(report_times) - t0
    timings["outcome"] = time.time() - t0
    return TerminationOutcome(
        cycle=cycle.number,
        job_id=job_id,
        result=result,
        notices=cycle.all_notices(),
        rejected=list(cycle.rejected),
        plan=plan.to_dict(),
        plan_table=plan.table(now=cycle.plan_at),
        reports=[r.to_dict() for r in reports],
        missing=missing,
        committed=committed,
        resume_from=resume_from,
        reason=reason,
        timings=timings,
        fallbacks=list(cycle.fallbacks),
    )


def failed_saves(reports: list[Any]) -> list[str]:
    """Each failed save step of these reports: who, and its own words for why."""
    return [
        f"{r.hostname}:{r.pid}: {step.detail}"[:300]
        for r in reports
        for step in r.steps
        if step.name == "save" and step.status == "failed"
    ]


def evicted_nodes(cycle: Cycle, involved: list[Process]) -> frozenset[str]:
    """Every node a notice of this cycle named, or whose process a rank notice named."""
    notices = cycle.notices + cycle.late_notices
    ranks = {n.rank for n in notices if n.rank is not None}
    nodes = {n.node_id for n in notices if n.node_id is not None}
    nodes |= {p.node_id for p in involved if any(k in ranks for k in p.keys)}
    return frozenset(nodes)


def failed(cycle: Cycle, job_id: str, exc: BaseException) -> TerminationOutcome:
    """The outcome of a cycle that could not conclude normally: it still concludes."""
    return TerminationOutcome(
        cycle=cycle.number,
        job_id=job_id,
        result="failed",
        notices=cycle.all_notices(),
        rejected=list(cycle.rejected),
        plan=cycle.plan.to_dict() if cycle.plan else {},
        reason=f"the coordinator failed while concluding: {type(exc).__name__}: {exc}",
    )
