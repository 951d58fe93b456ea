"""How a cycle concludes: what to commit, committing it, and the outcome record.

Three steps, so that only the middle one touches the disk and none writes the coordinator's
state from a thread:

1. ``commit_request`` (pure, on the event loop): from the plan and the reports, what is to be
   committed where - every shard of the plan at one step, to ``checkpoint_dir`` or in the
   keepers' memory - or why nothing is;
2. ``carry_out`` (I/O, on a thread): writes the manifest (``checkpoint.commit``) or checks the
   memory commit, and reads back the newest committed checkpoint; returns a ``CommitResult``
   and changes nothing else. A memory commit whose keepers' nodes are all leaving is not
   committed there: the actor has the keepers write it through to disk first
   (``written_through``);
3. ``outcome_of`` (pure, on the event loop): the cycle's ``TerminationOutcome``, an immutable
   record - written once, and what the API returns is what the file says.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointError, ShardRecord, commit, latest_committed
from ..config import GracefulConfig
from ..memory.commit import LeavingHolders, MemoryCheckpoint, commit_in_memory
from ..outcome import TerminationOutcome
from ..place import Place
from ..protocol import PhaseStatus, Result, TeardownReport
from .cycle import Cycle
from .registry import Process


@dataclass(frozen=True)
class CommitRequest:
    """What the cycle saved and where it is to be committed; ``tier`` None: nothing to commit."""

    cycle: int
    job_id: str
    # HELD: some survivors hold their shards (``held.py``); None: ``result`` and ``reason`` say why
    tier: Place | None
    root: str | None
    expected: tuple[str, ...]
    records: tuple[ShardRecord, ...]
    replicas: int = 0
    evicted_nodes: frozenset[str] = frozenset()
    result: Result | None = None
    reason: str = ""
    failures: tuple[str, ...] = ()  # the savers' own words, where a memory commit fails
    verify: frozenset[str] = frozenset()  # shards read back on disk (``trusted_records``)

    def __post_init__(self) -> None:
        if self.tier is not None:  # "memory" as well as Place.MEMORY
            object.__setattr__(self, "tier", Place(self.tier))


@dataclass(frozen=True)
class CommitResult:
    """What landed: the result, what was committed, and what a restart resumes from."""

    result: Result
    reason: str = ""
    committed: dict[str, Any] | None = None
    memory: MemoryCheckpoint | None = None
    resume_from: dict[str, Any] | None = None
    # Whole in the keepers, but their nodes are leaving (``LeavingHolders``): not committed
    # yet - the actor writes it through to disk (``MemoryTier.write_through``), then it is.
    write_through: MemoryCheckpoint | None = None


def commit_request(
    cycle: Cycle, involved: list[Process], config: GracefulConfig, job_id: str
) -> CommitRequest:
    """What to commit, from the plan and the reports of the processes that had an order."""
    plan = cycle.plan
    assert plan is not None
    reports = [p.report for p in involved if p.report is not None]
    records, verify = trusted_records(cycle, involved)
    expected = tuple(shard.key for shard in plan.savers)
    root = config.checkpoint_dir

    def nothing(result: Result, reason: str) -> CommitRequest:
        return CommitRequest(cycle.number, job_id, None, root, expected, records, 0, frozenset(),
                             result, reason)  # fmt: skip

    if plan.abandoned:
        return nothing(Result.ABANDONED, plan.abandoned)
    if cycle.train_fn_saves:
        why = "the savers reported their shards to Ray Train: ray.train.get_checkpoint()"
        return nothing(Result.RAY_TRAIN, why)
    if any(r.tier in (Place.MEMORY, Place.HELD) for r in records):
        return CommitRequest(
            cycle.number,
            job_id,
            Place.HELD if any(r.tier is Place.HELD for r in records) else Place.MEMORY,
            root,
            expected,
            records,
            config.memory_replicas,
            evicted_nodes(cycle, involved),
            failures=tuple(failed_saves(reports)[:3]),
        )
    if root is None and config.memory_replicas > 0:
        why = "; ".join(failed_saves(reports)[:3]) or "no saver reported a save"
        return nothing(
            Result.ABANDONED,
            f"no shard is held in memory and no checkpoint_dir is configured (memory-only): {why}",
        )
    if root is None:
        return nothing(Result.NO_CHECKPOINT, "no checkpoint_dir is configured")
    return CommitRequest(cycle.number, job_id, Place.DISK, root, expected, records, verify=verify)


def trusted_records(
    cycle: Cycle, involved: list[Process]
) -> tuple[tuple[ShardRecord, ...], frozenset[str]]:
    """Every save reported, but none of a rank found FAULTY after the plan where another rank
    saved the same shard (its backup, told to save at the verdict: ``intake.fault_after_plan``).

    Also the shards whose file on disk the faulty rank may have renamed over the backup's
    (both write one file name): the commit reads those back against the kept record.
    """
    saves = [(p.process_id, r) for p in involved if p.report is not None for r in p.report.saved]
    faulty = cycle.late_faulty
    healthy = {record.shard for pid, record in saves if pid not in faulty}
    dropped = {record.shard for pid, record in saves if pid in faulty and record.shard in healthy}
    kept = tuple(r for pid, r in saves if pid not in faulty or r.shard not in healthy)
    return kept, frozenset(dropped)


def carry_out(request: CommitRequest) -> CommitResult:
    """Commit as requested (on a thread: it reads and writes ``checkpoint_dir``)."""
    result, reason = request.result or Result.ABANDONED, request.reason
    committed, memory, write_through = None, None, None
    if request.tier is Place.HELD:
        result, reason, committed = _check_held(request)
    elif request.tier is Place.MEMORY:
        try:
            memory = _in_memory(request)
            result, committed = Result.COMMITTED, memory.describe()
        except LeavingHolders as exc:
            result, reason = Result.ABANDONED, "; ".join([str(exc), *request.failures])
            if request.root is not None:
                write_through = exc.checkpoint
        except CheckpointError as exc:
            result, reason = Result.ABANDONED, "; ".join([str(exc), *request.failures])
    elif request.tier is Place.DISK:
        assert request.root is not None
        step = request.records[0].step if request.records else -1
        try:
            path = commit(
                request.root,
                step,
                list(request.expected),
                list(request.records),
                cycle=request.cycle,
                extra={"job_id": request.job_id},
                verify=request.verify,
            )
            result, committed = Result.COMMITTED, {"step": step, "path": os.path.dirname(path)}
        except CheckpointError as exc:
            result, reason = Result.ABANDONED, str(exc)
    latest = latest_committed(request.root) if request.root else None
    resume_from = {"step": latest.step, "path": latest.path} if latest else None
    if memory is not None:
        resume_from = {"step": memory.step, "tier": "memory"}
    return CommitResult(result, reason, committed, memory, resume_from, write_through)


def written_through(landed: CommitResult, durable: dict[str, Any]) -> CommitResult:
    """A commit whose keepers were leaving (``landed.write_through``), once the keepers wrote
    it through to disk: committed where its manifest landed, else abandoned, saying both why."""
    memory = landed.write_through
    assert memory is not None
    if "path" in durable:
        where = {"step": memory.step, "path": durable["path"]}
        reason = f"written through to disk by the keepers before their nodes go ({landed.reason})"
        return CommitResult(Result.COMMITTED, reason[:500], where, None, dict(where))
    why = f"{landed.reason}; the write-through to disk failed: {durable.get('error', '')}"
    return dataclasses.replace(landed, reason=why[:500], write_through=None)


def _in_memory(request: CommitRequest) -> MemoryCheckpoint:
    """The request's records as a memory checkpoint, or CheckpointError saying what is amiss."""
    return commit_in_memory(
        request.job_id,
        request.cycle,
        list(request.expected),
        list(request.records),
        request.replicas,
        request.evicted_nodes,
    )


