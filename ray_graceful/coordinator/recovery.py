"""Coming back: what a restarted coordinator reads from disk before its first event.

Ray restarts the coordinator's actor after its process dies (``coordinator_max_restarts``, on
the driver's node); the new process starts empty. What it needs was written down for it:

- **the cycle count.** Every concluded cycle left ``outcome-cycle-N.json`` in
  ``report_dir/<job>``: the next cycle is one past the largest, so no outcome is overwritten.
- **a cycle in flight.** When a cycle's orders go out the shell writes ``inflight-cycle-N.json``
  (the shards expected, where, since when, the last deadline) and removes it once the outcome is
  published. One found at start is a cycle that died with its coordinator: once its deadline has
  passed (every rank of it has saved or given up, and left) it is concluded from the disk. It
  ends **committed** if every expected shard was saved at one step under ``checkpoint_dir``
  after the cycle opened - a shard file is renamed into place only once complete and fsynced,
  so its presence is proof; its size and checksum are read back into the manifest - and
  otherwise **abandoned**, with what was missing. A memory-tier cycle is concluded from what
  the keepers hold of it (``conclude_from_keepers``), by the rule of a live memory commit.
- **the memory tier.** Keepers outlive a coordinator crash (``memory/keeper.py``); the restarted
  one adopts them, and reads back the memory checkpoints it had committed from their records
  (``memory-cycle-N.json``, rewritten whenever one changes; ``memory_checkpoints``).
- **the ranks** register again on their own (``worker/control.py``), within a second or two, but
  not all in the same instant. A plan made before a group is whole again would order out the
  ranks already back and strand the rest in a group that cannot go on - so for its first
  ``SETTLE_S`` a restarted coordinator plans only once every group it has heard from is
  complete (``settled``). A rank still missing after that is taken as gone - it died or left
  alone while no coordinator answered - and its group is ordered out (``intake.not_back``).
  A drain under way is seen at the watcher's first poll.

Reading and committing touch only the disk (and keepers' answers); ``conclude_from_disk`` runs
on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from ..checkpoint import (
    CheckpointError,
    ShardRecord,
    commit,
    latest_committed,
    not_plain,
    scan_checkpoints,
    shard_file_name,
    step_dir,
    sync_and_checksum,
)
from ..config import GracefulConfig
from ..memory.commit import MemoryCheckpoint, commit_in_memory
from ..outcome import TerminationOutcome, publish_record
from ..place import Place, destination
from ..plan import RankInfo, incomplete_groups
from ..protocol import Result
from .cycle import Cycle
from .memory import KEEPER_PING_S, KeeperClient

Topology = Callable[[], list[RankInfo]]
T = TypeVar("T")

logger = logging.getLogger(__name__)

_RECORD = re.compile(r"^(outcome|inflight|memory|durable)-cycle-(\d+)\.json$")
SETTLE_S = 5.0  # after a restart: how long the first plan waits for every group to be whole
CLOCK_SLACK_S = 2.0  # a shard file written on another node: its clock may lag ours a little
UNCOMMITTED = "no manifest (not committed)"


@dataclass(frozen=True)
class InFlight:
    """What a restarted coordinator needs to conclude a cycle its predecessor left open."""

    cycle: int
    job_id: str
    opened_at: float
    deadline: float
    # where its step commits (``place.destination``); None: the plan itself committed nothing
    tier: Place | None
    root: str | None
    expected: tuple[str, ...]
    reason: str = ""  # why the plan itself committed nothing (``tier`` None)

    def __post_init__(self) -> None:
        if self.tier is not None:  # read back from JSON as its string
            object.__setattr__(self, "tier", Place(self.tier))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "expected": list(self.expected)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InFlight:
        return cls(**{**data, "expected": tuple(data["expected"])})


def in_flight(cycle: Cycle, config: GracefulConfig, job_id: str) -> InFlight:
    """What to write down for ``cycle`` once its orders are out (it has a plan)."""
    plan = cycle.plan
    assert plan is not None
    tier = None
    if not plan.abandoned:
        tier = destination(config.checkpoint_dir, config.memory_replicas, cycle.train_fn_saves)
    opened = cycle.first_notice_at or cycle.plan_at or time.time()
    return InFlight(
        cycle=cycle.number,
        job_id=job_id,
        opened_at=opened,
        deadline=max((o.deadline for o in plan.orders), default=opened),
        tier=tier,
        root=config.checkpoint_dir,
        expected=tuple(shard.key for shard in plan.savers),
        reason=plan.abandoned or "",
    )


async def settled(topology: Topology, until: float) -> None:
    """Until every group in ``topology()`` is complete, or ``until`` (a restarted coordinator's
    first plan; see the module docstring)."""
    while time.time() < until and incomplete_groups(topology()):
        await asyncio.sleep(0.05)


def job_dir(report_dir: str, job_id: str) -> str:
    return os.path.join(report_dir, job_id or "no-job")


def record_in_flight(report_dir: str, cycle: InFlight) -> None:
    publish_record(report_dir, cycle.job_id, f"inflight-cycle-{cycle.cycle}", cycle.to_dict())


def clear_in_flight(report_dir: str, job_id: str, cycle: int) -> None:
    try:
        os.remove(os.path.join(job_dir(report_dir, job_id), f"inflight-cycle-{cycle}.json"))
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("ray_graceful coordinator: cycle %s record not cleared: %s", cycle, exc)


def _records(report_dir: str, job_id: str) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {
        "outcome": set(),
        "inflight": set(),
        "memory": set(),
        "durable": set(),
    }
    try:
        names = os.listdir(job_dir(report_dir, job_id))
    except OSError:
        return found
    for name in names:
        match = _RECORD.match(name)
        if match:
            found[match.group(1)].add(int(match.group(2)))
    return found


def predecessor(config: GracefulConfig, job_id: str, restarted: bool) -> tuple[int, list[InFlight]]:
    """For a coordinator starting: its first cycle, and the cycles a predecessor left open.

    Only a restart reads them (a fresh coordinator of a job that ran before, a second
    ``trainer.fit()``, starts at cycle 0 as always).
    """
    if not restarted:
        return 0, []
    first = next_cycle(config.report_dir, job_id)
    return first, left_open(config.report_dir, job_id, config.checkpoint_dir)


def next_cycle(report_dir: str, job_id: str) -> int:
    """One past every cycle this job's coordinators concluded or opened (0 for a new job)."""
    found = _records(report_dir, job_id)
    return max(found["outcome"] | found["inflight"], default=-1) + 1


