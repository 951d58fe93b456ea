"""Backup savers: a shard is not lost because its designated saver cannot save.

The plan names, for every shard, a saver and (where another viable replica exists) a backup.
The backup's order says "save only if rank K cannot": it parks at its step boundary like any
rank, then asks (``SaveTurn``) and waits until the saver's fate is known - its ``SaveResult``
(sent as soon as its save step ended), its ``TeardownReport``, or its death - or until the
backup's own ``start_by``, the last moment its save still fits before its deadline. A saver
that saved makes the backup leave without saving; one that could not makes it save. Never
both: a shard has one writer, so a commit never sees two versions of it.

The cycle machine decides each saver's fate (``SaveResolved``, first word wins); this part,
owned by the actor, holds the backups' waits until that word arrives.
"""

from __future__ import annotations

import asyncio

from .events import SaveResolved

Fate = tuple[bool, str]  # (saved, why)


class BackupTurns:
    """The backups waiting on their saver's fate, by (cycle, shard key)."""

    def __init__(self) -> None:
        self.fates: dict[tuple[int, str], Fate] = {}
        self.events: dict[tuple[int, str], asyncio.Event] = {}

    def resolved(self, decision: SaveResolved) -> None:
        key = (decision.cycle, decision.shard_key)
        self.fates[key] = (decision.saved, decision.why)
        self.events.setdefault(key, asyncio.Event()).set()

    async def wait(self, cycle: int, shard_key: str, wait_s: float) -> Fate | None:
        """The saver's fate, once known within ``wait_s`` (at most an hour); else None."""
        key = (cycle, shard_key)
        event = self.events.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=max(min(wait_s, 3600.0), 0.0))
        except asyncio.TimeoutError:
            return None
        return self.fates[key]

    def forget_before(self, cycle: int) -> None:
        """A concluded cycle's turns are over: nothing of them is kept."""
        self.fates = {k: v for k, v in self.fates.items() if k[0] >= cycle}
        self.events = {k: v for k, v in self.events.items() if k[0] >= cycle}
