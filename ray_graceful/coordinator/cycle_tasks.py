"""The coordinator's work that takes time: each cycle's task, its timers, its commits.

The machine decides (``machine.py``); the actor's methods turn calls into events (``actor.py``);
this runs, on the actor's event loop, what must wait: a cycle from its first notice to its
outcome (the gathering window, the reports, the commit on a thread), a held step's memory commit
and its disk copy, a timer that steps an event in at its time, and a cycle a predecessor left
open, concluded from the disk. Each ends by stepping the machine (``step``) - never by changing
the coordinator's state itself - or by publishing what the machine concluded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config import GracefulConfig
from ..protocol import Result
from . import events as ev
from . import gc_freeze, recovery
from .backups import BackupTurns
from .conclusion import CommitRequest, CommitResult, carry_out, written_through
from .cycle import REPORT_GRACE_S
from .fanout import Fanout
from .machine import CycleMachine
from .memory import MemoryTier
from .outcomes import OutcomeBoard

logger = logging.getLogger(__name__)

Step = Callable[[ev.Event], list[ev.Decision]]


class CycleTasks:
    """The tasks and waits of the coordinator's cycles (see the module docstring)."""

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str,
        machine: CycleMachine,
        step: Step,
        memory: MemoryTier,
        outcomes: OutcomeBoard,
        backups: BackupTurns,
        fanout: Fanout,
        settle_until: float,
    ) -> None:
        self.config, self.job_id, self.machine, self.step = config, job_id, machine, step
        self.memory, self.outcomes, self.backups, self.fanout = memory, outcomes, backups, fanout
        self.settle_until = settle_until  # after a restart: the first plan waits until then
        self.tasks: set[asyncio.Task] = set()
        self.events: dict[tuple[int, str], asyncio.Event] = {}  # (cycle, "gathered"...)

    def spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def event(self, cycle: int, what: str) -> asyncio.Event:
        """Set by the machine's ``Gathered`` / ``AllReported``; awaited by ``run_cycle``."""
        return self.events.setdefault((cycle, what), asyncio.Event())

    async def at(self, when: float, event: ev.Event) -> None:
        """Step ``event`` in at ``when`` (a timer: the machine reads no clock)."""
        await asyncio.sleep(max(when - time.time(), 0.0))
        self.step(event)

    # --- a cycle, from its first notice to its outcome ----------------------------------------

    async def run_cycle(self, cycle: int) -> None:
        """GATHERING -> TEARING_DOWN -> CONCLUDED -> the next cycle, whatever fails."""
        try:
            await self._until(self.event(cycle, "gathered"), self.config.notice_gather_s)
            await recovery.settled(self.machine.topology, self.settle_until)  # after a restart
            self.step(ev.GatheringClosed(cycle))
            plan = self.machine.cycle.plan
            if plan is not None:
                gc_freeze.freeze_held()  # the orders are out: see gc_freeze.py
                logger.info("ray_graceful: plan for cycle %s\n%s", cycle, plan.for_log())
                written = recovery.in_flight(self.machine.cycle, self.config, self.job_id)
                await asyncio.to_thread(recovery.record_in_flight, self.config.report_dir, written)
                last = max((o.deadline for o in plan.orders), default=time.time())
                wait_s = max(last - time.time(), 0) + REPORT_GRACE_S
                await self._until(self.event(cycle, "reported"), wait_s)  # missing: named
            [commit] = ev.of_kind(self.step(ev.ReportsClosed(cycle)), ev.Commit)
            landed = await self._carry_out(commit.request)
            self.step(ev.CommitDone(cycle, landed))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("ray_graceful coordinator: cycle %s failed", cycle)
            self.step(ev.CycleFailed(cycle, f"{type(exc).__name__}: {exc}"))
        finally:
            gc_freeze.thaw_held()
            for key in [k for k in self.events if k[0] <= cycle]:
                del self.events[key]
            self.backups.forget_before(cycle + 1)
            self.fanout.forget_except(set(self.machine.registry.processes))
            await asyncio.to_thread(gc_freeze.give_back_freed)  # off the loop: see gc_freeze.py

    async def _carry_out(self, request: CommitRequest) -> CommitResult:
        """The commit, on a thread (the disk, nothing else). One whole in keepers whose nodes
        are all leaving is written through to disk by them first: committed once it is."""
        landed = await asyncio.to_thread(carry_out, request)
        if landed.write_through is None:
            return landed
        logger.warning(
            "ray_graceful coordinator: step %s of cycle %s is whole in the keepers, but their "
            "nodes are leaving: writing it through to disk (%s)",
            landed.write_through.step,
            request.cycle,
            landed.reason,
        )
        return written_through(landed, await self.memory.write_through(landed.write_through))

    @staticmethod
    async def _until(event: asyncio.Event, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass  # the window closed: the cycle goes on with what it has

    def publish(self, concluded: ev.Concluded) -> None:
        """The outcome goes out once (``outcomes.py``); the memory tier acts on the commit."""
        outcome = concluded.outcome
        if self.config.memory_replicas:
            outcome = dataclasses.replace(outcome, durable=self.memory.durable_summary())
        self.outcomes.publish(outcome)
        if concluded.outcome.result is not Result.HELD:  # a held step commits later
            self.memory.after_commit(concluded.outcome.cycle, concluded.memory)

    async def conclude_left(self, cycle: recovery.InFlight) -> None:
        """A cycle our predecessor opened: concluded from the disk once its ranks are gone."""
        outcome, memory = await recovery.conclude_when_over(
            cycle, REPORT_GRACE_S, self.memory.keepers, self.config.memory_replicas
        )
        self.publish(ev.Concluded(outcome, memory, None))

    # --- held steps: the machine decides (``held.py``); here, the commit and the disk copy ----

    async def commit_held(self, request: CommitRequest) -> None:
        """Every copy landed: commit the step in memory, then (``MakeDurable``) on disk - or,
        where its keepers are leaving, on disk through them at once."""
        # Nodes that got notices since the cycle concluded (later cycles) leave too: a keeper
        # there does not count, as a late notice's does not (``memory/commit.py``).
        leaving = request.evicted_nodes | frozenset(self.memory.leaving)
        request = dataclasses.replace(request, evicted_nodes=leaving)
        self.step(ev.HeldCommitted(request.cycle, await self._carry_out(request)))

    async def when_durable(self, cycle: int) -> None:
        durable = await self.memory.wait_durable(cycle, REPORT_GRACE_S + 600.0)
        self.step(ev.HeldDurable(cycle, durable))
