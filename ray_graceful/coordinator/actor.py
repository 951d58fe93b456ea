"""The coordinator actor: one async Ray actor per job that turns notices into a bounded end.

Workers register their ranks (``Register``) and hold a long poll open (``poll``); when a cycle's
plan is made, every pending poll is answered at once with that process's ``Order`` - the
fan-out - so an order reaches a rank whose training thread is stuck in a collective. An order
is answered to every poll until the process acknowledges it (``ack``): delivery is at least
once, and the worker side handles it once. Notices come from Ray's drain state and the actor
table (both through injected sources, ``ray_adapter`` by default), from workers' SIGTERM
listeners, from ``notify`` (the CLI) and from health verdicts that turn FAULTY.

The cycle's state machine is in ``cycle.py``; each transition is one method here:
``_on_notices`` (IDLE -> GATHERING), ``_plan_and_order`` (GATHERING -> TEARING_DOWN),
``_conclude`` (TEARING_DOWN -> CONCLUDED) and ``_open_next_cycle``. Background work (the drain
and lost-rank watcher, each cycle's teardown) is supervised: an error is logged and either
restarts the watcher or concludes the cycle as failed, with the reason in the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from .. import ray_adapter
from ..config import GracefulConfig
from ..health import FAULTY, UNKNOWN, HealthReport
from ..memory.commit import MemoryCheckpoint
from ..notices import EvictionNotice, NoticeError, short
from ..outcome import OutcomeMetrics, TerminationOutcome
from ..plan import RankInfo, RankOrder, TerminationPlan, incomplete_groups, plan_termination
from ..protocol import (
    Ack,
    Order,
    PollAnswer,
    PollState,
    ProtocolError,
    Register,
    Rejoined,
    Rendezvous,
    Reply,
    SaveAssignment,
    SigtermSeen,
    check_version,
    shard_key,
)
from ..rendezvous import host_store
from ..worker.report import TeardownReport
from .cycle import Cycle, Phase, conclude, failed
from .fallback import FallbackMixin
from .memory import MemoryTierMixin
from .registry import Process, Registry, poll_timeout
from .spares import SparesMixin
from .warm import StoreFactory, WarmRestarts
from .watch import WatcherMixin

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 2.0  # how long after the last deadline reports are still waited for
MAX_CONCURRENCY = 20_000  # pending polls the actor holds at once
KEEP_OUTCOMES = 16  # concluded cycles whose outcome wait_outcome() can still return
KEEP_REJECTED = 200  # rejected messages remembered per cycle (status shows the last 20)
MAX_REASON = 500  # characters of a rejection's reason kept and echoed back

DrainSource = Callable[[], dict[str, int]]  # {node_id_hex: deadline_ms}
LostSource = Callable[[set[str]], set[str]]  # actor ids -> the dead ones


class CoordinatorActor(WatcherMixin, SparesMixin, FallbackMixin, MemoryTierMixin):
    """The actor's implementation (started through ``Coordinator.start``).

    Ray's drain state and actor table come in through ``drain_source`` and ``lost_source``
    (default: ``ray_adapter``), as Ray Train's ``PreemptionWatcher`` takes its drain source:
    the logic runs, and is unit-tested, without a cluster.
    """

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str = "",
        drain_source: DrainSource | None = None,
        lost_source: LostSource | None = None,
        store_factory: StoreFactory | None = None,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.drain_source = drain_source or ray_adapter.draining_nodes
        self.lost_source = lost_source or ray_adapter.dead_actors
        self.registry = Registry()
        self.warm = WarmRestarts(config, store_factory or host_store)
        self.warm.prepare()
        self.cycle = Cycle(0)
        self.job_state = "running"
        self.outcomes: dict[int, TerminationOutcome] = {}
        self.outcome_events: dict[int, asyncio.Event] = {}
        self.save_times: dict[tuple[str, str], float] = {}
        self.drains_seen: dict[str, int] = {}
        self.failures: list[str] = []  # errors of background work, shown in status()
        self.polls_served = 0
        self.instance_id = uuid.uuid4().hex[:8]  # names this coordinator's keepers
        self.keepers: dict[str, Any] = {}  # node id -> its keeper (memory tier)
        self.memory_checkpoints: dict[int, MemoryCheckpoint] = {}  # step -> committed in memory
        self.leaving: dict[str, float] = {}  # keeper nodes being evicted -> their deadline
        self.durable_events: dict[int, asyncio.Event] = {}
        self.background: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        try:
            self.metrics: OutcomeMetrics | None = OutcomeMetrics()
        except Exception:  # metrics are a courtesy (and need Ray); it works without them
            self.metrics = None

    # --- registration ------------------------------------------------------------------------

    async def register(self, message: Register) -> Reply:
        """A worker process registers its ranks; the reply names the cycle it belongs to."""
        self._ensure_background()
        try:
            message.check()
        except (ProtocolError, AttributeError) as exc:
            return self._reject({"register": short(message)}, f"malformed registration: {exc}")
        if self.job_id and message.job_id != self.job_id and not self.config.coordinator_name:
            return self._reject(
                {"process": message.process_id, "job_id": message.job_id},
                f"this coordinator belongs to job {self.job_id}, not to job "
                f"{message.job_id or '?'}; each job starts its own (or set the same "
                "coordinator_name in every job that should share one)",
            )
        if self.cycle.tearing_down:
            # The previous group is still leaving: its ranks are what this cycle plans for.
            # The worker's control thread registers again until the next cycle accepts it.
            return Reply.refused(
                f"cycle {self.cycle.number} is being torn down; registering again once it ended",
                self.cycle.number,
                retry=True,
            )
        if self.job_state != "running":
            return Reply.refused(f"the job is {self.job_state}", self.cycle.number)
        self.registry.register(message, self.cycle.number)
        self._ensure_keeper(message.node_id)
        return Reply.ok(self.cycle.number)

    # --- the long poll (the fan-out) ---------------------------------------------------------

    async def poll(
        self, process_id: str, cycle: int, state: PollState, wait_s: float
    ) -> PollAnswer:
        """Held open by each worker process; answered with its order, or "idle" after wait_s."""
        self._ensure_background()
        self.polls_served += 1
        process = self.registry.processes.get(process_id)
        if process is None:
            return PollAnswer("unknown", reason="this process is not registered")
        if cycle != self.cycle.number or process.cycle != self.cycle.number:
            reason = self._stale(cycle)
            self._reject({"process": process_id, "cycle": cycle}, reason)
            return PollAnswer("stale", reason=reason)
        process.last_seen = time.time()
        if isinstance(state, PollState):
            if state.last_step is not None:
                process.last_step = state.last_step
            if isinstance(state.health, HealthReport):
                await self._update_health(process, state.health)
        if process.order is not None and not process.acked:
            return PollAnswer("order", process.order)  # (again) until acknowledged
        future = asyncio.get_running_loop().create_future()
        process.waiter = future
        try:
            return await asyncio.wait_for(future, timeout=poll_timeout(wait_s))
        except asyncio.TimeoutError:
            return PollAnswer("idle")
        finally:
            if process.waiter is future:
                process.waiter = None

    async def ack(self, message: Ack) -> Reply:
        """A process has its order: it is not sent again."""
        try:
            check_version(message)
        except (ProtocolError, AttributeError) as exc:
            return self._reject({"ack": short(message)}, str(exc))
        process = self.registry.processes.get(message.process_id)
        if process is None or process.order is None or process.order.order_id != message.order_id:
            return Reply.refused("no such order", self.cycle.number)
        process.acked = True
        return Reply.ok(self.cycle.number)

    async def _update_health(self, process: Process, report: HealthReport) -> None:
        was = process.health.verdict if process.health else UNKNOWN
        process.health = report
        if report.verdict == FAULTY and was != FAULTY:
            notices = [
                EvictionNotice(
                    "health", f"GPU FAULTY: {report.summary()}", self.cycle.number, rank=key
                )
                for key in process.keys
            ]
            await self._on_notices(notices)

    # --- notices -----------------------------------------------------------------------------

    def _stale(self, cycle: Any) -> str:
        return f"stale: cycle {short(cycle)} is not the current cycle {self.cycle.number}"

    def _reject(self, what: dict[str, Any], reason: str) -> Reply:
        # Kept as a bounded summary, never the message itself: a rejected message may be
        # anything a caller sent (ten 20 MB notices once grew the coordinator by 840 MB).
        reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
        summary = short(what, 300)
        self.cycle.rejected.append({"at": time.time(), "reason": reason, "what": summary})
        del self.cycle.rejected[:-KEEP_REJECTED]
        logger.warning("ray_graceful coordinator: rejected %s: %s", summary, reason)
        if self.metrics is not None:
            self.metrics.rejected.inc()
        return Reply.refused(reason, self.cycle.number)

    async def report_sigterm(self, message: SigtermSeen) -> Reply:
        """A worker's listener saw SIGTERM: every rank of that process is being evicted."""
        try:
            message.check()
        except (ProtocolError, AttributeError) as exc:
            return self._reject({"sigterm": short(message)}, str(exc))
        process = self.registry.processes.get(message.process_id)
        if process is None:
            return self._reject(
                {"process": message.process_id}, "SIGTERM from an unregistered process"
            )
        if message.cycle != self.cycle.number:
            return self._reject(
                {"process": message.process_id, "cycle": message.cycle}, self._stale(message.cycle)
            )
        notices = [
            EvictionNotice(
                "sigterm",
                "SIGTERM",
                message.cycle,
                0.0,
                rank=key,
                received_at=message.received_at,
            )
            for key in process.keys
        ]
        return await self._on_notices(notices)

    async def notify(self, data: dict[str, Any]) -> Reply:
        """An explicit notice (CLI, API): untrusted input; ``cycle`` defaults to the current."""
        self._ensure_background()
        if not isinstance(data, dict):
            return self._reject({"notice": short(data)}, "a notice is a mapping of notice fields")
        values = dict(data)
        values.setdefault("cycle", self.cycle.number)
        values.setdefault("source", "api")
        try:
            notice = EvictionNotice.parse(values)
        except NoticeError as exc:
            return self._reject(values, str(exc))
        return await self._on_notices([notice])

    def _check_target(self, notice: EvictionNotice) -> str | None:
        if notice.cycle != self.cycle.number:
            return self._stale(notice.cycle)
        if notice.node_id is not None and not self.registry.has_node(
            notice.node_id, self.cycle.number
        ):
            return f"no rank of this job runs on node {notice.node_id}"
        if notice.rank is not None and notice.rank not in self.registry.ranks:
            return f"rank {notice.rank[0]}/{notice.rank[1]} is not registered"
        return None

    # --- transitions -------------------------------------------------------------------------

    async def _on_notices(self, notices: Iterable[EvictionNotice]) -> Reply:
        """Take notices: the first opens the cycle's teardown (IDLE -> GATHERING)."""
        accepted, reasons = 0, []
        cycle = self.cycle
        for notice in notices:
            reason = self._check_target(notice)
            if reason is not None:
                reasons.append(self._reject(notice.to_dict(), reason).reason)
                continue
            accepted += 1
            if self.metrics is not None:
                self.metrics.notices.inc(tags={"source": notice.source})
            if cycle.phase is Phase.IDLE:
                cycle.phase, cycle.first_notice_at = Phase.GATHERING, time.time()
                cycle.notices.append(notice)
                cycle.cover(notice, self.registry)
                cycle.task = asyncio.get_running_loop().create_task(self._run_cycle(cycle))
            elif cycle.phase is Phase.GATHERING:
                cycle.notices.append(notice)  # still gathering: it goes into the plan
                cycle.cover(notice, self.registry)
            else:
                cycle.late_notices.append(notice)
        if not accepted:
            return Reply.refused("; ".join(reasons), cycle.number)
        return Reply.ok(cycle.number, teardown=True)

    async def _run_cycle(self, cycle: Cycle) -> None:
        """GATHERING -> TEARING_DOWN -> CONCLUDED -> the next cycle, whatever fails."""
        try:
            try:
                await asyncio.wait_for(cycle.gathered.wait(), self.config.notice_gather_s)
            except asyncio.TimeoutError:
                pass  # the window closed with some touched node not fully covered
            self._plan_and_order(cycle)
            await self._await_reports(cycle)
            outcome = await asyncio.to_thread(self._conclude, cycle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("ray_graceful coordinator: cycle %s failed", cycle.number)
            outcome = failed(cycle, self.job_id, exc)
        self._open_next_cycle(outcome)

    def _plan_and_order(self, cycle: Cycle) -> None:
        """GATHERING -> TEARING_DOWN: plan, then answer every process's poll with its order."""
        topology, health, notes = [], {}, {}
        for spec, process in self.registry.ranks_of(cycle.number):
            topology.append(RankInfo.of(spec, process.node_id))
            if process.health is not None:
                health[spec.key] = process.health.verdict
                notes[spec.key] = process.health.summary()
            cycle.cooperative = cycle.cooperative or spec.cooperative
        cycle.plan = plan = plan_termination(
            topology,
            cycle.notices,
            health,
            self.config,
            expected_save_s=self.save_times,
            health_notes=notes,
            destination=self._destination(cycle),
        )
        cycle.plan_at, cycle.phase = time.time(), Phase.TEARING_DOWN
        logger.info("ray_graceful coordinator: plan for cycle %s\n%s", cycle.number, plan.table())
        by_process: dict[str, list] = {}
        for rank_order in plan.orders:
            process = self.registry.process_of((rank_order.group, rank_order.rank))
            if process is not None:
                by_process.setdefault(process.process_id, []).append(rank_order)
        for notice in cycle.notices:  # a node-level notice: the node's keeper goes too
            if notice.node_id is not None:
                self._keeper_node_leaving(
                    notice.node_id, notice.effective_deadline(self.config.teardown_timeout_s)
                )
        survivors = self._surviving_keepers(plan)
        rejoiners = self.warm.choose_survivors(
            plan, self.registry.active(cycle.number), cycle.cooperative
        )
        spare_nodes = self.warm.spare_nodes(plan, self.registry.spares.values())
        trigger = "; ".join(f"{n.source}: {n.reason} ({n.target})" for n in cycle.notices[:3])
        for process_id, orders in by_process.items():
            process = self.registry.processes[process_id]
            process.order = Order(
                job_id=self.job_id,
                cycle=cycle.number,
                order_id=uuid.uuid4().hex,
                deadline=min(o.deadline for o in orders),
                trigger=trigger,
                saves=tuple(
                    self._assignment(plan, o, survivors, spare_nodes)
                    for o in orders
                    if o.action != "leave"
                ),
                skip_reason="; ".join(o.reason for o in orders if o.action != "save"),
                save_budget_s=self.config.save_budget_s,
                rejoin=process_id in rejoiners,
            )
            process.wake(PollAnswer("order", process.order))
        cycle.orders_at = time.time()
        if not by_process:
            cycle.all_reported.set()
        self._check_all_reported()

    def _destination(self, cycle: Cycle) -> str | None:
        """Where savers write: Ray Train, the checkpoint directory, or only keepers' memory."""
        if cycle.cooperative:
            return "ray-train"
        if self.config.checkpoint_dir is None and self.config.memory_replicas > 0:
            return "memory"
        return self.config.checkpoint_dir

    def _assignment(
        self,
        plan: TerminationPlan,
        order: RankOrder,
        survivors: list[str],
        spare_nodes: dict[str, list[str]],
    ) -> SaveAssignment:
        backup_for = None
        if order.action == "backup":
            backup_for = plan.savers[(order.group, order.shard)][1]
        key = shard_key(order.group, order.shard)
        return SaveAssignment(
            order.group,
            order.rank,
            key,
            self.config.checkpoint_dir or "",
            backup_for=backup_for,
            start_by=order.start_by,
            keepers=self._holders_for(key, order.node_id, survivors, spare_nodes.get(key, ())),
        )

    async def _await_reports(self, cycle: Cycle) -> None:
        assert cycle.plan is not None
        last_deadline = max((o.deadline for o in cycle.plan.orders), default=time.time())
        try:
            await asyncio.wait_for(
                cycle.all_reported.wait(),
                timeout=max(last_deadline - time.time(), 0) + REPORT_GRACE_S,
            )
        except asyncio.TimeoutError:
            pass  # the missing ones are named in the outcome

    def _conclude(self, cycle: Cycle) -> TerminationOutcome:
        """TEARING_DOWN -> CONCLUDED: commit if every shard was saved at one step."""
        involved = [p for p in self.registry.active(cycle.number) if p.order is not None]
        return conclude(cycle, involved, self.config, self.job_id, self.save_times)

    def _open_next_cycle(self, outcome: TerminationOutcome) -> None:
        """Publish the outcome; the next cycle opens (a restarted group registers into it)."""
        self.cycle.phase = Phase.CONCLUDED
        self.warm.after_cycle(self.cycle, outcome, self.registry)
        try:
            outcome.publish(self.config.report_dir)
        except Exception:
            logger.exception("ray_graceful coordinator: could not publish the outcome")
        if self.metrics is not None:
            try:
                self.metrics.record(outcome)
            except Exception:
                logger.warning("ray_graceful coordinator: could not record metrics", exc_info=True)
        self.outcomes[outcome.cycle] = outcome
        self.outcome_events.setdefault(outcome.cycle, asyncio.Event()).set()
        if self.keepers:
            self._after_memory_commit(outcome.cycle, self.cycle.memory_checkpoint)
        for old in [c for c in self.outcomes if c < outcome.cycle - KEEP_OUTCOMES]:
            del self.outcomes[old]  # each holds every rank's report: keep the recent ones
            self.outcome_events.pop(old, None)
        self.cycle = Cycle(outcome.cycle + 1)
        self.registry.forget_before(self.cycle.number)

    # --- warm restart (coordinator/warm.py) --------------------------------------------------

    async def rendezvous(self, member: str, wait_s: float) -> Rendezvous | None:
        """A warm restart's member asks where and as what it joins (None: ask again)."""
        return await self.warm.rendezvous(member, wait_s)

    async def rejoined(self, result: Rejoined) -> Reply:
        """A member says what it did; one that could not join ends the others cleanly."""
        if not isinstance(result, Rejoined):
            return self._reject({"rejoined": short(result)}, "a result is a Rejoined")
        failed_record = self.warm.joined(result)
        if failed_record is not None:
            keys = [
                key
                for p in self.registry.active(self.cycle.number)
                if p.process_id in failed_record.members
                for key in p.keys
            ]
            reason = f"warm restart failed: {failed_record.reason}"[:500]
            await self._on_notices(
                [EvictionNotice("rejoin", reason, self.cycle.number, rank=k) for k in keys]
            )
        return Reply.ok(self.cycle.number)

    async def wait_rejoined(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """The record of the warm restart into ``cycle`` once every member spoke (or now)."""
        record = self.warm.records.get(cycle)
        if record is None:
            return None
        try:
            await asyncio.wait_for(record.done.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        return record.to_dict()

    # --- reports -----------------------------------------------------------------------------

    async def report_teardown(self, process_id: str, report: TeardownReport) -> Reply:
        """A worker's TeardownReport, sent before it exits."""
        process = self.registry.processes.get(process_id)
        if not isinstance(report, TeardownReport):
            return self._reject({"process": process_id}, "a report is a TeardownReport")
        if process is None or report.cycle != self.cycle.number:
            return self._reject(
                {"process": process_id, "cycle": report.cycle}, self._stale(report.cycle)
            )
        process.report = report
        self._resolve_saves(process, {s.get("shard") for s in report.saved}, report.save_failure())
        self._check_all_reported()
        return Reply.ok(self.cycle.number)

    def _check_all_reported(self) -> None:
        """Every process that got an order has reported, or died without a notice."""
        cycle = self.cycle
        if cycle.phase is Phase.TEARING_DOWN and all(
            p.report is not None or p.lost
            for p in self.registry.active(cycle.number)
            if p.order is not None
        ):
            cycle.all_reported.set()

    # --- reading -----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        self._ensure_background()
        last = self.outcomes.get(self.cycle.number - 1)
        topology = [RankInfo.of(s, p.node_id) for s, p in self.registry.ranks_of(self.cycle.number)]
        return {
            "incomplete_groups": incomplete_groups(topology),
            "cycle": self.cycle.number,
            "phase": self.cycle.phase.value,
            "job_id": self.job_id,
            "job_state": self.job_state,
            "tearing_down": self.cycle.tearing_down,
            "failures": list(self.failures),
            "ranks": self.registry.describe_ranks(self.cycle.number),
            "spares": self.registry.describe_spares(),
            "notices": [n.to_dict() for n in self.cycle.notices],
            "rejected": self.cycle.rejected[-20:],
            "last_outcome": last.to_dict() if last else None,
            "plan_table": self.cycle.plan.table() if self.cycle.plan else None,
        }

    async def wait_outcome(self, cycle: int | None, timeout: float) -> TerminationOutcome | None:
        """The outcome of ``cycle``; without one, of the cycle the caller is waiting for.

        That is the cycle in flight if a teardown is under way or no cycle concluded yet;
        otherwise the last concluded one (a driver asking right after an eviction wants that
        eviction's outcome, not the next one's).
        """
        if cycle is None:
            in_flight = self.cycle.tearing_down or not self.outcomes
            cycle = self.cycle.number if in_flight else max(self.outcomes)
        if cycle in self.outcomes:
            return self.outcomes[cycle]
        event = self.outcome_events.setdefault(cycle, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return None
        return self.outcomes[cycle]

    async def stats(self) -> dict[str, Any]:
        """Cheap counters (the fan-out benchmark reads them while thousands of polls wait)."""
        return {
            "pid": os.getpid(),
            "node_id": ray_adapter.current_node_id(),
            "cycle": self.cycle.number,
            "phase": self.cycle.phase.value,
            "processes": len(self.registry.active(self.cycle.number)),
            "pending_polls": sum(
                1
                for p in self.registry.processes.values()
                if p.waiter is not None and not p.waiter.done()
            ),
            "polls_served": self.polls_served,
        }

    async def checkpoint_dir(self) -> str | None:
        """Where this job's checkpoints are committed (a restart reads them there)."""
        return self.config.checkpoint_dir

    async def ping(self) -> str:
        self._ensure_background()
        return "ok"
