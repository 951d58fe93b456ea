"""The coordinator's watcher: Ray's drain state and the actor table, polled and supervised.

A node being drained (``ray start --block`` on SIGTERM, the autoscaler, KubeRay) is listed with
its deadline; a registered rank's actor found DEAD with no notice at all (SIGKILL, OOM, a crash)
is "lost" - its peers must not wait for it in their collective. Both come from injected sources
(``ray_adapter`` by default, as Ray Train's ``PreemptionWatcher`` takes its drain source), read
on a thread; what they say goes to the cycle machine as an event (``DrainsSeen``,
``RanksLost``). The watcher runs supervised: an unexpected error is logged, recorded in
``failures`` (``status()`` shows them), and the watcher restarted; a malformed answer is the
machine's to reject, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .events import DrainsSeen, DrainUnreadable, Event, RanksLost

logger = logging.getLogger(__name__)

DrainSource = Callable[[], dict[str, int]]  # {node_id_hex: deadline_ms}
LostSource = Callable[[set[str]], set[str]]  # actor ids -> the dead ones
KEEP_FAILURES = 20


class Watcher:
    """Polls the drain and lost sources every ``interval_s``; feeds what they say to ``take``."""

    def __init__(
        self,
        drain_source: DrainSource,
        lost_source: LostSource,
        interval_s: float,
        watched: Callable[[], frozenset[str]],
        take: Callable[[Event], object],
    ) -> None:
        self.drain_source = drain_source
        self.lost_source = lost_source
        self.interval_s = interval_s
        self.watched = watched
        self.take = take
        self.failures: list[str] = []
        self._task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        """Start the watcher on the running loop, or again if it ended."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        while True:
            try:
                await self._watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("ray_graceful coordinator: the watcher failed; restarting it")
                self.record_failure(f"watcher: {type(exc).__name__}: {exc}")
                await asyncio.sleep(self.interval_s)

    def record_failure(self, what: str) -> None:
        """An error of background work, kept (the last 20) for ``status()``."""
        self.failures.append(what)
        del self.failures[:-KEEP_FAILURES]

    async def _watch(self) -> None:
        while True:
            try:
                drains = await asyncio.to_thread(self.drain_source)
            except Exception as exc:
                self.take(DrainUnreadable(repr(exc)))
            else:
                self.take(DrainsSeen(dict(drains)))
            await self._watch_lost()
            await asyncio.sleep(self.interval_s)

    async def _watch_lost(self) -> None:
        watched = self.watched()
        if not watched:
            return
        try:
            dead = await asyncio.to_thread(self.lost_source, set(watched))
        except Exception as exc:
            logger.warning("ray_graceful coordinator: cannot read the actor table: %r", exc)
            return  # the GCS is unreachable for a moment: next round
        if dead:
            self.take(RanksLost(frozenset(dead)))
