"""Spares and standbys, on the coordinator's side: a pool that waits and always gets its word.

A spare can be handed an evicted rank's slot for the next cycle - once: it leaves the pool with
its order; a standby only waits for the job to end. When the driver says the job is over
(``Coordinator.job_finished``) every one of them is told to exit 0 (NVIDIA's resiliency PR 266).

Plain state: a spare's word waits here (``SpareRecord.word``) until its long poll takes it; the
actor holds the polls and wakes one when the pool says a word is ready.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..protocol import SpareAnswer

ROLES = ("spare", "standby")


@dataclass
class SpareRecord:
    """One waiting spare or standby."""

    spare_id: str
    role: str  # "spare" | "standby"
    node_id: str
    pid: int
    word: SpareAnswer | None = None  # its word, until its poll takes it
    assigned: bool = False  # handed a slot: never handed another


class SparePool:
    """The spares and standbys waiting for their word."""

    def __init__(self) -> None:
        self.spares: dict[str, SpareRecord] = {}

    def add(self, spare_id: str, role: str, node_id: str, pid: int) -> SpareRecord:
        spare = SpareRecord(spare_id, role, node_id, pid)
        self.spares[spare_id] = spare
        return spare

    def tell(self, spare: SpareRecord, word: SpareAnswer) -> None:
        """Give ``spare`` its word; its poll takes it (the caller wakes the poll)."""
        spare.word = word

    def has_word(self, spare_id: str) -> bool:
        spare = self.spares.get(spare_id)
        return spare is not None and spare.word is not None

    def take(self, spare_id: str) -> SpareAnswer | None:
        """The spare's word, if it has one: it leaves the pool with it."""
        spare = self.spares.get(spare_id)
        if spare is None or spare.word is None:
            return None
        del self.spares[spare_id]
        return spare.word

    def leave(self, spare_id: str) -> bool:
        """A spare going away (SIGTERM): never hand it a slot."""
        return self.spares.pop(spare_id, None) is not None

    def waiting_spare(self) -> SpareRecord | None:
        for spare in free_spares(self.spares.values()):
            if spare.word is None:
                return spare
        return None

    def tell_all(self, word: SpareAnswer) -> list[str]:
        """Every spare and standby gets ``word`` (the job is over): their ids."""
        for spare in self.spares.values():
            spare.word = word
        return list(self.spares)

    def describe(self) -> list[dict[str, object]]:
        return [
            {"id": s.spare_id, "role": s.role, "node_id": s.node_id, "pid": s.pid}
            for s in self.spares.values()
        ]


def free_spares(
    spares: Iterable[SpareRecord], leaving: frozenset[str] = frozenset()
) -> list[SpareRecord]:
    """Spares that can take a slot, in registration order: never a standby, never one handed a
    slot already, never one on a node that is leaving."""
    return [s for s in spares if s.role == "spare" and not s.assigned and s.node_id not in leaving]
