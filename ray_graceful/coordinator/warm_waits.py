"""The waits around a warm restart, on the actor's event loop: members' asks, its end.

The machine decides a warm restart (``warm_restarts.py``); what waits on it lives here: each
member's held ask for its rendezvous (answered once the cycle concluded), and the events that
say a warm restart is over - ``Coordinator.wait_rejoined`` and the memory tier's disk copy (which
starts only once the group re-formed, so that the copy's reads never sit in its way) wait on
them. The records themselves are the machine's; this only reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..protocol import Rendezvous
from .fanout import held, resolve
from .warm_restarts import WarmRestarts


class WarmWaits:
    """Held rendezvous asks, and an ``asyncio.Event`` per warm restart that is over."""

    def __init__(self, warm: WarmRestarts) -> None:
        self.warm = warm
        self.asks: dict[str, asyncio.Future] = {}  # member -> its held ask
        self.over: dict[int, asyncio.Event] = {}  # cycle -> its warm restart is over

    async def rendezvous(self, member: str, wait_s: float) -> Rendezvous | None:
        """A member's answer, held until the cycle concluded (None after ``wait_s``)."""
        answer = self.warm.answer(member)
        if answer is not None:
            return answer
        return await held(self.asks, member, wait_s)

    def answer_asks(self) -> None:
        """A warm restart was decided: every member's held ask gets its answer."""
        for member, future in list(self.asks.items()):
            answer = self.warm.answer(member)
            if answer is not None:
                resolve(future, answer)

    def finished(self, cycle: int) -> asyncio.Event:
        """Set once the warm restart into ``cycle`` is over; kept as long as its record."""
        for old in [c for c in self.over if c not in self.warm.records and c != cycle]:
            del self.over[old]
        return self.over.setdefault(cycle, asyncio.Event())

    async def rejoin_done(self, cycle: int) -> None:
        """Until the warm restart out of ``cycle`` (if any) heard from every member - not for
        a group started anew (``WarmRecord.anew``): no survivor trains there whose reads the
        copy could sit in the way of, and where Train restarted the group whole nobody ever
        joins it."""
        record = self.warm.records.get(cycle + 1)
        if record is not None and not record.finished and not record.anew:
            await self.finished(cycle + 1).wait()

    async def record(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """The record of the warm restart into ``cycle`` once every member spoke (or now)."""
        record = self.warm.records.get(cycle)
        if record is None:
            return None
        if not record.finished:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.finished(cycle).wait(), timeout)
        return record.to_dict()