def _read_record(report_dir: str, job_id: str, name: str, parse: Callable[[Any], T]) -> T | None:
    """``parse`` of the record ``name`` in this job's report directory; None if there is none,
    or if it does not read or parse (said in the log)."""
    path = os.path.join(job_dir(report_dir, job_id), f"{name}.json")
    try:
        with open(path) as f:
            return parse(json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, CheckpointError) as exc:
        logger.error("ray_graceful coordinator: unreadable record %s: %s", path, exc)
        return None


def read_outcome(report_dir: str, job_id: str, cycle: int) -> TerminationOutcome | None:
    """The outcome a previous coordinator of this job published for ``cycle``, if any."""
    parse = TerminationOutcome.from_dict
    return _read_record(report_dir, job_id, f"outcome-cycle-{cycle}", parse)


def left_open(report_dir: str, job_id: str, checkpoint_dir: str | None) -> list[InFlight]:
    """The cycles a previous coordinator of this job opened and never concluded, each to be
    concluded under ``checkpoint_dir`` - this coordinator's own, never the root a record names:
    whoever can write the report directory could otherwise steer a manifest anywhere."""
    found = _records(report_dir, job_id)
    read = (
        _read_record(report_dir, job_id, f"inflight-cycle-{number}", InFlight.from_dict)
        for number in sorted(found["inflight"] - found["outcome"])
    )
    return [_confined(cycle, checkpoint_dir) for cycle in read if cycle is not None]


def _confined(cycle: InFlight, checkpoint_dir: str | None) -> InFlight:
    if cycle.root == checkpoint_dir:
        return cycle
    logger.error(
        "ray_graceful coordinator: the record of cycle %s names checkpoint root %r, not this "
        "coordinator's checkpoint_dir %r: it is concluded under the configured one",
        cycle.cycle,
        cycle.root,
        checkpoint_dir,
    )
    return dataclasses.replace(cycle, root=checkpoint_dir)


