"""Steps the group holds in memory, committed once the survivors' copies land.

A warm restart's survivor that parked at step k holds its own shard of step k: it is that
shard's checkpoint. Where the memory tier is on (and ``warm_restart_holds``), its save order
says ``hold``: it snapshots the shard into its own memory, reports it *held* and trains on as
soon as the group re-formed; the copy to the keepers follows in the background and is reported
on its own (``LateSave``). So the cycle concludes ``Result.HELD`` - every shard of the plan at
one step, saved or held - and the group trains again without waiting for a save.

The step becomes a checkpoint only when every held shard's copy has landed: then it is
committed in memory exactly as any other (``memory/commit.py``), and made durable on disk in the
background (manifest last). Until then nothing marks it committed: ``load_latest`` and a cold
restart see the step before it, and ``Coordinator.durability(cycle)`` says which stage it is in:

    held  ->  in the keepers  ->  on disk
      |  |            \\-> durable-failed (every try of the disk copy failed: ``reason``)
      |  \\-> on disk (the keepers' nodes are all leaving: written through by them at once)
      \\-> lost (a copy failed, or did not land by ``until``: the step is never committed)

Ray-free and clock-free, and written by the cycle machine alone (``machine.py``): each event of
a held step's life comes in with its time, and what to commit, publish or drop comes out as
decisions (``events.py``) that the actor carries out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import ShardRecord
from ..place import Place
from ..protocol import LateSave, Reply, Result
from ..word import Word
from . import events as ev
from .conclusion import CommitRequest, CommitResult

KEEP_HELD = 16  # held steps remembered, at most (their records: one per shard)


class Stage(Word):
    """Where a held step is, as far as the coordinator knows."""

    HELD = "held"  # every shard at one step; the survivors' copies on their way
    COMMITTING = "committing"  # every copy landed: committing in memory
    IN_KEEPERS = "in-keepers"  # committed in memory: ``load_latest`` returns it
    ON_DISK = "on-disk"  # its manifest is written
    DURABLE_FAILED = "durable-failed"  # in the keepers; its disk copy failed every try (reason)
    LOST = "lost"  # a copy failed or never came: never committed (``reason``)


@dataclass
class HeldStep:
    """One cycle's step, held by its survivors until their copies land."""

    request: CommitRequest  # the cycle's, the survivors' "held" records among its records
    until: float  # copies not in by then: the step is lost
    held_at: float
    landed: dict[str, ShardRecord] = field(default_factory=dict)  # shard key -> its copy
    stage: Stage = Stage.HELD
    reason: str = ""
    at: dict[str, float] = field(default_factory=dict)  # stage -> when it was reached
    durable_path: str | None = None

    @property
    def cycle(self) -> int:
        return self.request.cycle

    @property
    def step(self) -> int:
        return self.request.records[0].step if self.request.records else -1

    @property
    def held(self) -> dict[str, ShardRecord]:
        return {r.shard: r for r in self.request.records if r.tier is Place.HELD}

    def missing(self) -> list[str]:
        return sorted(set(self.held) - set(self.landed))

    def take(self, late: LateSave, now: float) -> str | None:
        """Take one survivor's late report; the reason if it is refused."""
        if self.stage is not Stage.HELD:
            return f"cycle {self.cycle}'s held step is {self.stage.value} already"
        held = self.held
        for record in late.saved:
            if not isinstance(record, ShardRecord):
                return "a late save's records are ShardRecords"
            mine = held.get(record.shard)
            if mine is None:
                return f"shard {record.shard!r} was not held in cycle {self.cycle}"
            if (
                record.tier is not Place.MEMORY
                or record.step != mine.step
                or record.bytes != mine.bytes
            ):
                # What landed is not what the group trained on from: never commit it.
                self.lose(
                    f"the copy of shard {record.shard!r} is not what was held (step "
                    f"{record.step}, {record.bytes} bytes, {record.tier}; held: step "
                    f"{mine.step}, {mine.bytes} bytes)",
                    now,
                )
                return None
        if late.failed:
            names = ", ".join(sorted(late.failed)[:3])
            self.lose(f"the copy of shard(s) {names} did not land: {late.reason}"[:500], now)
            return None
        for record in late.saved:
            self.landed[record.shard] = record
        return None

    def complete(self) -> bool:
        return self.stage is Stage.HELD and not self.missing()

    def commit_request(self, now: float) -> CommitRequest:
        """The cycle's request with each held record replaced by its copy: a memory commit."""
        self.reached(Stage.COMMITTING, now)
        records = tuple(self.landed.get(r.shard, r) for r in self.request.records)
        return dataclasses.replace(self.request, tier=Place.MEMORY, records=records)

    def lose(self, reason: str, now: float) -> None:
        self.reached(Stage.LOST, now, reason=reason)

    def reached(self, stage: Stage, now: float, **fields: Any) -> None:
        self.stage = stage
        self.at[stage.value] = now
        for name, value in fields.items():
            setattr(self, name, value)

    def disk_copy_ended(self, durable: dict[str, Any] | None, now: float) -> bool:
        """The memory tier's disk copy ended (``wait_durable``'s record; None: still running):
        on disk, or ``durable-failed`` with the error - never left "in the keepers" as if it
        were on its way. Whether the stage changed."""
        if durable and durable.get("path"):
            self.reached(Stage.ON_DISK, now, durable_path=durable["path"])
            return True
        if durable and durable.get("error"):
            why = f"the disk copy failed: {durable['error']}"
            self.reached(Stage.DURABLE_FAILED, now, reason=why)
            return True
        return False

    def describe(self) -> dict[str, Any]:
        """What ``Coordinator.durability(cycle)`` answers: which step is held where."""
        return {
            "cycle": self.cycle,
            "step": self.step,
            "stage": self.stage.value,
            "held": {k: list(r.holders) for k, r in sorted(self.held.items())},
            "in_keepers": sorted(
                {r.shard for r in self.request.records if r.tier is Place.MEMORY} | set(self.landed)
            ),
            "missing": self.missing(),
            "durable_path": self.durable_path,
            "held_at": self.held_at,
            "at": dict(self.at),
            "reason": self.reason,
        }


