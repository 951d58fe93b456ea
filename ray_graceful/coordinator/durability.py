"""Where a step is now, and where a member loads a shard of it from: the held steps (the
machine's, ``held.py``) read together with the memory tier's records (``memory.py``).

Two answers of the actor's: ``Coordinator.durability(cycle)`` - held by the group, in the
keepers, on disk, or lost - and ``memory_checkpoint`` - the keepers a member loads a shard from,
which for a warm restart's member may be a step that is held and not committed yet.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .held import HeldSteps, memory_durability
from .memory import MemoryTier

COPY_POLL_S = 0.05  # how often a load waits on a leaver's copy of its shard


def durability(held: HeldSteps, memory: MemoryTier, cycle: int) -> dict[str, Any] | None:
    """Where cycle ``cycle``'s step is now: held by the group, in the keepers, on disk."""
    described = held.describe(cycle)
    if described is not None:
        return described
    record = memory.record(cycle)
    return memory_durability(record) if record is not None else None


async def loadable(
    held: HeldSteps, memory: MemoryTier, shard_key: str, step: int | None, wait_s: float
) -> dict[str, Any] | None:
    """The newest memory checkpoint that holds ``shard_key``: its step, {node: keeper}.

    ``step``: a warm restart's member loading that step, which may be held and not committed
    yet - a keeper's copy of its evicted shards is loadable already. A copy on its way (its
    holder left the group and copies it as it goes) is waited for, at most ``wait_s``, rather
    than an older step offered. Without ``step`` (a cold restart), a held step of the shard
    still settling - its copies landing, its memory commit running - is waited for, at most
    ``wait_s``, for the same reason: offered the step before it, the restart would lose it."""

    def waiting() -> bool:
        if step is None:
            return held.settling(shard_key)
        return held.awaiting_copy(shard_key, step)

    until = time.monotonic() + wait_s
    while waiting() and time.monotonic() < until:
        await asyncio.sleep(COPY_POLL_S)
    if step is not None:
        copy = held.saved_copy(shard_key, step)
        if copy is not None:
            names = memory.names(copy.holders)
            return {"step": step, "holders": dict(zip(copy.holders, names, strict=True))}
    return await memory.checkpoint_for(shard_key)