def memory_checkpoints(report_dir: str, job_id: str) -> list[MemoryCheckpoint]:
    """The memory checkpoints a predecessor committed and still offered: from the newest whose
    durable copy landed, and every newer one (older ones its keepers had released)."""
    found = _records(report_dir, job_id)
    checkpoints = []
    for number in sorted(found["memory"]):
        memory = _read_record(
            report_dir,
            job_id,
            f"memory-cycle-{number}",
            functools.partial(MemoryCheckpoint.from_record, job_id),
        )
        if memory is None:
            continue  # none, or unreadable: said so
        durable = _read_record(report_dir, job_id, f"durable-cycle-{number}", dict)
        if memory.durable_path is None and durable and durable.get("path"):
            memory.durable_path, memory.durable_at = durable["path"], durable.get("at")
        if not memory.lost:
            checkpoints.append(memory)
    durable_steps = [m.step for m in checkpoints if m.durable_path]
    oldest = max(durable_steps, default=-1)
    return [m for m in checkpoints if m.step >= oldest]


async def held_in_keepers(keepers: Mapping[str, KeeperClient], cycle: int) -> list[ShardRecord]:
    """What the keepers hold of ``cycle``: one record per (step, shard), with its holders."""
    nodes = list(keepers)
    answers = await asyncio.gather(
        *(asyncio.wait_for(keepers[n].stats(), KEEPER_PING_S) for n in nodes),
        return_exceptions=True,
    )
    records: dict[tuple[int, str], ShardRecord] = {}
    for node, answer in zip(nodes, answers, strict=True):
        if isinstance(answer, BaseException):
            logger.warning("ray_graceful coordinator: keeper on %s: %r", node[:12], answer)
            continue
        for held in answer.get("shards", []):
            if cycle not in held.get("cycles", [held.get("cycle")]):
                continue
            key = (held["step"], held["shard"])
            known = records.get(key)
            if known is not None:
                records[key] = replace(known, holders=(*known.holders, node))
                continue
            records[key] = ShardRecord(
                held["shard"],
                held["step"],
                shard_file_name(held["shard"]),
                held["bytes"],
                0,
                held.get("group", ""),
                held.get("rank", -1),
                tier=Place.MEMORY,
                holders=(node,),
                dcp_chunks=held.get("dcp_chunks"),
            )
    return list(records.values())


async def conclude_when_over(
    cycle: InFlight,
    grace_s: float,
    keepers: Mapping[str, KeeperClient] | None = None,
    replicas: int = 0,
) -> tuple[TerminationOutcome, MemoryCheckpoint | None]:
    """The cycle's outcome once its deadline (plus ``grace_s``) has passed: by then every rank
    of it has saved or given up, and left. From the disk on a thread (it reads every shard), or
    from the keepers for a memory-tier cycle; a memory commit comes back with its checkpoint."""
    await asyncio.sleep(max(cycle.deadline - time.time(), 0) + grace_s)
    memory = None
    if cycle.tier is Place.MEMORY:
        held = await held_in_keepers(keepers or {}, cycle.cycle)
        outcome, memory = await asyncio.to_thread(conclude_from_keepers, cycle, held, replicas)
    else:
        outcome = await asyncio.to_thread(conclude_from_disk, cycle)
    logger.warning("ray_graceful coordinator: %s", outcome.summary())
    return outcome, memory


def _lead(cycle: InFlight) -> str:
    return f"the coordinator restarted during cycle {cycle.cycle}"


def _outcome(
    cycle: InFlight,
    result: Result,
    reason: str,
    committed: dict[str, Any] | None = None,
    resume_from: dict[str, Any] | None = None,
) -> TerminationOutcome:
    if resume_from is None:
        latest = latest_committed(cycle.root) if cycle.root else None
        resume_from = {"step": latest.step, "path": latest.path} if latest else None
    return TerminationOutcome(
        cycle=cycle.cycle,
        job_id=cycle.job_id,
        result=result,
        plan={"expected": list(cycle.expected), "tier": cycle.tier},
        missing=["every report: they went to the coordinator that died"],
        committed=committed,
        resume_from=resume_from,
        reason=reason,
        timings={"outcome": time.time() - cycle.opened_at},
    )