def _check_held(request: CommitRequest) -> tuple[Result, str, dict[str, Any] | None]:
    """A cycle whose survivors hold their shards: everything a memory commit checks, held
    shards counted as present. HELD, not COMMITTED: nothing is committed until their copies
    land (``held.py``); a restart meanwhile loads the checkpoint before it."""
    try:
        checked = _in_memory(request)
    except LeavingHolders as exc:
        if request.root is None:
            return Result.ABANDONED, "; ".join([str(exc), *request.failures]), None
        checked = exc.checkpoint  # its commit, once the copies land, writes it through to disk
    except CheckpointError as exc:
        return Result.ABANDONED, "; ".join([str(exc), *request.failures]), None
    held = {k: list(r.holders) for k, r in sorted(checked.shards.items()) if r.tier is Place.HELD}
    reason = (
        f"step {checked.step} is held in memory by the group's survivors ({len(held)} shard(s))"
        " and committed once their copies reach the keepers: Coordinator.durability(cycle)"
    )
    return Result.HELD, reason, {"tier": "held", "step": checked.step, "held": held}


def outcome_of(
    cycle: Cycle,
    involved: list[Process],
    landed: CommitResult,
    job_id: str,
    warm: dict[str, Any] | None,
    now: float,
) -> TerminationOutcome:
    """The cycle's outcome record: notices, plan, every report, what was committed, timings
    (``now``: when it concluded)."""
    plan = cycle.plan
    assert plan is not None
    t0 = cycle.first_notice_at or cycle.plan_at or now
    reports = [p.report for p in involved if p.report is not None]
    missing = [
        p.name + (" (died without a notice)" if p.lost else "")
        for p in involved
        if p.report is None
    ]
    reason = landed.reason
    if plan.incomplete and landed.result is Result.COMMITTED:
        reason = "; ".join(
            f"group {group} not in the checkpoint: {why}" for group, why in plan.incomplete.items()
        )
    report_times = [r.started_at + (r.finished_s or 0) for r in reports]
    timings = {"plan": (cycle.plan_at or t0) - t0, "orders": (cycle.orders_at or t0) - t0}
    if report_times:
        timings["first_report"] = min(report_times) - t0
        timings["last_report"] = max(report_times) - t0
    timings["outcome"] = now - t0
    return TerminationOutcome(
        cycle=cycle.number,
        job_id=job_id,
        result=landed.result,
        notices=cycle.all_notices(),
        rejected=list(cycle.rejected),
        plan=plan.to_dict(),
        plan_table=plan.table(now=cycle.plan_at),
        reports=[r.to_dict() for r in reports],
        missing=missing,
        committed=landed.committed,
        resume_from=landed.resume_from,
        reason=reason,
        timings=timings,
        fallbacks=list(cycle.fallbacks),
        warm=warm,
    )


