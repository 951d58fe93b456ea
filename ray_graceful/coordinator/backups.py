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
from collections.abc import Callable
from typing import Any

from ..protocol import Reply, TurnAnswer
from . import events as ev

Fate = tuple[bool, str]  # (saved, why)


class BackupTurns:
    """The backups waiting on their saver's fate, by (cycle, shard key)."""

    def __init__(self) -> None:
        self.fates: dict[tuple[int, str], Fate] = {}
        self.events: dict[tuple[int, str], asyncio.Event] = {}

    async def answer(
        self, decisions: list[ev.Decision], cycle: int, wait_s: float, take: Callable[..., Any]
    ) -> TurnAnswer:
        """A backup's ``SaveTurn``, once the machine stepped on it (``decisions``): refused,
        or answered when its saver's fate is known; a saver that could not save is taken back
        to the machine (``take``: ``BackupSaves``) before the backup is told to save."""
        wait = next((d for d in decisions if isinstance(d, ev.AwaitSaver)), None)
        if wait is None:
            refused = ev.reply_of(decisions)
            reason = refused.reason if isinstance(refused, Reply) else "no turn"
            return TurnAnswer(False, reason, cycle, accepted=False)
        fate = await self.wait(wait.cycle, wait.shard_key, wait_s)
        if fate is None:
            why = f"the saver had not reported by the backup's last start ({wait_s:.1f}s)"
            return TurnAnswer(False, why, wait.cycle)
        saved, why = fate
        if not saved:
            take(ev.BackupSaves(wait.cycle, wait.shard_key, why))
        return TurnAnswer(not saved, why, wait.cycle)

    def resolved(self, decision: ev.SaveResolved) -> None:
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
