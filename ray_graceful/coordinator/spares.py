"""Spares and standbys, on the coordinator's side: a pool that waits and always gets its word.

A spare can be handed an evicted rank's slot for the next cycle - once: it leaves the pool with
its order; a standby only waits for the job to end. When the driver says the job is over
(``Coordinator.job_finished``) every one of them is told to exit 0 (NVIDIA's resiliency PR 266).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..notices import short
from ..protocol import Reply, SpareOrder
from .registry import Spare, poll_timeout

if TYPE_CHECKING:
    from .actor import CoordinatorActor


class SparesMixin:
    """The spares' part of ``CoordinatorActor``."""

    # --- spares and standbys -----------------------------------------------------------------

    async def register_spare(
        self: CoordinatorActor, spare_id: str, role: str, node_id: str, pid: int
    ) -> Reply:
        if role not in ("spare", "standby"):
            return Reply.refused(f"role {short(role)}: one of 'spare', 'standby'")
        spare = Spare(spare_id, role, node_id, pid)
        self.registry.spares[spare_id] = spare
        if self.job_state != "running":
            spare.order = SpareOrder("exit", f"job {self.job_state}")
        elif role == "spare":  # the copy of the shard it will load can wait on its own node
            self._ensure_keeper(node_id)
        return Reply.ok(self.cycle.number)

    async def poll_spare(self: CoordinatorActor, spare_id: str, wait_s: float) -> SpareOrder | None:
        spare = self.registry.spares.get(spare_id)
        if spare is None:
            return SpareOrder("exit", "this spare is not registered")
        if spare.order is None:
            future = asyncio.get_running_loop().create_future()
            spare.waiter = future
            try:
                spare.order = await asyncio.wait_for(future, timeout=poll_timeout(wait_s))
            except asyncio.TimeoutError:
                return None
            finally:
                spare.waiter = None
        order, spare.order = spare.order, None
        self.registry.spares.pop(spare_id, None)  # it has its word: it leaves the pool
        return order

    async def leave_spare(self: CoordinatorActor, spare_id: str, reason: str) -> Reply:
        """A spare or standby is going away (SIGTERM): never hand it a slot."""
        spare = self.registry.spares.pop(spare_id, None)
        return Reply(spare is not None, reason)

    async def job_finished(
        self: CoordinatorActor, success: bool = True, permanent: bool = True
    ) -> dict:
        """The job is over (success, or closed for good): every spare and standby exits 0."""
        self.job_state = "succeeded" if success else "closed" if permanent else self.job_state
        spares = list(self.registry.spares.values())
        for spare in spares:
            self.registry.tell_spare(spare, SpareOrder("exit", f"job {self.job_state}"))
        return {"job_state": self.job_state, "spares_told": len(spares)}

    async def assign_spare(self: CoordinatorActor, group: str, rank: int) -> dict:
        """Hand a waiting spare the slot of ``group/rank`` for the next cycle (once)."""
        spare = self.registry.waiting_spare()
        if spare is None:
            return {"assigned": None, "reason": "no spare is waiting"}
        spare.assigned = True
        order = SpareOrder(
            "assigned", "given an evicted rank's slot", group, rank, self.cycle.number
        )
        self.registry.tell_spare(spare, order)
        return {"assigned": spare.spare_id, "group": group, "rank": rank, "cycle": order.cycle}