def memory_durability(record: dict[str, Any]) -> dict[str, Any]:
    """``Coordinator.durability`` of a step committed in memory at its cycle's end (no held
    step): its memory record, with the stage it is in and why - a disk copy that failed every
    try is ``durable-failed`` with its error, never "in the keepers" as if it were on its way."""
    if record.get("lost"):
        stage, reason = Stage.LOST, record["lost"]
    elif record.get("durable_path"):
        stage, reason = Stage.ON_DISK, ""
    elif record.get("durable_error"):
        stage, reason = Stage.DURABLE_FAILED, record["durable_error"]
    else:
        stage, reason = Stage.IN_KEEPERS, ""
    return {**record, "stage": stage.value, "reason": reason}


class HeldSteps:
    """The held steps of a coordinator, by cycle, and the rules of their life: each method takes
    one event (with its time) and returns the decisions (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: dict[int, HeldStep] = {}
        # open cycle -> copies that landed before it concluded: a survivor that left the group
        # before its warm restart was decided copies its held shard as it goes
        self.early: dict[int, list[LateSave]] = {}

    def expect(self, request: CommitRequest, until: float, now: float) -> list[ev.Decision]:
        """The cycle concluded held: its copies are due by ``until`` - those that came early are
        taken now, as if they had landed this moment."""
        held = self.steps[request.cycle] = HeldStep(request, until, held_at=now)
        for old in sorted(self.steps)[:-KEEP_HELD]:
            del self.steps[old]
        out: list[ev.Decision] = [_changed(held), ev.HeldTimer(held.cycle, until)]
        for late in self.early.pop(request.cycle, []):
            out += self._landed(held, late, now)
        return out

    def not_held(self, cycle: int) -> list[ev.Decision]:
        """The open cycle concluded without a held step: the copies that came early for it
        are refused now, each with the reason (never dropped without a word)."""
        why = f"cycle {cycle} concluded without a held step"
        return [ev.Rejected(_summary(late), why) for late in self.early.pop(cycle, [])]

    def late(self, late: LateSave, now: float, open_cycle: int | None = None) -> list[ev.Decision]:
        """A survivor's copies landed (or could not): the step commits once all are in. A copy
        for ``open_cycle`` (not concluded yet) is kept until it concludes."""
        held = self.steps.get(late.cycle)
        if held is None and late.cycle == open_cycle:
            self.early.setdefault(late.cycle, []).append(late)
            return [ev.Replied(Reply.ok())]
        if held is None:
            why = f"no held step for cycle {late.cycle}"
            return [ev.Rejected(_summary(late), why), ev.Replied(Reply.refused(why))]
        out = self._landed(held, late, now)
        refused = [d.reason for d in out if isinstance(d, ev.Rejected)]
        if refused:
            return [*out, ev.Replied(Reply.refused(refused[0]))]
        return [ev.Replied(Reply.ok()), *out]

    @staticmethod
    def _landed(held: HeldStep, late: LateSave, now: float) -> list[ev.Decision]:
        why = held.take(late, now)
        if why is not None:
            return [ev.Rejected(_summary(late), why)]
        if held.stage is Stage.LOST:
            return _lost(held)
        if held.complete():
            return [ev.CommitHeld(held.commit_request(now))]
        return []

    def due(self, cycle: int, now: float) -> list[ev.Decision]:
        """Lose the held step of ``cycle`` if its copies are not all in by its ``until``."""
        held = self.steps.get(cycle)
        if held is None or held.stage is not Stage.HELD or now < held.until:
            return []
        missing = ", ".join(held.missing()[:3])
        held.lose(f"the copies of {missing} did not land by the deadline", now)
        return _lost(held)

    def committed(self, cycle: int, landed: CommitResult, now: float) -> list[ev.Decision]:
        """The memory commit of a held step landed: in the keepers, its disk copy next - or on
        disk already, written through by keepers whose nodes are leaving."""
        held = self.steps.get(cycle)
        if held is None:
            return []
        if landed.result is Result.COMMITTED and landed.memory is None and landed.committed:
            held.reached(Stage.ON_DISK, now, durable_path=landed.committed["path"])
            return [_changed(held)]
        if landed.result is not Result.COMMITTED or landed.memory is None:
            held.lose(f"the memory commit failed: {landed.reason}", now)
            return _lost(held)
        held.reached(Stage.IN_KEEPERS, now)
        return [_changed(held), ev.MakeDurable(cycle, landed.memory)]

    def durable(self, cycle: int, durable: dict[str, Any] | None, now: float) -> list[ev.Decision]:
        """The disk copy of a held step ended: on disk, or durable-failed."""
        held = self.steps.get(cycle)
        if held is not None and held.disk_copy_ended(durable, now):
            return [_changed(held)]
        return []

    def saved_copy(self, shard_key: str, step: int) -> ShardRecord | None:
        """A keeper-held copy of ``shard_key`` at ``step`` from a held step not committed yet:
        what a warm restart's spare loads (never a cold restart: the step is not a checkpoint)."""
        for held in self.steps.values():
            if held.step != step or held.stage is Stage.LOST:
                continue
            record = held.landed.get(shard_key) or next(
                (r for r in held.request.records if r.shard == shard_key), None
            )
            if record is not None and record.tier is Place.MEMORY:
                return record
        return None

    def awaiting_copy(self, shard_key: str, step: int) -> bool:
        """Whether ``shard_key`` of held ``step`` has no keeper copy yet but one is on its way:
        its holder left the group (found FAULTY after the plan) and copies it as it goes - a
        spare that takes its slot waits for that copy rather than loading an older step."""
        for held in self.steps.values():
            if held.step == step and held.stage is Stage.HELD and shard_key in held.missing():
                return True
        return False

    def settling(self, shard_key: str) -> bool:
        """Whether a held step of ``shard_key`` is on its way to a commit (its copies landing,
        or its memory commit running): a cold restart's load waits for its verdict rather than
        resume from the step before it - the survivors that held it may have left since."""
        return any(
            held.stage in (Stage.HELD, Stage.COMMITTING)
            and any(r.shard == shard_key for r in held.request.records)
            for held in self.steps.values()
        )

    def describe(self, cycle: int) -> dict[str, Any] | None:
        held = self.steps.get(cycle)
        return held.describe() if held is not None else None


def _summary(late: LateSave) -> str:
    return f"late save of cycle {late.cycle} from {late.process_id}"


def _changed(held: HeldStep) -> ev.HeldChanged:
    return ev.HeldChanged(held.cycle, held.describe())


def _lost(held: HeldStep) -> list[ev.Decision]:
    return [ev.HeldLost(held.cycle, held.step, held.reason), _changed(held)]
