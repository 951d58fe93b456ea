"""What the cycle machine knows of its job, and the rules every part of it shares.

One object, passed to the machine's parts (``intake.py``, ``orders.py``, ``machine.py``): the
registered processes, the cycle in flight, whether the job still runs. The shared rules are
the ones more than one event needs: how a message is refused and kept on record, when a
saver's fate is known, when every ordered process has reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import GracefulConfig
from ..notices import short
from ..protocol import JobState, Reply, ShardId
from . import events as ev
from .cycle import Cycle, Phase
from .registry import Process, Registry

KEEP_REJECTED = 200  # rejected messages remembered per cycle (status shows the last 20)
MAX_REASON = 500  # characters of a rejection's reason kept and echoed back


@dataclass(frozen=True)
class Refusal:
    """Why a process's message is not taken: the process is unknown, or of another cycle."""

    reason: str
    unknown: bool  # no such process registered (else: a stale cycle)


@dataclass
class CoordinatorState:
    config: GracefulConfig
    job_id: str
    registry: Registry = field(default_factory=Registry)
    cycle: Cycle = field(default_factory=lambda: Cycle(0))
    job_state: JobState = JobState.RUNNING
    save_times: dict[ShardId, float] = field(default_factory=dict)  # expected next time
    drains_seen: dict[str, int] = field(default_factory=dict)  # node -> the cycle it was seen in
    home_node: str = ""  # the coordinator's node, pinned next to the driver: the job ends with it
    polls_served: int = 0
    now: float = 0.0  # when the event being stepped happened: the machine reads no clock

    def active(self) -> list[Process]:
        """The processes of the cycle in flight."""
        return self.registry.active(self.cycle.number)

    def stale(self, cycle: object) -> str:
        return f"stale: cycle {short(cycle)} is not the current cycle {self.cycle.number}"

    def member(self, process_id: str, cycle: object) -> Process | Refusal:
        """The registered process of the current cycle that sent a message naming ``cycle``;
        else why not (every message from a process is checked here, once)."""
        process = self.registry.processes.get(process_id)
        if process is None:
            return Refusal("this process is not registered", unknown=True)
        if cycle != self.cycle.number or process.cycle != self.cycle.number:
            return Refusal(self.stale(cycle), unknown=False)
        return process

    def reject(self, what: dict[str, Any], reason: str) -> ev.Rejected:
        """Keep a bounded summary of a refused message, never the message itself: a rejected
        message may be anything a caller sent (ten 20 MB notices once grew the coordinator by
        840 MB). The decision that logs and counts it, with the (bounded) reason."""
        reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
        summary = short(what, 300)
        self.cycle.rejected.append({"at": self.now, "reason": reason, "what": summary})
        del self.cycle.rejected[:-KEEP_REJECTED]
        return ev.Rejected(summary, reason)

    def refuse(self, what: dict[str, Any], reason: str) -> list[ev.Decision]:
        """``reject``, and answer the caller with the reason."""
        rejected = self.reject(what, reason)
        return [rejected, ev.Replied(Reply.refused(rejected.reason, self.cycle.number))]

    def resolve_saves(self, process: Process, saved: set[Any], why: str) -> list[ev.Decision]:
        """Record the saver's fate for each shard it was to save (first word wins)."""
        out: list[ev.Decision] = []
        cycle = self.cycle
        if process.order is None or process.order.cycle != cycle.number:
            return out
        for assignment in process.order.saves:
            key = assignment.shard_key
            if assignment.is_backup or key in cycle.save_results:
                continue
            ok = key in saved
            cycle.save_results[key] = (ok, f"{process.name} saved it" if ok else why)
            out.append(ev.SaveResolved(cycle.number, key, *cycle.save_results[key]))
        return out

    def check_all_reported(self) -> list[ev.Decision]:
        """Every process of this cycle that got an order has reported, or died without a notice.

        Called on every report: it looks at the first of the processes still awaited
        (``awaiting_reports``, queued when the orders go out) and drops it while it is done, so
        each is looked at about once a cycle. Scanning every process on every report made the
        reports of 16,384 ranks cost the coordinator 41-48 s (``docs/benchmarks.md``,
        "reports"). A queue, not a set: the first element of a set that many were discarded
        from is found by stepping over their empty slots - quadratic again, 1.4 s of 2.1 s at
        16,384 reports and most of 28 s at 65,536."""
        out: list[ev.Decision] = []
        cycle = self.cycle
        if cycle.phase is not Phase.TEARING_DOWN or cycle.all_reported:
            return out
        awaiting, processes = cycle.awaiting_reports, self.registry.processes
        while awaiting:
            if _may_report(processes.get(awaiting[0]), cycle.number):
                return out
            awaiting.popleft()  # reported, lost, or no longer this cycle's
        cycle.all_reported = True
        out.append(ev.AllReported(cycle.number))
        return out


def _may_report(process: Process | None, cycle: int) -> bool:
    """``process`` got an order in ``cycle`` and has neither reported nor died."""
    return (
        process is not None
        and process.cycle == cycle
        and process.order is not None
        and process.report is None
        and not process.lost
    )
