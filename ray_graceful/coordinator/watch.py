"""The coordinator's watcher: Ray's drain state and the actor table, polled and supervised.

A node being drained (``ray start --block`` on SIGTERM, the autoscaler, KubeRay) is listed with
its deadline; a registered rank's actor found DEAD with no notice at all (SIGKILL, OOM, a crash)
is "lost" - its peers must not wait for it in their collective. Both come from injected sources
(``ray_adapter`` by default). The watcher runs supervised: an unexpected error is logged,
recorded in ``status()["failures"]``, and the watcher restarted; a malformed answer is rejected,
never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..notices import EvictionNotice, NoticeError, short
from .cycle import Phase

if TYPE_CHECKING:
    from .actor import CoordinatorActor

logger = logging.getLogger(__name__)


class WatcherMixin:
    """The watcher's part of ``CoordinatorActor``."""

    # --- background: supervised ------------------------------------------------------------

    def _ensure_background(self: CoordinatorActor) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._supervise_watcher())

    async def _supervise_watcher(self: CoordinatorActor) -> None:
        """Run the watcher; an unexpected error is logged and the watcher restarted."""
        while True:
            try:
                await self._watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("ray_graceful coordinator: the watcher failed; restarting it")
                self._record_failure(f"watcher: {type(exc).__name__}: {exc}")
                await asyncio.sleep(self.config.drain_poll_interval_s)

    def _record_failure(self: CoordinatorActor, what: str) -> None:
        self.failures.append(what)
        del self.failures[:-20]

    async def _watch(self: CoordinatorActor) -> None:
        while True:
            await self._watch_drains()
            await self._watch_lost()
            await asyncio.sleep(self.config.drain_poll_interval_s)

    async def _watch_drains(self: CoordinatorActor) -> None:
        """Ray's drain state, with each node's deadline: the dependable notice on Ray."""
        try:
            drains = await asyncio.to_thread(self.drain_source)
        except Exception as exc:
            self._reject({"source": "drain"}, f"could not read Ray's drain state: {exc!r}")
            return
        number = self.cycle.number
        for node_id, deadline_ms in dict(drains).items():
            if self.drains_seen.get(node_id) == number:
                continue
            if isinstance(deadline_ms, int) and deadline_ms >= 0:
                self._keeper_node_leaving(node_id, deadline_ms / 1000.0)  # ranks there or not
            if not self.registry.has_node(node_id, number):
                continue  # a node this job has no rank on
            if not isinstance(deadline_ms, int) or deadline_ms < 0:
                self._reject(
                    {"source": "drain", "node_id": node_id},
                    f"Ray's drain state gave deadline {short(deadline_ms)}: not milliseconds",
                )
                continue
            self.drains_seen[node_id] = number
            try:
                notice = EvictionNotice(
                    "drain",
                    "Ray is draining the node",
                    number,
                    deadline_ms / 1000.0,
                    node_id=node_id,
                )
            except NoticeError as exc:
                self._reject({"source": "drain", "node_id": node_id}, str(exc))
                continue
            await self._on_notices([notice])

    async def _watch_lost(self: CoordinatorActor) -> None:
        """A registered rank's actor died with no notice: its peers must not wait for it.

        Watched in every state: a rank killed mid-teardown has no report coming, and the cycle
        concludes as soon as every other process reported instead of at the last deadline.
        """
        if self.job_state != "running":
            return  # the job is over: its actors going away is no eviction
        watched = {
            p.actor_id: p
            for p in self.registry.active(self.cycle.number)
            if p.actor_id and not p.lost
        }
        if not watched:
            return
        try:
            dead = await asyncio.to_thread(self.lost_source, set(watched))
        except Exception as exc:
            logger.warning("ray_graceful coordinator: cannot read the actor table: %r", exc)
            return  # the GCS is unreachable for a moment: next round
        for actor_id in dead:
            watched[actor_id].lost = True
            self._resolve_saves(watched[actor_id], set(), "its process died")
        if not dead:
            return
        self._check_all_reported()
        if self.cycle.phase is Phase.TEARING_DOWN:
            return  # orders are out: the dead rank's peers were released with them
        notices = [
            EvictionNotice(
                "lost",
                "the rank's process died without a notice",
                self.cycle.number,
                time.time(),
                rank=key,
            )
            for actor_id in dead
            for key in watched[actor_id].keys
        ]
        await self._on_notices(notices)
