"""The coordinator: one async Ray actor per job that turns notices into a bounded, reported end.

Workers register their ranks and hold a long-poll call open (``poll``); the coordinator answers
every pending poll at once with that process's order - the fan-out - so an order reaches a rank
whose training thread is stuck in a collective. Notices arrive from Ray's drain state (polled
here), from workers' SIGTERM listeners, from ``notify`` (the CLI) and from health reports that
turn FAULTY. The first notice of a cycle starts the teardown: after a short gathering window
the plan is made (``plan.py``), orders go out, reports are gathered until every process reported
or the last deadline passed, the checkpoint is committed if every shard was saved at one step,
and the outcome is published. Then the next cycle begins. Every message carries its cycle: one
from an earlier cycle changes nothing.

Spares and standbys register too and wait; they are told to exit when the job is over, and a
spare can be handed an evicted rank's slot for the next cycle.

``Coordinator`` is the driver's handle: ``Coordinator.start(config)``, ``wait_outcome()``,
``notify()``, ``status()``, ``job_finished()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import ray_adapter
from .checkpoint import CheckpointError, ShardRecord, commit, latest_committed, shard_key
from .config import GracefulConfig
from .health import FAULTY, UNKNOWN, HealthReport
from .notices import EvictionNotice, NoticeError
from .outcome import OutcomeMetrics, TerminationOutcome
from .plan import RankInfo, TerminationPlan, plan_termination

logger = logging.getLogger(__name__)

Key = tuple[str, int]
REPORT_GRACE_S = 2.0  # how long after the last deadline reports are still waited for
MAX_POLL_S = 60.0
MAX_CONCURRENCY = 20_000  # pending polls the actor holds at once


@dataclass
class _Process:
    process_id: str
    node_id: str
    pid: int
    hostname: str
    keys: list[Key]
    actor_id: str
    cycle: int
    registered_at: float
    last_seen: float
    last_step: int | None = None
    health: HealthReport | None = None
    waiter: asyncio.Future | None = None
    order: dict[str, Any] | None = None
    delivered: bool = False
    report: dict[str, Any] | None = None
    lost: bool = False  # found dead without a notice: no report will come


@dataclass
class _Rank:
    group: str
    rank: int
    world_size: int
    shard: str
    can_save: bool
    process_id: str
    gpus: list[int] = field(default_factory=list)
    cooperative: bool = False  # saves through the training function (Ray Train)


@dataclass
class _Spare:
    spare_id: str
    role: str
    node_id: str
    pid: int
    waiter: asyncio.Future | None = None
    order: dict[str, Any] | None = None
    assigned: bool = False  # handed a slot: never handed another


def coordinator_name(config: GracefulConfig, job_id: str) -> str:
    """The coordinator's actor name: the configured one, else one per Ray job.

    Per job by default, so that a second job on the same cluster never registers with, or is
    stopped by, the first job's coordinator (issue: one job cannot stop another).
    """
    return config.coordinator_name or f"ray_graceful_coordinator-{job_id}"


DrainSource = Callable[[], dict[str, int]]  # {node_id_hex: deadline_ms}
LostSource = Callable[[set[str]], set[str]]  # actor ids -> the dead ones


class CoordinatorActor:
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
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.drain_source = drain_source or ray_adapter.draining_nodes
        self.lost_source = lost_source or ray_adapter.dead_actors
        self.cycle = 0
        self.job_state = "running"
        self.processes: dict[str, _Process] = {}
        self.ranks: dict[Key, _Rank] = {}
        self.spares: dict[str, _Spare] = {}
        self.notices: list[EvictionNotice] = []
        self.late_notices: list[EvictionNotice] = []
        self.rejected: list[dict[str, Any]] = []
        self.teardown_task: asyncio.Task | None = None
        self.plan: TerminationPlan | None = None
        self.first_notice_at: float | None = None
        self.all_reported: asyncio.Event | None = None
        self.outcomes: dict[int, TerminationOutcome] = {}
        self.outcome_events: dict[int, asyncio.Event] = {}
        self.save_times: dict[tuple[str, str], float] = {}
        self.drains_seen: dict[str, int] = {}
        self.cooperative = False
        self._drain_task: asyncio.Task | None = None
        self.failures: list[str] = []  # errors of background tasks, shown in the outcome
        try:
            self.metrics: OutcomeMetrics | None = OutcomeMetrics()
        except Exception:  # metrics are a courtesy (and need Ray); it works without them
            self.metrics = None

    # --- background ------------------------------------------------------------------------

    def _ensure_background(self) -> None:
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.get_running_loop().create_task(self._supervise_watcher())

    async def _supervise_watcher(self) -> None:
        """Run the watcher; an unexpected error is logged and the watcher restarted."""
        while True:
            try:
                await self._watch_drains()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("ray_graceful coordinator: the drain watcher failed; restarting")
                self.failures.append(f"drain watcher: {type(exc).__name__}: {exc}")
                del self.failures[:-20]
                await asyncio.sleep(self.config.drain_poll_interval_s)

    async def _watch_drains(self) -> None:
        while True:
            try:
                drains = await asyncio.to_thread(self.drain_source)
            except Exception as exc:
                self._reject({"source": "drain"}, f"could not read Ray's drain state: {exc!r}")
                drains = {}
            await self._watch_lost()
            for node_id, deadline_ms in drains.items():
                if not isinstance(deadline_ms, int) or deadline_ms < 0:
                    self._reject(
                        {"source": "drain", "node_id": node_id},
                        f"Ray's drain state gave deadline {deadline_ms!r}: not milliseconds",
                    )
                    continue
                if self.drains_seen.get(node_id) == self.cycle:
                    continue
                if not any(p.node_id == node_id for p in self._active()):
                    continue  # a node this job has no rank on
                self.drains_seen[node_id] = self.cycle
                try:
                    notice = EvictionNotice(
                        "drain",
                        "Ray is draining the node",
                        self.cycle,
                        deadline_ms / 1000.0,
                        node_id=node_id,
                    )
                except NoticeError as exc:
                    self._reject({"source": "drain", "node_id": node_id}, str(exc))
                    continue
                await self._accept([notice])
            await asyncio.sleep(self.config.drain_poll_interval_s)

    async def _watch_lost(self) -> None:
        """A registered rank's actor died with no notice: its peers must not wait for it.

        Watched in every state: a rank killed mid-teardown has no report coming, and the cycle
        concludes as soon as every other process reported instead of at the last deadline.
        """
        watched = {p.actor_id: p for p in self._active() if p.actor_id and not p.lost}
        if not watched:
            return
        try:
            dead = await asyncio.to_thread(self.lost_source, set(watched))
        except Exception as exc:
            logger.warning("ray_graceful coordinator: cannot read the actor table: %r", exc)
            return  # the GCS is unreachable for a moment: next round
        for actor_id in dead:
            watched[actor_id].lost = True
        if dead:
            self._check_all_reported()
        if self.plan is not None:
            return  # orders are out: the dead rank's peers were released with them
        notices = [
            EvictionNotice(
                "lost",
                "the rank's process died without a notice",
                self.cycle,
                time.time(),
                rank=key,
            )
            for actor_id in dead
            for key in watched[actor_id].keys
        ]
        if notices:
            await self._accept(notices)

    def _active(self) -> list[_Process]:
        return [p for p in self.processes.values() if p.cycle == self.cycle]

    # --- registration ----------------------------------------------------------------------

    async def register(
        self,
        process_id: str,
        node_id: str,
        pid: int,
        hostname: str,
        ranks: list[dict[str, Any]],
        health: dict[str, Any] | None = None,
        actor_id: str = "",
        job_id: str = "",
    ) -> dict[str, Any]:
        """A worker process registers its ranks; returns the cycle it belongs to."""
        self._ensure_background()
        if self.job_id and job_id != self.job_id and not self.config.coordinator_name:
            return self._reject(
                {"process": process_id, "job_id": job_id},
                f"this coordinator belongs to job {self.job_id}, not to job {job_id or '?'}; "
                "each job starts its own (or set the same coordinator_name in every job that "
                "should share one)",
            )
        if self.teardown_task is not None:
            return {
                "accepted": False,
                "reason": f"cycle {self.cycle} is being torn down; register again once it ended",
            }
        if self.job_state != "running":
            return {"accepted": False, "reason": f"the job is {self.job_state}"}
        keys: list[Key] = []
        for entry in ranks:
            key = (str(entry["group"]), int(entry["rank"]))
            old = self.ranks.get(key)
            if old is not None and old.process_id != process_id:
                previous = self.processes.get(old.process_id)
                if previous is not None and key in previous.keys:
                    previous.keys.remove(key)  # the rank moved (an actor restart): newest wins
            self.ranks[key] = _Rank(
                key[0],
                key[1],
                int(entry["world_size"]),
                str(entry["shard"]),
                bool(entry["can_save"]),
                process_id,
                list(entry.get("gpus", [])),
                bool(entry.get("cooperative", False)),
            )
            keys.append(key)
        now = time.time()
        process = self.processes.get(process_id)
        if process is None or process.cycle != self.cycle:
            process = _Process(
                process_id, node_id, pid, hostname, [], actor_id, self.cycle, now, now
            )
            self.processes[process_id] = process
        process.keys = sorted(set(process.keys) | set(keys))
        if health is not None:
            process.health = HealthReport.from_dict(health)
        return {"accepted": True, "cycle": self.cycle}

    # --- the long poll (fan-out) -----------------------------------------------------------

    async def poll(
        self, process_id: str, cycle: int, state: dict[str, Any], wait_s: float
    ) -> dict[str, Any] | None:
        """Held open by each worker process; answered with its order, or None after wait_s."""
        self._ensure_background()
        process = self.processes.get(process_id)
        if process is None:
            return {"action": "unknown", "reason": "this process is not registered"}
        if cycle != self.cycle or process.cycle != self.cycle:
            self._reject({"process": process_id, "cycle": cycle}, self._stale(cycle))
            return {"action": "stale", "reason": self._stale(cycle)}
        process.last_seen = time.time()
        if state.get("last_step") is not None:
            process.last_step = int(state["last_step"])
        if state.get("health") is not None:
            await self._update_health(process, HealthReport.from_dict(state["health"]))
        if process.order is not None and not process.delivered:
            process.delivered = True
            return process.order
        future = asyncio.get_running_loop().create_future()
        process.waiter = future
        try:
            return await asyncio.wait_for(future, timeout=min(max(wait_s, 0.1), MAX_POLL_S))
        except asyncio.TimeoutError:
            return None
        finally:
            if process.waiter is future:
                process.waiter = None

    def _deliver(self, process: _Process, order: dict[str, Any]) -> None:
        process.order = order
        if process.waiter is not None and not process.waiter.done():
            process.waiter.set_result(order)
            process.delivered = True

    async def _update_health(self, process: _Process, report: HealthReport) -> None:
        was = process.health.verdict if process.health else UNKNOWN
        process.health = report
        if report.verdict == FAULTY and was != FAULTY:
            notices = [
                EvictionNotice("health", f"GPU FAULTY: {report.summary()}", self.cycle, rank=key)
                for key in process.keys
            ]
            await self._accept(notices)

    # --- notices ---------------------------------------------------------------------------

    def _stale(self, cycle: Any) -> str:
        return f"stale: cycle {cycle} is not the current cycle {self.cycle}"

    def _reject(self, what: dict[str, Any], reason: str) -> dict[str, Any]:
        entry = {"at": time.time(), "reason": reason, "what": what}
        self.rejected.append(entry)
        del self.rejected[:-200]
        logger.warning("ray_graceful coordinator: rejected %s: %s", _short(what), reason)
        if self.metrics is not None:
            self.metrics.rejected.inc()
        return {"accepted": False, "reason": reason, "cycle": self.cycle}

    async def report_sigterm(self, process_id: str, cycle: int, received_at: float) -> dict:
        """A worker's listener saw SIGTERM: every rank of that process is being evicted."""
        process = self.processes.get(process_id)
        if process is None:
            return self._reject({"process": process_id}, "SIGTERM from an unregistered process")
        if cycle != self.cycle:
            return self._reject({"process": process_id, "cycle": cycle}, self._stale(cycle))
        try:
            notices = [
                EvictionNotice("sigterm", "SIGTERM", cycle, 0.0, rank=key, received_at=received_at)
                for key in process.keys
            ]
        except NoticeError as exc:
            return self._reject({"process": process_id}, str(exc))
        return await self._accept(notices)

    async def notify(self, data: dict[str, Any]) -> dict[str, Any]:
        """An explicit notice (CLI, API); ``cycle`` defaults to the current one."""
        self._ensure_background()
        if not isinstance(data, dict):
            return self._reject({"notice": data}, "a notice is a mapping of notice fields")
        values = dict(data)
        values.setdefault("cycle", self.cycle)
        values.setdefault("source", "api")
        try:
            notice = EvictionNotice.parse(values)
        except NoticeError as exc:
            return self._reject(values, str(exc))
        return await self._accept([notice])

    async def _accept(self, notices: Iterable[EvictionNotice]) -> dict[str, Any]:
        accepted, reasons = 0, []
        for notice in notices:
            reason = self._check_target(notice)
            if reason is not None:
                reasons.append(self._reject(notice.to_dict(), reason)["reason"])
                continue
            accepted += 1
            if self.metrics is not None:
                self.metrics.notices.inc(tags={"source": notice.source})
            if self.teardown_task is None:
                self.notices.append(notice)
                self.first_notice_at = time.time()
                self.all_reported = asyncio.Event()
                self.teardown_task = asyncio.get_running_loop().create_task(self._teardown())
            elif self.plan is None:
                self.notices.append(notice)  # still gathering: it goes into the plan
            else:
                self.late_notices.append(notice)
        if not accepted:
            return {"accepted": False, "reason": "; ".join(reasons), "cycle": self.cycle}
        return {"accepted": True, "cycle": self.cycle, "teardown": True}

    def _check_target(self, notice: EvictionNotice) -> str | None:
        if notice.cycle != self.cycle:
            return self._stale(notice.cycle)
        if notice.node_id is not None and not any(
            p.node_id == notice.node_id for p in self._active()
        ):
            return f"no rank of this job runs on node {notice.node_id}"
        if notice.rank is not None and notice.rank not in self.ranks:
            return f"rank {notice.rank[0]}/{notice.rank[1]} is not registered"
        return None

    # --- the teardown of a cycle -----------------------------------------------------------

    async def _teardown(self) -> None:
        """Plan, order, gather reports, conclude: a cycle always concludes, whatever fails.

        Any error on the way is logged and becomes the outcome's reason (result "failed"), and
        the next cycle starts: a restarted group can always register again.
        """
        cycle = self.cycle
        try:
            await self._run_teardown(cycle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("ray_graceful coordinator: cycle %s failed while concluding", cycle)
            outcome = TerminationOutcome(
                cycle=cycle,
                job_id=self.job_id,
                result="failed",
                notices=[n.to_dict() for n in self.notices + self.late_notices],
                rejected=list(self.rejected),
                plan=self.plan.to_dict() if self.plan else {},
                reason=f"the coordinator failed while concluding: {type(exc).__name__}: {exc}",
            )
            self._finish_cycle(outcome)

    async def _run_teardown(self, cycle: int) -> None:
        await asyncio.sleep(self.config.notice_gather_s)
        topology, health, notes, cooperative = [], {}, {}, False
        for key, rank in self.ranks.items():
            process = self.processes.get(rank.process_id)
            if process is None or process.cycle != cycle or key not in process.keys:
                continue
            topology.append(
                RankInfo(rank.group, rank.rank, process.node_id, rank.shard, rank.can_save)
            )
            if process.health is not None:
                health[key] = process.health.verdict
                notes[key] = process.health.summary()
            cooperative = cooperative or rank.cooperative
        self.cooperative = cooperative
        plan = plan_termination(
            topology,
            self.notices,
            health,
            self.config,
            expected_save_s=self.save_times,
            health_notes=notes,
            destination="ray-train" if cooperative else self.config.checkpoint_dir,
        )
        self.plan = plan
        plan_at = time.time()
        logger.info("ray_graceful coordinator: plan for cycle %s\n%s", cycle, plan.table())
        by_process: dict[str, list] = {}
        for order in plan.orders:
            process_id = self.ranks[(order.group, order.rank)].process_id
            by_process.setdefault(process_id, []).append(order)
        trigger = "; ".join(f"{n.source}: {n.reason} ({n.target})" for n in self.notices[:3])
        for process_id, orders in by_process.items():
            saves = [
                {
                    "group": o.group,
                    "rank": o.rank,
                    "shard": shard_key(o.group, o.shard),
                    "root": self.config.checkpoint_dir,
                }
                for o in orders
                if o.action == "save"
            ]
            self._deliver(
                self.processes[process_id],
                {
                    "action": "teardown",
                    "job_id": self.job_id,
                    "cycle": cycle,
                    "deadline": min(o.deadline for o in orders),
                    "trigger": trigger,
                    "saves": saves,
                    "skip_reason": "; ".join(o.reason for o in orders if o.action != "save"),
                    "save_budget_s": self.config.save_budget_s,
                },
            )
        orders_at = time.time()
        self._check_all_reported()
        last_deadline = max((o.deadline for o in plan.orders), default=time.time())
        try:
            await asyncio.wait_for(
                self.all_reported.wait(),
                timeout=max(last_deadline - time.time(), 0) + REPORT_GRACE_S,
            )
        except asyncio.TimeoutError:
            pass
        if not by_process:
            self.all_reported.set()
        outcome = await asyncio.to_thread(self._conclude, cycle, plan, plan_at, orders_at)
        self._finish_cycle(outcome)

    async def report_teardown(self, process_id: str, cycle: int, report: dict) -> dict:
        """A worker's TeardownReport, sent before it exits."""
        process = self.processes.get(process_id)
        if process is None or cycle != self.cycle:
            return self._reject({"process": process_id, "cycle": cycle}, self._stale(cycle))
        process.report = report
        self._check_all_reported()
        return {"accepted": True}

    def _check_all_reported(self) -> None:
        """Every process that got an order has reported, or died without a notice."""
        if (
            self.all_reported is not None
            and self.plan is not None
            and all(p.report is not None or p.lost for p in self._active() if p.order is not None)
        ):
            self.all_reported.set()

    def _conclude(
        self, cycle: int, plan: TerminationPlan, plan_at: float, orders_at: float
    ) -> TerminationOutcome:
        t0 = self.first_notice_at or plan_at
        involved = [p for p in self._active() if p.order is not None]
        reports = [p.report for p in involved if p.report is not None]
        missing = [
            f"{p.hostname}:{p.pid}" + (" (died without a notice)" if p.lost else "")
            for p in involved
            if p.report is None
        ]
        root = self.config.checkpoint_dir
        records = [ShardRecord.from_dict(s) for r in reports for s in r.get("saved", [])]
        for record in records:
            group = record.shard.split("/", 1)[0]
            self.save_times[(group, record.shard.split("/", 1)[-1])] = record.seconds
        committed, reason = None, ""
        if plan.abandoned:
            result, reason = "abandoned", plan.abandoned
        elif self.cooperative:
            result = "ray-train"
            reason = "the savers reported their shards to Ray Train: ray.train.get_checkpoint()"
        elif root is None:
            result, reason = "no-checkpoint", "no checkpoint_dir is configured"
        else:
            expected = [shard_key(g, s) for g, s in plan.savers]
            step = records[0].step if records else -1
            try:
                path = commit(
                    root, step, expected, records, cycle=cycle, extra={"job_id": self.job_id}
                )
                result, committed = "committed", {"step": step, "path": os.path.dirname(path)}
            except CheckpointError as exc:
                result, reason = "abandoned", str(exc)
        latest = latest_committed(root) if root else None
        resume = {"step": latest.step, "path": latest.path} if latest else None
        report_times = [r["started_at"] + (r.get("finished_s") or 0) for r in reports]
        timings = {"plan": plan_at - t0, "orders": orders_at - t0}
        if report_times:
            timings["first_report"] = min(report_times) - t0
            timings["last_report"] = max(report_times) - t0
        timings["outcome"] = time.time() - t0
        return TerminationOutcome(
            cycle=cycle,
            job_id=self.job_id,
            result=result,
            notices=[n.to_dict() for n in self.notices + self.late_notices],
            rejected=list(self.rejected),
            plan=plan.to_dict(),
            plan_table=plan.table(now=plan_at),
            reports=reports,
            missing=missing,
            committed=committed,
            resume_from=resume,
            reason=reason,
            timings=timings,
        )

    def _finish_cycle(self, outcome: TerminationOutcome) -> None:
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
        # The next cycle: the group that restarts registers into it; late messages are stale.
        self.cycle += 1
        self.notices, self.late_notices, self.rejected = [], [], []
        self.plan, self.teardown_task, self.first_notice_at, self.all_reported = (
            None,
            None,
            None,
            None,
        )
        self.ranks = {
            k: r
            for k, r in self.ranks.items()
            if self.processes.get(r.process_id) is not None
            and self.processes[r.process_id].cycle == self.cycle
        }

    # --- spares and standbys ---------------------------------------------------------------

    async def register_spare(self, spare_id: str, role: str, node_id: str, pid: int) -> dict:
        if role not in ("spare", "standby"):
            return {"accepted": False, "reason": f"role {role!r}: one of 'spare', 'standby'"}
        self.spares[spare_id] = _Spare(spare_id, role, node_id, pid)
        if self.job_state != "running":
            self.spares[spare_id].order = {"action": "exit", "reason": f"job {self.job_state}"}
        return {"accepted": True, "cycle": self.cycle}

    async def poll_spare(self, spare_id: str, wait_s: float) -> dict[str, Any] | None:
        spare = self.spares.get(spare_id)
        if spare is None:
            return {"action": "unknown", "reason": "this spare is not registered"}
        if spare.order is not None:
            order, spare.order = spare.order, None
            if order["action"] in ("exit", "assigned"):
                self.spares.pop(spare_id, None)
            return order
        future = asyncio.get_running_loop().create_future()
        spare.waiter = future
        try:
            order = await asyncio.wait_for(future, timeout=min(max(wait_s, 0.1), MAX_POLL_S))
        except asyncio.TimeoutError:
            return None
        finally:
            spare.waiter = None
        spare.order = None
        if order["action"] in ("exit", "assigned"):
            self.spares.pop(spare_id, None)  # it has its word: it leaves the pool
        return order

    async def leave_spare(self, spare_id: str, reason: str) -> dict:
        """A spare or standby is going away (SIGTERM): never hand it a slot."""
        spare = self.spares.pop(spare_id, None)
        return {"accepted": spare is not None, "reason": reason}

    def _order_spare(self, spare: _Spare, order: dict[str, Any]) -> None:
        if spare.waiter is not None and not spare.waiter.done():
            spare.waiter.set_result(order)
        else:
            spare.order = order

    async def job_finished(self, success: bool = True, permanent: bool = True) -> dict:
        """The job is over (success, or closed for good): every spare and standby exits 0."""
        self.job_state = "succeeded" if success else "closed" if permanent else self.job_state
        told = 0
        for spare in list(self.spares.values()):
            self._order_spare(spare, {"action": "exit", "reason": f"job {self.job_state}"})
            told += 1
        return {"job_state": self.job_state, "spares_told": told}

    async def assign_spare(self, group: str, rank: int) -> dict:
        """Hand a waiting spare the slot of ``group/rank`` for the next cycle."""
        for spare in self.spares.values():
            if spare.role == "spare" and spare.order is None and not spare.assigned:
                order = {"action": "assigned", "group": group, "rank": rank, "cycle": self.cycle}
                spare.assigned = True
                self._order_spare(spare, order)
                return {"assigned": spare.spare_id, **order}
        return {"assigned": None, "reason": "no spare is waiting"}

    # --- reading ---------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        self._ensure_background()
        now = time.time()
        ranks = []
        for key, rank in sorted(self.ranks.items()):
            process = self.processes.get(rank.process_id)
            ranks.append(
                {
                    "group": key[0],
                    "rank": key[1],
                    "world_size": rank.world_size,
                    "shard": rank.shard,
                    "can_save": rank.can_save,
                    "node_id": process.node_id if process else "",
                    "pid": process.pid if process else 0,
                    "health": process.health.summary() if process and process.health else UNKNOWN,
                    "last_step": process.last_step if process else None,
                    "seen_s_ago": round(now - process.last_seen, 1) if process else None,
                }
            )
        last = self.outcomes.get(self.cycle - 1)
        return {
            "cycle": self.cycle,
            "job_state": self.job_state,
            "job_id": self.job_id,
            "tearing_down": self.teardown_task is not None,
            "failures": list(self.failures),
            "ranks": ranks,
            "spares": [
                {"id": s.spare_id, "role": s.role, "node_id": s.node_id, "pid": s.pid}
                for s in self.spares.values()
            ],
            "notices": [n.to_dict() for n in self.notices],
            "rejected": self.rejected[-20:],
            "last_outcome": last.to_dict() if last else None,
            "plan_table": self.plan.table() if self.plan else None,
        }

    async def wait_outcome(self, cycle: int | None, timeout: float) -> dict | None:
        """The outcome of ``cycle``; without one, of the cycle the caller is waiting for.

        That is the cycle in flight if a teardown is under way or no cycle concluded yet;
        otherwise the last concluded one (a driver asking right after an eviction wants that
        eviction's outcome, not the next one's).
        """
        if cycle is None:
            in_flight = self.teardown_task is not None or not self.outcomes
            cycle = self.cycle if in_flight else max(self.outcomes)
        if cycle in self.outcomes:
            return self.outcomes[cycle].to_dict()
        event = self.outcome_events.setdefault(cycle, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return None
        return self.outcomes[cycle].to_dict()

    async def ping(self) -> str:
        self._ensure_background()
        return "ok"


class CoordinatorExists(RuntimeError):
    """A coordinator of that name already runs."""


def running_coordinators(config: GracefulConfig) -> list[str]:
    """Names of the coordinators alive in ``config.coordinator_namespace``."""
    import ray

    prefix = config.coordinator_name or "ray_graceful_coordinator"
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == config.coordinator_namespace and a["name"].startswith(prefix)
    )


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Coordinator:
    """The driver's handle on the coordinator actor."""

    def __init__(self, handle: Any, config: GracefulConfig) -> None:
        self.handle = handle
        self.config = config

    @classmethod
    def start(cls, config: GracefulConfig | None = None, node_id: str | None = None) -> Coordinator:
        """Start this job's coordinator on this node (the driver's, usually the head).

        It is named after this Ray job (or ``config.coordinator_name``) in
        ``config.coordinator_namespace``; the job's workers and the CLI find it there. Starting
        a second one under the same name raises ``CoordinatorExists``.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = config or GracefulConfig.from_env()
        ctx = ray.get_runtime_context()
        name = coordinator_name(config, ctx.get_job_id())
        try:
            ray.get_actor(name, namespace=config.coordinator_namespace)
        except ValueError:
            pass
        else:
            raise CoordinatorExists(
                f"a coordinator named {name!r} already runs in namespace "
                f"{config.coordinator_namespace!r}: use Coordinator.connect()"
            )
        actor = ray.remote(CoordinatorActor).options(
            name=name,
            namespace=config.coordinator_namespace,
            num_cpus=0,
            max_concurrency=MAX_CONCURRENCY,
            max_restarts=0,
            # Next to the driver (the head, usually): the node least likely to be evicted.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id or ctx.get_node_id(), soft=node_id is None
            ),
        )
        handle = actor.remote(config, ctx.get_job_id())
        ray.get(handle.ping.remote(), timeout=60)
        return cls(handle, config)

    @classmethod
    def connect(
        cls, config: GracefulConfig | None = None, timeout: float = 10.0, job_id: str | None = None
    ) -> Coordinator:
        """Find a running coordinator; ValueError (saying which exist) if none fits.

        ``job_id`` picks the coordinator of that job; without it, this driver's own job's, else
        the only one running in the namespace (the CLI, which is a job of its own).
        """
        import ray

        config = config or GracefulConfig.from_env()
        names = running_coordinators(config)
        if config.coordinator_name:
            wanted = config.coordinator_name
        elif job_id is not None:
            wanted = coordinator_name(config, job_id)
        elif coordinator_name(config, ray.get_runtime_context().get_job_id()) in names:
            wanted = coordinator_name(config, ray.get_runtime_context().get_job_id())
        elif len(names) == 1:
            wanted = names[0]
        else:
            raise ValueError(
                f"{len(names)} coordinators run in namespace {config.coordinator_namespace!r}"
                + (f" ({', '.join(names)}): pick one with --job JOB_ID" if names else "")
            )
        handle = ray.get_actor(wanted, namespace=config.coordinator_namespace)
        ray.get(handle.ping.remote(), timeout=timeout)
        return cls(handle, config)

    def notify(
        self,
        *,
        node_id: str | None = None,
        rank: tuple[str, int] | None = None,
        reason: str = "notified",
        deadline: float = 0.0,
        source: str = "api",
        timeout: float = 10.0,
    ) -> dict[str, Any]:
        import ray

        data: dict[str, Any] = {"source": source, "reason": reason, "deadline": deadline}
        if node_id is not None:
            data["node_id"] = node_id
        if rank is not None:
            data["rank"] = list(rank)
        return ray.get(self.handle.notify.remote(data), timeout=timeout)

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.status.remote(), timeout=timeout)

    def wait_outcome(self, timeout: float, cycle: int | None = None) -> TerminationOutcome | None:
        """The outcome of ``cycle`` (default: the current one), waiting up to ``timeout``."""
        import ray

        data = ray.get(self.handle.wait_outcome.remote(cycle, timeout), timeout=timeout + 10)
        return None if data is None else TerminationOutcome.from_dict(data)

    def job_finished(self, success: bool = True, permanent: bool = True) -> dict[str, Any]:
        """Tell spares and standbys the job is over: they exit 0."""
        import ray

        return ray.get(self.handle.job_finished.remote(success, permanent), timeout=30)

    def assign_spare(self, group: str, rank: int) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.assign_spare.remote(group, rank), timeout=30)

    def shutdown(self, timeout: float = 10.0) -> None:
        """End the coordinator and wait (bounded) until its name is free again.

        ``ray.kill`` returns before the actor is gone; a second run in the same job (a second
        ``trainer.fit()``) would otherwise find the name taken by a dying coordinator.
        """
        import ray

        ray.kill(self.handle)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get(self.handle.ping.remote(), timeout=1.0)
            except ray.exceptions.RayActorError:
                break  # dead: its name is released with it
            except ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.05)
