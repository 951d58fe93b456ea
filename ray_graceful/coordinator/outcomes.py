"""The outcomes a coordinator published: written once, waited on, read back after a restart.

Each concluded cycle's ``TerminationOutcome`` goes out once - its file in
``report_dir/<job>``, its log line, its metrics - and ends every wait for it. The last
``KEEP_OUTCOMES`` stay in memory (each holds every rank's report); an older one, or one a
predecessor published before Ray restarted the coordinator, is read back from its file, so
``wait_outcome(cycle=N)`` gives the same answer across a restart.
"""

from __future__ import annotations

import asyncio
import logging

from ..outcome import OutcomeMetrics, TerminationOutcome
from . import recovery

logger = logging.getLogger(__name__)

KEEP_OUTCOMES = 16  # concluded cycles whose outcome is kept in memory


class OutcomeBoard:
    """Publishes outcomes and answers waits for them (on the coordinator's event loop)."""

    def __init__(self, report_dir: str, job_id: str, predecessors_below: int = 0) -> None:
        self.report_dir, self.job_id = report_dir, job_id
        # A restarted coordinator: the cycles before this one were a predecessor's (their files
        # are theirs). Otherwise none are read back: a file there is another run's.
        self.predecessors_below = predecessors_below
        self.outcomes: dict[int, TerminationOutcome] = {}
        self.events: dict[int, asyncio.Event] = {}
        try:
            self.metrics: OutcomeMetrics | None = OutcomeMetrics()
        except Exception:  # metrics are a courtesy (and need Ray); it works without them
            self.metrics = None

    def publish(self, outcome: TerminationOutcome) -> None:
        """Its file and log line, its metrics; the cycle's in-flight record goes; waits end."""
        try:
            outcome.publish(self.report_dir)
        except Exception:
            logger.exception("ray_graceful coordinator: could not publish the outcome")
        if self.metrics is not None:
            try:
                self.metrics.record(outcome)
            except Exception:
                logger.warning("ray_graceful coordinator: could not record metrics", exc_info=True)
        recovery.clear_in_flight(self.report_dir, self.job_id, outcome.cycle)
        self.outcomes[outcome.cycle] = outcome
        self.events.setdefault(outcome.cycle, asyncio.Event()).set()
        for old in [c for c in self.outcomes if c < outcome.cycle - KEEP_OUTCOMES]:
            del self.outcomes[old]
            self.events.pop(old, None)

    def latest(self) -> int | None:
        return max(self.outcomes, default=None)

    def awaited(self, current: int, tearing_down: bool) -> int:
        """The cycle a caller naming none waits for: the one in flight while a teardown is
        under way or none concluded yet, else the last concluded (a driver asking right after
        an eviction wants that eviction's outcome, not the next one's)."""
        latest = self.latest()
        return current if tearing_down or latest is None else latest

    def get(self, cycle: int) -> TerminationOutcome | None:
        """The outcome of ``cycle`` if it was published (here, or by a predecessor)."""
        if cycle in self.outcomes:
            return self.outcomes[cycle]
        if cycle < self.predecessors_below:
            return recovery.read_outcome(self.report_dir, self.job_id, cycle)
        return None

    async def wait(self, cycle: int, timeout: float) -> TerminationOutcome | None:
        found = self.get(cycle)
        if found is not None:
            return found
        event = self.events.setdefault(cycle, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return None
        return self.outcomes.get(cycle)

    def count_rejected(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc()

    def count_notice(self, source: str) -> None:
        if self.metrics is not None:
            self.metrics.notices.inc(tags={"source": source})
