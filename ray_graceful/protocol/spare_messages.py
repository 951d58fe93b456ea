"""Spares and standbys: the coordinator's word that ends a spare's wait, and its answers to the
driver that hands a slot to a spare or ends the job."""

from __future__ import annotations

from dataclasses import dataclass

from .words import JobState, SpareAction


@dataclass(frozen=True)
class SpareAnswer:
    """What ends a spare's or standby's wait: exit, or a slot to take (spares only)."""

    action: SpareAction
    reason: str = ""
    group: str | None = None
    rank: int | None = None
    cycle: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", SpareAction(self.action))


@dataclass(frozen=True)
class SpareAssigned:
    """``Coordinator.assign_spare``'s answer: the spare given ``group/rank`` for ``cycle``, or
    ``spare_id`` None and the ``reason`` none was."""

    spare_id: str | None
    group: str
    rank: int
    cycle: int | None = None
    reason: str = ""

    @property
    def assigned(self) -> bool:
        return self.spare_id is not None


@dataclass(frozen=True)
class JobClosed:
    """``Coordinator.job_finished``'s answer: the job's state now ("succeeded", "closed") and
    how many waiting spares and standbys were told to exit."""

    job_state: JobState
    spares_told: int
    cycle: int | None = None
