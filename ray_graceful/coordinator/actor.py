"""The coordinator actor: a thin Ray shell around the cycle machine.

One async Ray actor per job. Its methods are what workers, the driver and the CLI call; each
turns the call into an event for the cycle machine (``machine.py``, no Ray, no I/O, no clock,
the one writer of the coordinator's state) and carries out the decisions that come back
(``events.py``; what each does: ``effects.py``). The shell owns what the machine must not: the
held polls (``fanout.py``, ``warm_waits.py``), each cycle's task, timers and commits on a thread
(``cycle_tasks.py``), outcomes (``outcomes.py``), and the parts that talk to the world - the
watcher (``watch.py``), the host watch, the memory tier (``memory.py``) and the backups' waits
(``backups.py``), each with injected sources.

::

    notice ─> machine.step ─> orders ─> polls answered ─> reports ─> machine.step ─> Commit
                                                                           │ (thread)
          outcome published <─ Concluded <─ machine.step(CommitDone) <─────┘

A cycle always concludes: an error on the way is a "failed" outcome; the next cycle opens.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .. import ray_adapter
from ..config import GracefulConfig
from ..memory.keeper import find_keepers, keepers_for
from ..node.group import start_group_agent
from ..notices import EvictionNotice, NoticeError, short
from ..outcome import TerminationOutcome, publish_record
from ..protocol import (
    Ack,
    JobClosed,
    LateSave,
    PollAnswer,
    PollState,
    Register,
    Rejoined,
    Rendezvous,
    Reply,
    SaveResult,
    SaveTurn,
    SigtermSeen,
    SpareAnswer,
    SpareAssigned,
    TeardownReport,
    TurnAnswer,
)
from ..rendezvous import host_store
from . import events as ev
from . import recovery
from .backups import BackupTurns
from .cycle_tasks import CycleTasks
from .durability import durability, loadable
from .effects import Effects
from .fanout import Fanout
from .groups import GroupAgents
from .host_watch import HostWatch
from .machine import CycleMachine
from .memory import KeeperFactory, MemoryTier
from .node_calls import NodeFacingCalls
from .outcomes import OutcomeBoard
from .spare_pool import SparePool
from .warm_restarts import WarmRestarts
from .warm_waits import WarmWaits
from .watch import DrainSource, LostSource, Watcher

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 20_000  # pending polls the actor holds at once


class CoordinatorActor:
    """The actor's implementation (started through ``Coordinator.start``).

    Ray's drain state and actor table come in through ``drain_source`` and ``lost_source``, and
    keepers through ``keeper_factory`` (default: ``ray_adapter`` and real keeper actors): the
    logic runs, and is unit-tested, without a cluster.
    """

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str = "",
        drain_source: DrainSource | None = None,
        lost_source: LostSource | None = None,
        store_factory: Callable[[], tuple[str, int]] | None = None,
        keeper_factory: KeeperFactory | None = None,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.restarted = ray_adapter.actor_was_restarted()  # our process died; Ray started us
        self.settle_until = time.time() + recovery.SETTLE_S if self.restarted else 0.0
        self.settle_check_due = self.restarted  # then: who did not register again is gone
        first_cycle, self.left_open = recovery.predecessor(config, job_id, self.restarted)
        # Hosted now, where warm restarts are on: hosting it imports torch, about a second in a
        # fresh process, which must not sit between an eviction and its outcome.
        store = (store_factory or host_store)() if config.warm_restart else None
        self.warm = WarmRestarts(config, store)
        self.warm_waits = WarmWaits(self.warm)  # members' held asks; each restart's end
        self.spares = SparePool()
        me = ray_adapter.current_actor_id()  # names our keepers; a restart of this actor keeps it
        home = ray_adapter.current_node_id()  # the driver's node: we are pinned there
        self.memory = MemoryTier(
            config,
            job_id,
            me,
            keeper_factory or keepers_for(config, job_id, me),
            home_node=home,
            publish=functools.partial(publish_record, config.report_dir, job_id),
            before_persist=self.warm_waits.rejoin_done,
            durable_changed=lambda summary, failed: self.outcomes.durable_changed(summary, failed),
        )
        if self.restarted and config.memory_replicas > 0:  # our keepers outlived our process
            kept = recovery.memory_checkpoints(config.report_dir, job_id)
            self.memory.adopt(find_keepers(config.coordinator_namespace, job_id, me), kept)
        self.machine = CycleMachine(
            config, job_id, self.warm, self.spares, self.memory, first_cycle, home
        )
        if self.restarted:  # nobody may call us for a while: call ourselves, to _wake()
            ray_adapter.call_self("ping")
        self.watcher = Watcher(
            drain_source or ray_adapter.draining_nodes,
            lost_source or ray_adapter.dead_actors,
            config.drain_poll_interval_s,
            self.machine.watched_actors,
            self._take,
        )
        # heartbeats from node agents: hosts lost without a word
        self.host_watch = HostWatch.of(config, self._host_lost) if config.host_watch else None
        self.backups = BackupTurns()
        self.fanout = Fanout()  # the held polls: per process, per node agent, per spare
        self.groups = GroupAgents(
            config.node_group_size,
            functools.partial(start_group_agent, config.health_interval_s, home),
            lambda: {p.node_id for p in self.machine.active()},
        )
        self.outcomes = OutcomeBoard(config.report_dir, job_id, first_cycle)
        self.tasks = CycleTasks(  # each cycle's task, its timers, its commits on a thread
            config, job_id, self.machine, self._step, self.memory, self.outcomes,
            self.backups, self.fanout, self.settle_until,
        )  # fmt: skip
        self.nodes = NodeFacingCalls(
            self.fanout, self.groups, self.outcomes, self._take, self._wake
        )
        self.effects = Effects(  # what each decision does: orders out, tasks, records
            config, job_id, self.fanout, self.tasks, self.backups, self.memory,
            self.warm_waits, self.outcomes,
        )  # fmt: skip

    def _wake(self) -> None:
        """On the event loop, at the first call: the watcher runs, a predecessor's cycles end."""
        self.watcher.ensure_running()
        self.memory.resume()
        while self.left_open:
            self.tasks.spawn(self.tasks.conclude_left(self.left_open.pop()))
        if self.settle_check_due:  # who did not register again by then is gone (intake.not_back)
            self.settle_check_due = False
            settled = ev.RestartSettled(recovery.SETTLE_S)
            self.tasks.spawn(self.tasks.at(self.settle_until, settled))

    # --- the one way in: an event to the machine, its decisions carried out ---------------------

    def _step(self, event: ev.Event) -> list[ev.Decision]:
        """Step the machine and carry out every decision: one that fails (a keeper that cannot
        start, a metrics agent away) is logged and recorded, and never keeps the others - the
        orders above all - from going out."""
        decisions = self.machine.step(event, time.time())
        for decision in decisions:
            try:
                self.effects.carry_out(decision)
            except Exception as exc:
                logger.exception("ray_graceful coordinator: could not carry out %s", decision)
                self.watcher.record_failure(f"{type(decision).__name__}: {exc!r}"[:500])
        return decisions

    def _take(self, event: ev.Event) -> Any:
        """Step the machine; the answer for the caller (a ``Reply`` or ``PollAnswer``), if any."""
        return ev.reply_of(self._step(event))

    # --- registration and the long poll (the fan-out) -------------------------------------------

    async def register(self, message: Register) -> Reply:
        """A worker process registers its ranks; the reply names the cycle it belongs to."""
        self._wake()
        reply = self._take(ev.admitted(message, Register, "register", "malformed registration: "))
        if reply.accepted:
            self.fanout.directly(message.process_id)
        return reply

    async def poll(
        self, process_id: str, cycle: int, state: PollState, wait_s: float
    ) -> PollAnswer:
        """Held open by each worker process; answered with its order, or "idle" after wait_s."""
        self._wake()
        answer = self._take(ev.Polled(process_id, cycle, state))
        return answer if answer is not None else await self.fanout.hold(process_id, wait_s)

    async def ack(self, message: Ack) -> Reply:
        """A process has its order: it is not sent again."""
        return self._take(ev.admitted(message, Ack, "ack"))

    # --- notices ----------------------------------------------------------------------------

    async def report_sigterm(self, message: SigtermSeen) -> Reply:
        """A worker's listener saw SIGTERM: every rank of that process is being evicted."""
        return self._take(ev.admitted(message, SigtermSeen, "sigterm"))

    async def notify(self, data: dict[str, Any]) -> Reply:
        """An explicit notice (CLI, API): untrusted input; ``cycle`` defaults to the current."""
        self._wake()
        if not isinstance(data, dict):
            return self._take(ev.Malformed({"notice": short(data)}, "a notice is a mapping"))
        values = {"cycle": self.machine.cycle.number, "source": "api", **data}
        try:
            notice = EvictionNotice.parse(values)
        except NoticeError as exc:
            return self._take(ev.Malformed(values, str(exc)))
        return self._take(ev.NoticesIn((notice,)))

    # --- node and group agents: a node's processes at once (``node_calls.py``) ----------------

    async def join_group(self, node_id: str, gone: str = "") -> tuple[str, Any] | None:
        return await self.nodes.join_group(node_id, gone)

    async def register_node(self, node_key: str, messages: list[Register]) -> bytes:
        return await self.nodes.register_node(node_key, messages)

    async def poll_node(self, node_key: str, states: dict[str, Any], wait_s: float) -> bytes:
        return await self.nodes.poll_node(node_key, states, wait_s)

    async def ack_many(self, acks: list[Ack]) -> bytes:
        return await self.nodes.ack_many(acks)

    async def report_many(self, reports: list[tuple[str, TeardownReport]]) -> bytes:
        return await self.nodes.report_many(reports)

    # --- held steps: the machine decides (``held.py``); the commit and disk copy: cycle_tasks --

    async def late_saved(self, message: LateSave) -> Reply:
        """A survivor's held shards reached the keepers (or could not): see ``held.py``."""
        return self._take(ev.admitted(message, LateSave, "late save"))

    async def durability(self, cycle: int) -> dict[str, Any] | None:
        """Where cycle ``cycle``'s step is now: held by the group, in the keepers, on disk."""
        return durability(self.machine.held, self.memory, cycle)

    # --- reports and backups ----------------------------------------------------------------

    async def report_teardown(self, process_id: str, report: TeardownReport) -> Reply:
        """A worker's TeardownReport, sent before it exits."""
        return self._take(ev.ReportIn(process_id, report))

    async def save_result(self, message: SaveResult) -> Reply:
        """A saver's save step ended: its backups are told at once."""
        return self._take(ev.admitted(message, SaveResult, "save_result"))

    async def save_turn(self, message: SaveTurn, wait_s: float) -> TurnAnswer:
        """A backup asks whether it must save; answered once the saver's fate is known."""
        decisions = self._step(ev.admitted(message, SaveTurn, "save_turn"))
        return await self.backups.answer(decisions, self.machine.cycle.number, wait_s, self._take)

    # --- warm restart (coordinator/warm_restarts.py) ------------------------------------

    async def rendezvous(self, member: str, wait_s: float) -> Rendezvous | None:
        """A warm restart's member asks where and as what it joins (None: ask again)."""
        return await self.warm_waits.rendezvous(member, wait_s)

    async def rejoined(self, result: Rejoined) -> Reply:
        """A member says what it did; one that could not join ends the others cleanly."""
        return self._take(ev.admitted(result, Rejoined, "rejoined"))

    async def wait_rejoined(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """The record of the warm restart into ``cycle`` once every member spoke (or now)."""
        return await self.warm_waits.record(cycle, timeout)

    # --- spares and standbys (coordinator/spare_pool.py) ------------------------------------------

    async def register_spare(self, spare_id: str, role: str, node_id: str, pid: int) -> Reply:
        return self._take(ev.SpareArrived(spare_id, role, node_id, pid))

    async def poll_spare(self, spare_id: str, wait_s: float) -> SpareAnswer | None:
        """A spare's long poll: its word, or None after ``wait_s``."""
        decisions = self._step(ev.SparePolled(spare_id))
        if ev.of_kind(decisions, ev.HoldSparePoll):
            await self.fanout.hold_spare(spare_id, wait_s)
            decisions = self._step(ev.SparePolled(spare_id, held=True))
        return ev.reply_of(decisions)  # its word; None: none yet, it polls again

    async def leave_spare(self, spare_id: str, reason: str) -> Reply:
        """A spare or standby is going away (SIGTERM): never hand it a slot. Refused, naming
        the cycle, where a decided warm restart names it already: it joins that one first."""
        return self._take(ev.SpareLeaving(spare_id, reason))

    async def job_finished(self, success: bool = True, permanent: bool = True) -> JobClosed:
        """The job is over (success, or closed for good): every spare and standby exits 0."""
        return self._take(ev.JobFinished(success, permanent))

    async def assign_spare(self, group: str, rank: int) -> SpareAssigned:
        """Hand a waiting spare the slot of ``group/rank`` for the next cycle (once)."""
        return self._take(ev.SpareWanted(group, rank))

    # --- the memory tier (coordinator/memory.py) ----------------------------------------------

    async def memory_checkpoint(
        self, shard_key: str, step: int | None = None
    ) -> dict[str, Any] | None:
        """The newest memory checkpoint that holds ``shard_key`` (``durability.loadable``)."""
        wait_s = self.config.rejoin_timeout_s
        return await loadable(self.machine.held, self.memory, shard_key, step, wait_s)

    async def memory_record(self, cycle: int) -> dict[str, Any] | None:
        """What cycle ``cycle``'s memory checkpoint holds and went through, as of now."""
        return self.memory.record(cycle)

    async def wait_durable(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """The durable copy's record once the background copy of ``cycle`` ended (or None)."""
        return await self.memory.wait_durable(cycle, timeout)

    async def keeper_stats(self) -> dict[str, Any]:
        """Every keeper's budget, use and shards (the demo and the CLI show them)."""
        return await self.memory.keeper_stats()

    # --- reading -----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        self._wake()
        last = self.outcomes.outcomes.get(self.machine.cycle.number - 1)
        return {
            **self.machine.describe(time.time()),
            "restarted": self.restarted,
            "node_agents": self.fanout.describe(),
            "group_agents": self.groups.describe(),
            "failures": list(self.watcher.failures),
            "host_watch": self.host_watch.describe() if self.host_watch else None,
            "durable": self.memory.durable_summary() if self.config.memory_replicas else None,
            "last_outcome": last.to_dict() if last else None,
        }

    async def wait_outcome(self, cycle: int | None, timeout: float) -> TerminationOutcome | None:
        """The outcome of ``cycle`` (None: the one the caller awaits, ``OutcomeBoard``)."""
        if cycle is None:
            now = self.machine.cycle
            cycle = self.outcomes.awaited(now.number, now.tearing_down)
        return await self.outcomes.wait(cycle, timeout)

    async def stats(self) -> dict[str, Any]:
        """Diagnostics: cheap counters (the fan-out harness reads them while polls wait)."""
        return {
            "pid": os.getpid(),
            "node_id": ray_adapter.current_node_id(),
            "cycle": self.machine.cycle.number,
            "phase": self.machine.cycle.phase.value,
            "processes": len(self.machine.active()),
            "pending_polls": self.fanout.pending(),
            "polls_served": self.machine.polls_served,
            "poll_calls": self.fanout.calls,
            "reports_relayed": self.nodes.reports_relayed,
            "report_calls": self.nodes.report_calls,
        }

    async def checkpoint_dir(self) -> str | None:
        """Where this job's checkpoints are committed (a restart reads them there)."""
        return self.config.checkpoint_dir

    def _host_lost(self, node_id: str, evidence: str) -> None:
        self._step(ev.HostLost(node_id, evidence))

    async def host_watch_ticket(self, node_id: str) -> dict[str, Any] | None:
        """Where node ``node_id``'s agent beats, and its hello's ticket (None: no host watch);
        asked through Ray, which keeps others off the cluster and so off the watch."""
        self._wake()
        return None if self.host_watch is None else await self.host_watch.ticket_for(node_id)

    async def ping(self) -> str:
        self._wake()
        return "ok"