def conclude_from_keepers(
    cycle: InFlight, held: list[ShardRecord], replicas: int
) -> tuple[TerminationOutcome, MemoryCheckpoint | None]:
    """A memory-tier cycle whose coordinator died: committed in memory, as a live commit would
    be (``commit_in_memory``: every shard at one step, each held by ``replicas`` keepers - or
    on disk at that step, where it did not fit a keeper), or abandoned with what was missing."""
    by_step: dict[int, dict[str, ShardRecord]] = {}
    for record in held:
        if record.shard in cycle.expected:
            by_step.setdefault(record.step, {})[record.shard] = record
    why = "no keeper holds any shard of it"
    since = cycle.opened_at - CLOCK_SLACK_S
    for step in sorted(by_step, reverse=True):
        records = by_step[step]
        root = cycle.root  # a shard that did not fit a keeper was saved there, at this step
        for shard in (s for s in cycle.expected if s not in records):
            if root and _fresh(os.path.join(step_dir(root, step), shard_file_name(shard)), since):
                with contextlib.suppress(OSError):
                    records[shard] = _read_back(root, step, shard)
        try:
            memory = commit_in_memory(
                cycle.job_id, cycle.cycle, list(cycle.expected), list(records.values()), replicas
            )
        except CheckpointError as exc:
            why = f"step {step}: {exc}"
            continue
        reason = f"{_lead(cycle)}: every shard was held by keepers at step {step}; committed"
        resume_from = {"step": memory.step, "tier": "memory"}
        return _outcome(cycle, Result.COMMITTED, reason, memory.describe(), resume_from), memory
    return _outcome(cycle, Result.ABANDONED, f"{_lead(cycle)}: {why}"), None


def conclude_from_disk(cycle: InFlight) -> TerminationOutcome:
    """The outcome of a cycle whose coordinator died: committed from the disk, or abandoned."""
    lead = _lead(cycle)
    committed = None
    if cycle.tier is None:
        result, reason = Result.ABANDONED, cycle.reason
    elif cycle.tier is Place.RAY_TRAIN:
        result, reason = Result.RAY_TRAIN, f"{lead}; the savers reported to Ray Train"
    elif cycle.tier is Place.NOWHERE or cycle.root is None:
        result, reason = Result.NO_CHECKPOINT, f"{lead}; no checkpoint_dir is configured"
    else:
        step, why = _complete_step(cycle)
        if step is None:
            result, reason = Result.ABANDONED, f"{lead}: {why}"
        else:
            try:
                records = [_read_back(cycle.root, step, shard) for shard in cycle.expected]
                path = commit(
                    cycle.root,
                    step,
                    list(cycle.expected),
                    records,
                    cycle=cycle.cycle,
                    extra={"job_id": cycle.job_id, "recovered_by_restarted_coordinator": True},
                )
                result, committed = Result.COMMITTED, {"step": step, "path": os.path.dirname(path)}
                reason = f"{lead}: every shard was on disk at step {step}; committed from there"
            except (CheckpointError, OSError) as exc:
                result, reason = Result.ABANDONED, f"{lead}: {exc}"
    return _outcome(cycle, result, reason, committed)


def _complete_step(cycle: InFlight) -> tuple[int | None, str]:
    """The newest uncommitted step holding every expected shard, written since the cycle began."""
    assert cycle.root is not None
    since = cycle.opened_at - CLOCK_SLACK_S
    best_missing: list[str] | None = None
    for step, directory, _checkpoint, why in scan_checkpoints(cycle.root, verify_checksums=False):
        if why != UNCOMMITTED:
            continue
        missing = [
            shard
            for shard in cycle.expected
            if not _fresh(os.path.join(directory, shard_file_name(shard)), since)
        ]
        if not missing:
            return step, ""
        if best_missing is None or len(missing) < len(best_missing):
            best_missing = missing
    if best_missing is None:
        return None, "no shard of it was saved after the cycle began"
    return None, f"shards {best_missing} were never saved at one step with the others"


def _fresh(path: str, since: float) -> bool:
    try:
        return not_plain(path) is None and os.lstat(path).st_mtime >= since
    except OSError:
        return False


def _read_back(root: str, step: int, shard: str) -> ShardRecord:
    name = shard_file_name(shard)
    size, crc = sync_and_checksum(os.path.join(step_dir(root, step), name))
    return ShardRecord(shard, step, name, size, crc)
