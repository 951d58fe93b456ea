"""Backup savers: a shard is not lost because its designated saver cannot save.

The plan names, for every shard, a saver and (where another viable replica exists) a backup.
The backup's order says "save only if rank K cannot": it parks at its step boundary like any
rank, then asks (``SaveTurn``) and waits here until the saver's fate is known - its
``SaveResult`` (sent as soon as its save step ended), its ``TeardownReport``, or its death - or
until the backup's own ``start_by``, the last moment its save still fits before its deadline.
A saver that saved makes the backup leave without saving; one that could not makes it save.
Never both: a shard has one writer, so a commit never sees two versions of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from ..notices import short
from ..protocol import ProtocolError, Reply, SaveResult, SaveTurn, check_version
from .registry import Process

if TYPE_CHECKING:
    from .actor import CoordinatorActor


class FallbackMixin:
    """The backup savers' part of ``CoordinatorActor``."""

    async def save_result(self: CoordinatorActor, message: SaveResult) -> Reply:
        """A saver's save step ended: its backups are told at once."""
        try:
            check_version(message)
        except (ProtocolError, AttributeError) as exc:
            return self._reject({"save_result": short(message)}, str(exc))
        process = self.registry.processes.get(message.process_id)
        if process is None or message.cycle != self.cycle.number:
            return self._reject(
                {"process": message.process_id, "cycle": message.cycle},
                self._stale(message.cycle),
            )
        self._resolve_saves(process, set(message.saved), message.reason or "its save failed")
        return Reply.ok(self.cycle.number)

    async def save_turn(self: CoordinatorActor, message: SaveTurn, wait_s: float) -> Reply:
        """A backup asks whether it must save; answered once the saver's fate is known."""
        try:
            check_version(message)
        except (ProtocolError, AttributeError) as exc:
            return self._reject({"save_turn": short(message)}, str(exc))
        cycle = self.cycle
        process = self.registry.processes.get(message.process_id)
        if process is None or message.cycle != cycle.number:
            return Reply.refused(self._stale(message.cycle), cycle.number)
        if process.order is None:
            return Reply.refused("this process has no order in this cycle", cycle.number)
        if not any(s.is_backup and s.shard_key == message.shard_key for s in process.order.saves):
            return Reply.refused(f"this process is no backup of {message.shard_key}", cycle.number)
        resolved = cycle.save_resolved.setdefault(message.shard_key, asyncio.Event())
        try:
            await asyncio.wait_for(resolved.wait(), timeout=max(min(wait_s, 3600.0), 0.0))
        except asyncio.TimeoutError:
            return Reply.ok(
                cycle.number,
                save=False,
                why=f"the saver had not reported by the backup's last start ({wait_s:.1f}s)",
            )
        saved, why = cycle.save_results[message.shard_key]
        if not saved:
            cycle.fallbacks.append({"shard": message.shard_key, "at": time.time(), "why": why})
        return Reply.ok(cycle.number, save=not saved, why=why)

    def _resolve_saves(self: CoordinatorActor, process: Process, saved: set[str], why: str) -> None:
        """Record the saver's fate for each shard it was to save (first word wins)."""
        cycle = self.cycle
        if process.order is None or process.order.cycle != cycle.number:
            return
        for assignment in process.order.saves:
            key = assignment.shard_key
            if assignment.is_backup or key in cycle.save_results:
                continue
            ok = key in saved
            cycle.save_results[key] = (ok, f"{process.name} saved it" if ok else why)
            cycle.save_resolved.setdefault(key, asyncio.Event()).set()
