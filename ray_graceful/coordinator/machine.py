"""The cycle machine: the coordinator's decisions, free of Ray, futures and I/O.

One ``step(event) -> decisions`` (the vocabulary is ``events.py``), in the manner of Ray Train
V2's controller: every registration, poll, notice, report and commit that landed goes in as a
typed event; what to answer, whom to wake with which order, what to commit and which outcome to
publish comes out as typed decisions. The actor (``actor.py``) carries them out. So the whole
life of a cycle - IDLE -> GATHERING -> TEARING_DOWN -> CONCLUDED -> the next (``cycle.py``) -
runs, and is unit-tested, without a cluster or an event loop.

Its parts, all Ray-free: what it knows (``state.py``); what comes in before a plan
(``intake.py``: registrations, polls, notices, drains, lost ranks); the plan and the orders
(``orders.py``); the conclusion (``conclusion.py``). Here: the dispatch, the reports and backup
turns, the conclusion's bookkeeping, spares and the job's end. It consults the warm-restart
part (``warm_restarts.py``), the spare pool (``spare_pool.py``) and, for where shards go in
memory, a ``KeeperPlacement`` (the memory tier: the nodes with a keeper that is not leaving).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import GracefulConfig
from ..notices import EvictionNotice, Source, short
from ..plan import RankInfo, incomplete_groups
from ..protocol import (
    Ack,
    JobClosed,
    JobState,
    LateSave,
    RankKey,
    Register,
    Rejoined,
    Reply,
    Result,
    SaveResult,
    SaveTurn,
    ShardId,
    ShardRecord,
    SigtermSeen,
    SpareAction,
    SpareAnswer,
    SpareAssigned,
    TeardownReport,
)
from . import events as ev
from . import intake
from .conclusion import CommitRequest, commit_request, failed, outcome_of
from .cycle import REPORT_GRACE_S, Cycle, Phase
from .held import HeldSteps
from .orders import KeeperPlacement, plan_and_order
from .registry import Process, Registry
from .spare_pool import ROLES, SparePool
from .state import CoordinatorState, Refusal
from .warm_restarts import WarmRecord, WarmRestarts


class CycleMachine:
    """The coordinator's state and rules; see the module docstring."""

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str,
        warm: WarmRestarts,
        spares: SparePool,
        placement: KeeperPlacement | None = None,
        first_cycle: int = 0,
        home_node: str = "",
    ) -> None:
        self.state = CoordinatorState(config, job_id, cycle=Cycle(first_cycle), home_node=home_node)
        self.warm = warm
        self.spares = spares
        self.placement = placement
        self.held = HeldSteps()  # steps the survivors hold, until their copies land (held.py)
        self._commit: CommitRequest | None = None  # the cycle's, while it is carried out
        self._watched: tuple[tuple[int, int] | None, frozenset[str]] = (None, frozenset())

    @property
    def cycle(self) -> Cycle:
        return self.state.cycle

    @property
    def registry(self) -> Registry:
        return self.state.registry

    @property
    def job_state(self) -> JobState:
        return self.state.job_state

    @property
    def polls_served(self) -> int:
        return self.state.polls_served

    def step(self, event: ev.Event, now: float) -> list[ev.Decision]:
        """Take one event that happened at ``now`` (``time.time()``); the decisions to carry out,
        in order. The only writer of the coordinator's state; it reads no clock."""
        state = self.state
        state.now = now
        match event:
            case Register() as message:
                return intake.register(state, message)
            case ev.Polled(process_id, cycle, told):
                return intake.poll(state, process_id, cycle, told)
            case Ack() as message:
                return intake.ack(state, message)
            case ev.NoticesIn(notices):
                return intake.take_notices(state, notices)
            case ev.Malformed(what, reason):
                return state.refuse(what, reason)
            case SigtermSeen() as message:
                return intake.sigterm(state, message)
            case ev.DrainsSeen(drains):
                return intake.drains(state, drains)
            case ev.DrainUnreadable(error):
                why = f"could not read Ray's drain state: {error}"
                return [state.reject({"source": "drain"}, why)]
            case ev.RanksLost(actor_ids):
                return intake.lost(state, actor_ids)
            case ev.HostLost(node_id, evidence):
                return intake.host_lost(state, node_id, evidence)
            case ev.RestartSettled(settle_s):
                return intake.not_back(state, settle_s)
            case ev.GatheringClosed(cycle):
                if cycle == self.cycle.number and self.cycle.phase is Phase.GATHERING:
                    spares = self.spares.spares.values()
                    return plan_and_order(state, self.warm, spares, self.placement)
            case ev.ReportIn(process_id, report):
                return self._report(process_id, report)
            case SaveResult() as message:
                return self._save_result(message)
            case SaveTurn() as message:
                return self._turn(message)
            case ev.BackupSaves(cycle, key, why):
                if cycle == self.cycle.number:
                    self.cycle.fallbacks.append({"shard": key, "at": now, "why": why})
            case ev.ReportsClosed(cycle):
                if cycle == self.cycle.number and self.cycle.phase is Phase.TEARING_DOWN:
                    self._commit = self._commit_request()
                    return [ev.Commit(self._commit)]
            case ev.CommitDone(cycle, landed):
                if cycle == self.cycle.number:
                    return self._conclude(landed)
            case ev.CycleFailed(cycle, error):
                if cycle == self.cycle.number:
                    return self._conclude(None, error=error)
            case _:
                return self._after_the_cycle(event)
        return []

    def _after_the_cycle(self, event: ev.Event) -> list[ev.Decision]:
        """The events of what outlives a cycle: its warm restart, its held step, the spares, the
        job's end."""
        now = self.state.now
        match event:
            case Rejoined() as result:
                return self._rejoined(result)
            case ev.JoinDeadline(cycle):
                return self._join_deadline(cycle, now)
            case ev.JobFinished(success, permanent):
                return self._job_finished(success, permanent)
            case ev.SpareArrived(spare_id, role, node_id, pid):
                return self._spare_arrived(spare_id, role, node_id, pid)
            case ev.SpareWanted(group, rank):
                return self._assign_spare(group, rank)
            case ev.SparePolled(spare_id, held):
                return self._spare_polled(spare_id, held)
            case ev.SpareLeaving(spare_id, reason):
                return [ev.Replied(self._spare_leaving(spare_id, reason))]
            case LateSave() as message:
                return self.held.late(message, now, open_cycle=self.cycle.number)
            case ev.HeldDue(cycle):
                return self.held.due(cycle, now)
            case ev.HeldCommitted(cycle, landed):
                return self.held.committed(cycle, landed, now)
            case ev.HeldDurable(cycle, durable):
                return self.held.durable(cycle, durable, now)
            case _:
                raise TypeError(f"not an event: {type(event).__name__}")

    # --- queries (the actor's status and the watcher read them) -------------------------------

    def active(self) -> list[Process]:
        return self.state.active()

    def watched_actors(self) -> frozenset[str]:
        """The actors of this cycle's processes, to be checked for death without a notice.

        Asked every watch round (``drain_poll_interval_s``); rebuilt only when the registry
        changed: at 16,384 processes each rebuild took 25-50 ms of the event loop.
        """
        if self.job_state is not JobState.RUNNING:
            return frozenset()  # the job is over: its actors going away is no eviction
        key = (self.registry.version, self.cycle.number)
        if self._watched[0] != key:
            actors = frozenset(p.actor_id for p in self.active() if p.actor_id and not p.lost)
            self._watched = (key, actors)
        return self._watched[1]

    def topology(self) -> list[RankInfo]:
        return [RankInfo.of(s, p.node_id) for s, p in self.registry.ranks_of(self.cycle.number)]

    # --- reports and backups --------------------------------------------------------------------

    def _report(self, process_id: str, report: Any) -> list[ev.Decision]:
        out: list[ev.Decision] = []
        if not isinstance(report, TeardownReport):
            out += self.state.refuse({"process": process_id}, "a report is a TeardownReport")
            return out
        process = self.state.member(process_id, report.cycle)
        if isinstance(process, Refusal):
            what = {"process": process_id, "cycle": report.cycle}
            out += self.state.refuse(what, process.reason)
            return out
        if not all(isinstance(record, ShardRecord) for record in report.saved):
            out += self.state.refuse({"process": process_id}, "a report's saved are ShardRecords")
            return out
        process.report = report
        saved = {record.shard for record in report.saved}
        out += self.state.resolve_saves(process, saved, report.save_failure())
        out += self.state.check_all_reported()
        out.append(ev.Replied(Reply.ok(self.cycle.number)))
        return out

    def _save_result(self, message: SaveResult) -> list[ev.Decision]:
        out: list[ev.Decision] = []
        process = self.state.member(message.process_id, message.cycle)
        if isinstance(process, Refusal):
            what = {"process": message.process_id, "cycle": message.cycle}
            out += self.state.refuse(what, process.reason)
            return out
        why = message.reason or "its save failed"
        out += self.state.resolve_saves(process, set(message.saved), why)
        out.append(ev.Replied(Reply.ok(self.cycle.number)))
        return out

    def _turn(self, message: SaveTurn) -> list[ev.Decision]:
        """A backup asks for its turn: answered at once if its saver's fate is known."""
        out: list[ev.Decision] = []
        cycle = self.cycle
        process = self.state.member(message.process_id, message.cycle)
        if isinstance(process, Refusal):
            out.append(ev.Replied(Reply.refused(process.reason, cycle.number)))
        elif process.order is None:
            why = "this process has no order in this cycle"
            out.append(ev.Replied(Reply.refused(why, cycle.number)))
        elif not any(s.is_backup and s.shard_key == message.shard_key for s in process.order.saves):
            why = f"this process is no backup of {message.shard_key}"
            out.append(ev.Replied(Reply.refused(why, cycle.number)))
        else:
            out.append(ev.AwaitSaver(cycle.number, message.shard_key))
        return out

    # --- the conclusion (TEARING_DOWN -> CONCLUDED -> the next cycle) ---------------------------

    def _involved(self) -> list[Process]:
        return [p for p in self.active() if p.order is not None]

    def _commit_request(self) -> CommitRequest:
        request = commit_request(self.cycle, self._involved(), self.state.config, self.state.job_id)
        for record in request.records:  # each shard's save time: the next plan expects as much
            group, _, label = record.shard.partition("/")
            self.state.save_times[ShardId(group, label)] = record.seconds
        return request

    def _conclude(self, landed: Any, error: str = "") -> list[ev.Decision]:
        out: list[ev.Decision] = []
        cycle = self.cycle
        # A held step is one: every shard at it, the survivors holding theirs (``held.py``).
        committed = landed is not None and landed.result in (Result.COMMITTED, Result.HELD)
        step = (landed.committed or {}).get("step") if committed else None
        now = self.state.now
        spares = list(self.spares.spares.values())
        superseded = self.warm.supersede(cycle.number, now)
        record, told = self.warm.after_cycle(cycle, step, committed, self.registry, spares, now)
        warm = record.to_dict() if record is not None else None
        if landed is None or cycle.plan is None:
            outcome = failed(cycle, self.state.job_id, error or "the cycle had no plan", warm)
            memory = None
        else:
            outcome = outcome_of(cycle, self._involved(), landed, self.state.job_id, warm, now)
            memory = landed.memory
        if landed is not None and landed.result is Result.HELD and self._commit is not None:
            # Each survivor's copy starts at its group's first step, or at the latest
            # rejoin_timeout_s after its teardown (``late_copy.py``), and takes at most a save
            # budget; past that, the step is lost.
            config = self.state.config
            until = now + config.rejoin_timeout_s + config.save_budget_s + REPORT_GRACE_S
            out += self.held.expect(self._commit, until, now)
            outcome = dataclasses.replace(outcome, held=self.held.describe(cycle.number))
        else:
            out += self.held.not_held(cycle.number)
        self._commit = None
        cycle.move(Phase.CONCLUDED, self.state.now)
        out.append(ev.Concluded(outcome, memory, record))
        out += self._if_warm_finished(superseded) + self._if_warm_finished(record)
        for spare, word in told:
            self.spares.tell(spare, word)
            out.append(ev.SpareTold(spare.spare_id))
        self.state.cycle = Cycle(cycle.number + 1)
        self.registry.forget_before(self.cycle.number)
        return out

    def _rejoined(self, result: Rejoined) -> list[ev.Decision]:
        failed_now = self.warm.joined(result, self.state.now)
        ended = self._end_the_members(failed_now)
        # A survivor that left before its answer names no cycle: the record it failed does
        finished = self._if_warm_finished(failed_now or self.warm.records.get(result.cycle))
        return [*ended, *finished, ev.Replied(Reply.ok(self.cycle.number))]

    def _spare_leaving(self, spare_id: str, reason: str) -> Reply:
        """A spare going away (SIGTERM) leaves the pool and is never handed a slot - but one a
        decided warm restart names is its member already: refused, naming that cycle, it joins
        as a signalled survivor does, and its signal is the new group's first notice. Leaving
        instead, it would keep the others waiting in the rendezvous until the join deadline."""
        record = self.warm.current
        if record is not None and record.waits_for(spare_id):
            why = f"named by the warm restart into cycle {record.cycle}: it joins, then leaves"
            return Reply.refused(why, cycle=record.cycle)
        return Reply(self.spares.leave(spare_id), reason)

    def _join_deadline(self, cycle: int, now: float) -> list[ev.Decision]:
        overdue = self.warm.overdue(cycle, now)
        return self._end_the_members(overdue) + self._if_warm_finished(overdue)

    @staticmethod
    def _if_warm_finished(record: WarmRecord | None) -> list[ev.Decision]:
        """Tell the actor a warm restart is over (its waiters: ``wait_rejoined``, the memory
        tier's persist); said again for a late word, which changes nothing."""
        if record is not None and record.finished:
            return [ev.WarmFinished(record.cycle)]
        return []

    def _end_the_members(self, failed_record: WarmRecord | None) -> list[ev.Decision]:
        """A warm restart that just failed: the members that joined are ended through a cycle
        of their new group (source "rejoin"); the others leave by themselves."""
        out: list[ev.Decision] = []
        if failed_record is None or (failed_record.anew and not failed_record.results):
            return out  # nobody joined a group started anew: Train restarted it whole instead
        keys = self._registered_slots(failed_record)
        reason = f"warm restart failed: {failed_record.reason}"[:500]
        number, now = self.cycle.number, self.state.now
        notices = [
            EvictionNotice(Source.REJOIN, reason, number, rank=k, received_at=now) for k in keys
        ]
        out += intake.take_notices(self.state, notices, answer=False)
        return out

    def _registered_slots(self, record: WarmRecord) -> list[RankKey]:
        """The ranks the record's members registered in this cycle, found by the slot each was
        given: a spare registers under its process id, not under its member id, and a member
        that has not registered yet is turned away or taken into the cycle this opens."""
        keys = []
        for answer in record.members.values():
            process = self.registry.process_of((answer.group, answer.rank))
            if process is not None and process.cycle == self.cycle.number:
                keys.append((answer.group, answer.rank))
        return keys

    # --- spares and the job's end ---------------------------------------------------------------

    def _spare_arrived(self, spare_id: str, role: str, node_id: str, pid: int) -> list[ev.Decision]:
        out: list[ev.Decision] = []
        if role not in ROLES:
            out.append(ev.Replied(Reply.refused(f"role {short(role)}: one of 'spare', 'standby'")))
            return out
        spare = self.spares.add(spare_id, role, node_id, pid)
        if self.job_state is not JobState.RUNNING:
            self.spares.tell(spare, SpareAnswer(SpareAction.EXIT, f"job {self.job_state}"))
        elif role == "spare" and self.state.config.memory_replicas > 0:
            out.append(ev.KeeperNeeded(node_id))  # the shard it will load can wait on its node
        out.append(ev.Replied(Reply.ok(self.cycle.number)))
        return out

    def _assign_spare(self, group: str, rank: int) -> list[ev.Decision]:
        out: list[ev.Decision] = []
        spare = self.spares.waiting_spare()
        if spare is None:
            reason = "no spare is waiting"
            out.append(ev.Replied(SpareAssigned(None, group, rank, self.cycle.number, reason)))
            return out
        spare.assigned = True
        word = SpareAnswer(
            SpareAction.ASSIGNED, "given an evicted rank's slot", group, rank, self.cycle.number
        )
        self.spares.tell(spare, word)
        out.append(ev.SpareTold(spare.spare_id))
        number = self.cycle.number
        out.append(ev.Replied(SpareAssigned(spare.spare_id, group, rank, number)))
        return out

    def _spare_polled(self, spare_id: str, held: bool) -> list[ev.Decision]:
        if held and not self.spares.has_word(spare_id):
            return []  # its hold ended with no word: it polls again (or it left meanwhile)
        if spare_id not in self.spares.spares:  # Ray restarted us: our pool starts empty
            why = "this coordinator does not know the spare"
            return [ev.Replied(SpareAnswer(SpareAction.REGISTER, why))]
        word = self.spares.take(spare_id)
        return [ev.Replied(word)] if word is not None else [ev.HoldSparePoll(spare_id)]

    def _job_finished(self, success: bool, permanent: bool) -> list[ev.Decision]:
        out: list[ev.Decision] = []
        if success:
            self.state.job_state = JobState.SUCCEEDED
        elif permanent:
            self.state.job_state = JobState.CLOSED
        told = self.spares.tell_all(SpareAnswer(SpareAction.EXIT, f"job {self.job_state}"))
        out.extend(ev.SpareTold(spare_id) for spare_id in told)
        out.append(ev.Replied(JobClosed(self.job_state, len(told), self.cycle.number)))
        return out

    # --- status ---------------------------------------------------------------------------------

    def describe(self, now: float) -> dict[str, Any]:
        """The current cycle as ``ray-graceful status`` shows it at ``now``."""
        cycle = self.cycle
        return {
            "incomplete_groups": incomplete_groups(self.topology()),
            "cycle": cycle.number,
            "phase": cycle.phase.value,
            "job_id": self.state.job_id,
            "job_state": self.job_state,
            "tearing_down": cycle.tearing_down,
            "ranks": self.registry.describe_ranks(cycle.number, now),
            "spares": self.spares.describe(),
            "notices": [n.to_dict() for n in cycle.notices],
            "rejected": cycle.rejected[-20:],
            "plan_table": cycle.plan.table() if cycle.plan else None,
        }
