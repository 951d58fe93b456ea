"""One cycle of the coordinator: its phases and what it has seen so far.

::

    IDLE --first notice--> GATHERING --notice_gather_s, or--> TEARING_DOWN --all reported, or the
     ^                                  every touched node         last deadline passed--+
     |                                  covered                                          |
     +------------- the next cycle opens <------------- CONCLUDED (outcome published) <---+

Every transition goes through ``Cycle.move``, which holds the table of them (``MOVES``) and
refuses any other: the machine (``machine.py``) decides when, this module what is allowed. How
a cycle concludes is ``conclusion.py``. A cycle always concludes: an error on the way becomes
an outcome with ``result="failed"`` and its reason, and the next cycle opens all the same.
Plain state only: no futures, no events (the actor owns those).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..notices import EvictionNotice
from ..plan import TerminationPlan
from ..word import Word
from .registry import Registry


class Phase(Word):
    IDLE = "idle"
    GATHERING = "gathering"
    TEARING_DOWN = "tearing down"
    CONCLUDED = "concluded"


# Where a cycle may go from each phase. Any phase may conclude: a cycle that fails on the way
# (an error while gathering, a commit that raised) concludes as "failed", with the reason.
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.GATHERING, Phase.CONCLUDED}),
    Phase.GATHERING: frozenset({Phase.TEARING_DOWN, Phase.CONCLUDED}),
    Phase.TEARING_DOWN: frozenset({Phase.CONCLUDED}),
    Phase.CONCLUDED: frozenset(),
}


REPORT_GRACE_S = 2.0  # how long after the last deadline reports are still waited for


class PhaseError(RuntimeError):
    """A cycle was moved where its table does not go: a bug in the machine, not an input."""


@dataclass
class Cycle:
    """What one cycle has seen so far."""

    number: int
    phase: Phase = Phase.IDLE
    notices: list[EvictionNotice] = field(default_factory=list)
    late_notices: list[EvictionNotice] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    plan: TerminationPlan | None = None
    train_fn_saves: bool = False  # the savers report to Ray Train, not to a checkpoint dir
    first_notice_at: float | None = None
    plan_at: float | None = None
    orders_at: float | None = None
    all_reported: bool = False
    # The processes given an order that may still report, in the orders' order
    # (``state.check_all_reported``).
    awaiting_reports: deque[str] = field(default_factory=deque)
    # Gathering ends early once every process on every node a notice touched is covered by a
    # notice: nothing more can be learned about those nodes (node -> processes not yet covered).
    uncovered: dict[str, set[str]] = field(default_factory=dict)
    noticed_ranks: set[tuple[str, int]] = field(default_factory=set)
    # Backup savers: each shard's saver's fate, once known (first word wins), and the shards
    # a backup saved because its saver could not.
    save_results: dict[str, tuple[bool, str]] = field(default_factory=dict)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    # Processes found FAULTY after the plan (process id -> the verdict): their saves are
    # taken over by their backups, and a backup's save of a shard stands over theirs
    # (``conclusion.trusted_records``).
    late_faulty: dict[str, str] = field(default_factory=dict)

    def move(self, to: Phase, at: float) -> None:
        """The one way a cycle's phase changes; ``at``: when (the first notice, the plan)."""
        if to not in MOVES[self.phase]:
            raise PhaseError(f"cycle {self.number} cannot go from {self.phase.value} to {to.value}")
        self.phase = to
        if to is Phase.GATHERING:
            self.first_notice_at = at
        elif to is Phase.TEARING_DOWN:
            self.plan_at = at

    @property
    def tearing_down(self) -> bool:
        return self.phase in (Phase.GATHERING, Phase.TEARING_DOWN)

    def all_notices(self) -> list[dict[str, Any]]:
        return [n.to_dict() for n in self.notices + self.late_notices]

    def cover(self, notice: EvictionNotice, registry: Registry) -> bool:
        """Count what ``notice`` tells about its node; all touched nodes covered: plan now.

        The gathering window is for notices that belong together: a SIGTERM to every rank of a
        pod, one notice per rank of a node. Once every notice so far is a SIGTERM or a drain,
        and every process on each node they touched has one, waiting longer learns nothing
        more about those nodes, and each millisecond of it is one the job is not training (a
        warm restart waits for the plan). A fault elsewhere that comes after the plan - within
        the window or later, it is the same event - has its saves taken over by their backups
        (``intake.fault_after_plan``). Any other notice (a health verdict, an API or cloud
        notice) keeps the whole window.

        Returns True once gathering may end now.
        """
        if notice.node_id is not None:
            node = notice.node_id
            self.uncovered[node] = set()
        else:
            if notice.rank is None:
                return False
            self.noticed_ranks.add(notice.rank)
            process = registry.process_of(notice.rank)
            if process is None:
                return False
            node = process.node_id
            if node not in self.uncovered:
                self.uncovered[node] = {
                    p.process_id for p in registry.active(self.number) if p.node_id == node
                }
            if all(key in self.noticed_ranks for key in process.keys):
                self.uncovered[node].discard(process.process_id)
        return not any(self.uncovered.values()) and all(
            n.source.planned_at_once for n in self.notices
        )
