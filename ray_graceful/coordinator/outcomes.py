"""The outcomes a coordinator published: written once, waited on, read back after a restart.

Each concluded cycle's ``TerminationOutcome`` goes out once - its file in
``report_dir/<job>``, its log line, its metrics - and ends every wait for it. A held cycle's is
written again as its step moves on (``held``): the file and ``wait_outcome`` then say where the
step is and what a restart resumes from. The newest stay
in memory, at most ``KEEP_OUTCOMES`` of them and, beyond the newest, only while they hold fewer
than ``KEEP_RECORDS`` reports and orders together: an outcome holds every rank's report and
order, about 1 KiB each, and keeping 16 of 4,096 ranks grew the coordinator by 5 MB a cycle
(``python -m benchmarks fanout``). An older one, or one a predecessor published before Ray
restarted the coordinator, is read back from its file, so ``wait_outcome(cycle=N)`` gives the
same answer from memory, from disk and across a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ..metrics import DURABLE_FAILURES, DURABLE_STEP, NOTICES, REJECTED, MetricDef, Metrics
from ..outcome import TerminationOutcome
from ..protocol import Result
from . import recovery

logger = logging.getLogger(__name__)

KEEP_OUTCOMES = 16  # concluded cycles whose outcome is kept in memory, at most
KEEP_RECORDS = 8192  # reports and orders the kept outcomes hold, beyond the newest one


class OutcomeBoard:
    """Publishes outcomes and answers waits for them (on the coordinator's event loop)."""

    def __init__(self, report_dir: str, job_id: str, predecessors_below: int = 0) -> None:
        self.report_dir, self.job_id = report_dir, job_id
        # A restarted coordinator: the cycles before this one were a predecessor's (their files
        # are theirs). Otherwise none are read back: a file there is another run's.
        self.predecessors_below = predecessors_below
        self.outcomes: dict[int, TerminationOutcome] = {}
        self.published: set[int] = set()  # by this coordinator: kept, or on disk
        self.events: dict[int, asyncio.Event] = {}
        try:
            self.metrics: Metrics | None = Metrics()
        except Exception:  # metrics are a courtesy (and need Ray); it works without them
            self.metrics = None

    def held(self, cycle: int, held: dict[str, Any]) -> None:
        """A held cycle's step moved on (``held.py``): its outcome is written again with where
        the step is now, and, once committed, what a restart resumes from - so that the file,
        the API and ``Coordinator.durability`` never disagree."""
        outcome = self.outcomes.get(cycle)
        if outcome is None or outcome.result is not Result.HELD:
            return  # not published yet (it takes ``held`` with it), or long gone
        resume = outcome.resume_from
        if held.get("durable_path"):
            resume = {"step": held["step"], "path": held["durable_path"]}
        elif held.get("stage") in ("in-keepers", "durable-failed"):
            resume = {"step": held["step"], "tier": "memory"}
        amended = dataclasses.replace(outcome, held=held, resume_from=resume)
        try:
            amended.publish(self.report_dir)
        except Exception:
            logger.exception("ray_graceful coordinator: could not publish the outcome again")
        self.outcomes[cycle] = amended

    def publish(self, outcome: TerminationOutcome) -> None:
        """Its file and log line, its metrics; the cycle's in-flight record goes; waits end."""
        try:
            outcome.publish(self.report_dir)
        except Exception:
            logger.exception("ray_graceful coordinator: could not publish the outcome")
        if self.metrics is not None:
            try:
                self.metrics.outcome(outcome)
            except Exception:
                logger.warning("ray_graceful coordinator: could not record metrics", exc_info=True)
        recovery.clear_in_flight(self.report_dir, self.job_id, outcome.cycle)
        self.outcomes[outcome.cycle] = outcome
        self.published.add(outcome.cycle)
        self.events.setdefault(outcome.cycle, asyncio.Event()).set()
        self._forget_old()

    def _forget_old(self) -> None:
        """Keep the newest outcomes within ``KEEP_OUTCOMES`` and ``KEEP_RECORDS``."""
        held = 0
        for rank, cycle in enumerate(sorted(self.outcomes, reverse=True)):
            outcome = self.outcomes[cycle]
            held += len(outcome.reports) + len((outcome.plan or {}).get("orders") or ())
            if rank > 0 and (rank >= KEEP_OUTCOMES or held > KEEP_RECORDS):
                del self.outcomes[cycle]
                self.events.pop(cycle, None)

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
        if cycle < self.predecessors_below or cycle in self.published:
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
        return self.get(cycle)

    def count(self, spec: MetricDef, tags: dict[str, str] | None = None) -> None:
        """One more of ``spec`` (a counter of ``metrics.py``), where metrics are recorded."""
        if self.metrics is not None:
            self.metrics.inc(spec, tags)

    def durable_changed(self, summary: dict, failed: bool) -> None:
        """A durable copy ended: the newest durable step, and one more failure where it failed
        every try."""
        if self.metrics is None:
            return
        if summary.get("step") is not None:
            self.metrics.set(DURABLE_STEP, summary["step"])
        if failed:
            self.metrics.inc(DURABLE_FAILURES)

    def count_rejected(self) -> None:
        self.count(REJECTED)

    def count_notice(self, source: str) -> None:
        self.count(NOTICES, {"source": source})