def failed_saves(reports: list[TeardownReport]) -> list[str]:
    """Each failed save step of these reports: who, and its own words for why."""
    return [
        f"{r.hostname}:{r.pid}: {step.detail}"[:300]
        for r in reports
        for step in r.phases
        if step.name == "save" and step.status == PhaseStatus.FAILED
    ]


def evicted_nodes(cycle: Cycle, involved: list[Process]) -> frozenset[str]:
    """Every node a notice of this cycle named, or whose process a rank notice named."""
    notices = cycle.notices + cycle.late_notices
    ranks = {n.rank for n in notices if n.rank is not None}
    nodes = {n.node_id for n in notices if n.node_id is not None}
    nodes |= {p.node_id for p in involved if any(k in ranks for k in p.keys)}
    return frozenset(nodes)


def failed(
    cycle: Cycle, job_id: str, error: str, warm: dict[str, Any] | None = None
) -> TerminationOutcome:
    """The outcome of a cycle that could not conclude normally: it still concludes."""
    return TerminationOutcome(
        cycle=cycle.number,
        job_id=job_id,
        result=Result.FAILED,
        notices=cycle.all_notices(),
        rejected=list(cycle.rejected),
        plan=cycle.plan.to_dict() if cycle.plan else {},
        reason=f"the coordinator failed while concluding: {error}",
        warm=warm,
    )
