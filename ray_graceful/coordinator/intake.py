"""What comes in from the ranks and the world, before any plan: registrations, polls, notices.

Functions of the machine's ``CoordinatorState``, each appending its decisions to ``out``:

- ``register`` - a worker process's ranks join the cycle in flight (refused, with ``retry``,
  while the previous group is still leaving);
- ``poll`` - a long poll: answered at once with the order until it is acknowledged, else held
  (``HoldPoll``); it carries the process's last step and health (FAULTY is a notice);
- ``take_notices`` - the first notice opens the cycle (IDLE -> GATHERING); gathering ends early
  once every node the notices touched is covered (``Cycle.cover``); later ones are recorded as
  late;
- ``sigterm``, ``drains``, ``lost``, ``host_lost`` - the notices of a SIGTERM, of Ray's drain
  state, of ranks that died without one and of a host gone silent; ``not_back`` - of ranks
  that did not register again after the coordinator's restart;
- ``fault_after_plan`` - a FAULTY verdict once the plan is out: its saves go to the backups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..health import FAULTY, UNKNOWN, HealthReport
from ..notices import EvictionNotice, NoticeError, Source, short
from ..plan import RankInfo, missing_ranks
from ..protocol import (
    Ack,
    JobState,
    PollAnswer,
    PollKind,
    PollState,
    RankKey,
    RankSpec,
    Register,
    Reply,
    SigtermSeen,
)
from . import events as ev
from .cycle import Phase
from .registry import Process
from .state import CoordinatorState, Refusal


def register(state: CoordinatorState, message: Register) -> list[ev.Decision]:
    out: list[ev.Decision] = []
    if state.job_id and message.job_id != state.job_id and not state.config.coordinator_name:
        out += state.refuse(
            {"process": message.process_id, "job_id": message.job_id},
            f"this coordinator belongs to job {state.job_id}, not to job "
            f"{message.job_id or '?'}; each job starts its own (or set the same "
            "coordinator_name in every job that should share one)",
        )
        return out
    number = state.cycle.number
    if state.cycle.tearing_down and not _completes_a_group(state, message):
        # The previous group is still leaving: its ranks are what this cycle plans for. The
        # worker's control thread registers again until the next cycle accepts it.
        why = f"cycle {number} is being torn down; registering again once it ended"
        out.append(ev.Replied(Reply.refused(why, number, retry=True)))
        return out
    if state.job_state is not JobState.RUNNING:
        out.append(ev.Replied(Reply.refused(f"the job is {state.job_state}", number)))
        return out
    state.registry.register(message, number).last_seen = state.now
    if state.config.memory_replicas > 0:
        out.append(ev.KeeperNeeded(message.node_id))
    out.append(ev.Replied(Reply.ok(number)))
    return out


def _completes_a_group(state: CoordinatorState, message: Any) -> bool:
    """While gathering: does ``message`` bring ranks of the groups this cycle plans for?

    Such a rank belongs to the group being planned, not to the next cycle: a rank registering
    again after the coordinator's restart while a peer's re-reported SIGTERM already opened the
    cycle (refused, it kept its group incomplete until the plan gave up on it: abandoned), a
    group's late starter, or a process of this cycle registering again as itself (its node
    agent failed). Each of its ranks must be that process's already, or missing from a group
    registered in this cycle with the same world size.
    """
    if state.cycle.phase is not Phase.GATHERING or not message.ranks:
        return False
    registry, number = state.registry, state.cycle.number
    for spec in message.ranks:
        entry = registry.ranks.get(spec.key)
        if entry is not None:
            if entry[1] != message.process_id:
                return False  # another process holds it
        else:
            entry = _a_member_of(registry.ranks, spec.group, spec.world_size)
            if entry is None or entry[0].world_size != spec.world_size:
                return False
        process = registry.processes.get(entry[1])
        if process is None or process.cycle != number:
            return False
    return True


def _a_member_of(
    ranks: dict[RankKey, tuple[RankSpec, str]], group: str, world_size: int
) -> tuple[RankSpec, str] | None:
    """Any registered rank of ``group`` (its spec, its process id), or None; looks at no more
    keys than there are registered ranks, whatever world size a message claims."""
    if world_size > len(ranks):
        return next((entry for key, entry in ranks.items() if key[0] == group), None)
    for rank in range(world_size):
        entry = ranks.get((group, rank))
        if entry is not None:
            return entry
    return None


def poll(state: CoordinatorState, process_id: str, cycle: object, told: Any) -> list[ev.Decision]:
    out: list[ev.Decision] = []
    state.polls_served += 1
    process = state.member(process_id, cycle)
    if isinstance(process, Refusal):
        if not process.unknown:  # an unknown one registers again: nothing to keep on record
            out.append(state.reject({"process": process_id, "cycle": cycle}, process.reason))
        kind = PollKind.UNKNOWN if process.unknown else PollKind.STALE
        out.append(ev.Replied(PollAnswer(kind, reason=process.reason)))
        return out
    process.last_seen = state.now
    if isinstance(told, PollState):
        if told.last_step is not None:
            process.last_step = told.last_step
        if isinstance(told.health, HealthReport):
            out += _update_health(state, process, told.health)
    holding = told.holding if isinstance(told, PollState) else ""
    if process.order is not None and not process.acked and holding != process.order.order_id:
        out.append(ev.Replied(PollAnswer(PollKind.ORDER, process.order)))  # again, until acked
    else:
        out.append(ev.HoldPoll(process_id))
    return out


def ack(state: CoordinatorState, message: Ack) -> list[ev.Decision]:
    out: list[ev.Decision] = []
    process = state.member(message.process_id, message.cycle)
    if (
        isinstance(process, Refusal)
        or process.order is None
        or process.order.order_id != message.order_id
    ):
        out.append(ev.Replied(Reply.refused("no such order", state.cycle.number)))
        return out
    process.acked = True
    out.append(ev.Replied(Reply.ok(state.cycle.number)))
    return out


def _update_health(
    state: CoordinatorState, process: Process, report: HealthReport
) -> list[ev.Decision]:
    out: list[ev.Decision] = []
    was = process.health.verdict if process.health else UNKNOWN
    process.health = report
    if report.verdict == FAULTY and was != FAULTY:
        summary = f"GPU FAULTY: {report.summary()}"
        number = state.cycle.number
        notices = [
            EvictionNotice(Source.HEALTH, summary, number, rank=k, received_at=state.now)
            for k in process.keys
        ]
        out += take_notices(state, notices, answer=False)
        if state.cycle.phase is Phase.TEARING_DOWN:
            out += fault_after_plan(state, process, summary)
    return out


def fault_after_plan(state: CoordinatorState, process: Process, summary: str) -> list[ev.Decision]:
    """A process found FAULTY once the plan is out: a rank on faulty hardware never saves.

    Each shard it was to save and has not yet reported saved is resolved as not saved, so its
    backup (where the plan has one) saves it now; a save it still reports is kept only where
    no backup saved the shard (``conclusion.trusted_records``). A save it reported before the
    verdict stands: it was made before anyone knew. A drain is planned without waiting for
    such a fault (``Cycle.cover``); this is what makes that safe.
    """
    out: list[ev.Decision] = []
    cycle = state.cycle
    if process.order is None or process.order.cycle != cycle.number:
        return out  # no order this cycle: it saves nothing
    cycle.late_faulty[process.process_id] = summary
    why = f"{process.name} was found FAULTY after the plan ({summary})"[:300]
    out += state.resolve_saves(process, set(), why)
    return out


def sigterm(state: CoordinatorState, message: SigtermSeen) -> list[ev.Decision]:
    """A worker's listener saw SIGTERM: every rank of that process is being evicted."""
    out: list[ev.Decision] = []
    process = state.member(message.process_id, message.cycle)
    if isinstance(process, Refusal):
        what = {"process": message.process_id, "cycle": message.cycle}
        rejected = state.reject(what, f"SIGTERM: {process.reason}")
        # Unknown: a coordinator Ray restarted, reached through a node agent that reconnected
        # before the process registered again - refused for now only; reported again then.
        reply = Reply.refused(rejected.reason, state.cycle.number, retry=process.unknown)
        return [*out, rejected, ev.Replied(reply)]
    notices = [
        EvictionNotice(
            Source.SIGTERM, "SIGTERM", message.cycle, 0.0, rank=k, received_at=message.received_at
        )
        for k in process.keys
    ]
    out += take_notices(state, notices)
    return out


def _check_target(
    state: CoordinatorState, notice: EvictionNotice, unregistered: bool = False
) -> str | None:
    if notice.cycle != state.cycle.number:
        return state.stale(notice.cycle)
    if notice.node_id is not None and not state.registry.has_node(
        notice.node_id, state.cycle.number
    ):
        return f"no rank of this job runs on node {notice.node_id}"
    if notice.rank is not None and not unregistered and notice.rank not in state.registry.ranks:
        return f"rank {notice.rank[0]}/{notice.rank[1]} is not registered"
    return None


def take_notices(
    state: CoordinatorState,
    notices: Iterable[EvictionNotice],
    answer: bool = True,
    unregistered: bool = False,
) -> list[ev.Decision]:
    """Take notices: the first opens the cycle's teardown (IDLE -> GATHERING).

    ``answer``: reply to the caller; False for notices the machine made itself within another
    event (a health verdict in a poll, a drain, a lost rank) that has its own answer.
    ``unregistered``: the notices may name ranks that are not registered (``not_back``'s).
    """
    out: list[ev.Decision] = []
    accepted, reasons = 0, []
    cycle = state.cycle
    for notice in notices:
        reason = _check_target(state, notice, unregistered)
        if reason is not None:
            rejected = state.reject(notice.to_dict(), reason)
            out.append(rejected)
            reasons.append(rejected.reason)
            continue
        accepted += 1
        out.append(ev.NoticeAccepted(notice.source))
        if cycle.phase is Phase.IDLE:
            cycle.move(Phase.GATHERING, state.now)
            out.append(ev.CycleOpened(cycle.number))
        if cycle.phase is Phase.GATHERING:
            cycle.notices.append(notice)  # still gathering: it goes into the plan
            if cycle.cover(notice, state.registry):
                out.append(ev.Gathered(cycle.number))
        else:
            cycle.late_notices.append(notice)
    if answer:
        reply = (
            Reply.ok(cycle.number) if accepted else Reply.refused("; ".join(reasons), cycle.number)
        )
        out.append(ev.Replied(reply))
    return out


def drains(state: CoordinatorState, seen: Any) -> list[ev.Decision]:
    """Ray's drain state, with each node's deadline: the dependable notice on Ray."""
    out: list[ev.Decision] = []
    number = state.cycle.number
    for node_id, deadline_ms in dict(seen).items():
        if state.drains_seen.get(node_id) == number:
            continue
        valid = isinstance(deadline_ms, int) and not isinstance(deadline_ms, bool)
        valid = valid and deadline_ms >= 0
        if valid:
            out.append(ev.NodeLeaving(node_id, deadline_ms / 1000.0))  # ranks there or not
        if valid and state.home_node and node_id == state.home_node:
            out += _the_job_ends_with(state, node_id, deadline_ms / 1000.0)
        if not state.registry.has_node(node_id, number):
            continue  # a node this job has no rank on
        if not valid:
            why = f"Ray's drain state gave deadline {short(deadline_ms)}: not milliseconds"
            out.append(state.reject({"source": "drain", "node_id": node_id}, why))
            continue
        state.drains_seen[node_id] = number
        try:
            reason = "Ray is draining the node"
            deadline = deadline_ms / 1000.0
            notice = EvictionNotice(
                Source.DRAIN, reason, number, deadline, node_id=node_id, received_at=state.now
            )
        except NoticeError as exc:
            out.append(state.reject({"source": "drain", "node_id": node_id}, str(exc)))
            continue
        out += take_notices(state, [notice], answer=False)
    return out


def _the_job_ends_with(state: CoordinatorState, node_id: str, deadline: float) -> list[ev.Decision]:
    """The driver's node is drained: every node of the job is noticed, with that deadline.

    The coordinator is pinned next to the driver, so this is both their node. Once the driver
    is gone Ray ends every actor of the job, and a coordinator pinned to a node that left has
    nowhere to restart: each rank node would never get a notice of its own in time. So the
    whole job saves and leaves by the drain's deadline, as if each node had been drained.
    """
    out: list[ev.Decision] = []
    number = state.cycle.number
    nodes = sorted({p.node_id for p in state.active()} - {node_id})
    if not nodes:  # no rank yet: looked at again at the next poll, once a group registered
        return out
    state.drains_seen[node_id] = number
    reason = f"the driver's node {node_id[:12]} is being drained: the job ends with it"
    # A node drained on its own keeps its own notice too: the plan takes the earlier deadline.
    notices = [
        EvictionNotice(Source.DRAIN, reason, number, deadline, node_id=n, received_at=state.now)
        for n in nodes
    ]
    out += take_notices(state, notices, answer=False)
    return out


def host_lost(state: CoordinatorState, node_id: str, evidence: str) -> list[ev.Decision]:
    """A host silent past the host watch's bounds (``host_watch.py``): every rank on it is lost.

    As for a rank that died (``lost``): none of them saves or reports, their peers are released
    and a replica elsewhere saves each of their shards. Ray's own verdict comes later (13-65 s)
    and finds them already marked.
    """
    out: list[ev.Decision] = []
    dead = [p for p in state.active() if p.node_id == node_id and not p.lost]
    if dead:  # none: a host with no live rank of this job, or one already counted
        why = f"the rank's host was lost: {evidence}"[:500]
        out += _gone(state, dead, Source.HOST_LOST, why, "its host was lost")
    return out


def _gone(
    state: CoordinatorState,
    dead: list[Process],
    source: Source,
    why: str,
    saves_why: str,
) -> list[ev.Decision]:
    """``dead`` processes neither save nor report: marked lost, their saves handed on, and -
    unless the orders are out already (their peers released with them) - a ``source`` notice
    for each of their ranks."""
    out: list[ev.Decision] = []
    for process in dead:
        state.registry.mark_lost(process)
        out += state.resolve_saves(process, set(), saves_why)
    out += state.check_all_reported()
    if state.cycle.phase is Phase.TEARING_DOWN:
        return out
    notices = [
        EvictionNotice(source, why, state.cycle.number, state.now, rank=k, received_at=state.now)
        for process in dead
        for k in process.keys
    ]
    out += take_notices(state, notices, answer=False)
    return out


def lost(state: CoordinatorState, actor_ids: frozenset[str]) -> list[ev.Decision]:
    """Registered ranks' actors died with no notice: their peers must not wait for them.

    Taken in every phase: a rank killed mid-teardown has no report coming, and the cycle
    concludes as soon as every other process reported instead of at the last deadline.
    """
    out: list[ev.Decision] = []
    watched = {p.actor_id: p for p in state.active() if p.actor_id and not p.lost}
    dead = [watched[a] for a in sorted(actor_ids) if a in watched]
    if dead:
        why = "the rank's process died without a notice"
        out += _gone(state, dead, Source.LOST, why, "its process died")
    return out


def not_back(state: CoordinatorState, settle_s: float) -> list[ev.Decision]:
    """A restarted coordinator, ``settle_s`` after it started: a rank not registered again is gone.

    Every rank registers again within a second or two of a restart (``worker/control.py``);
    one of a registered group's ranks that has not done so by then has died, or left on its
    own while no coordinator answered (a SIGTERM it could not report). Nothing else would
    notice it: the lost-rank watch covers the actors this coordinator knows, and its peers,
    registered again, stopped watching the group's store for its leave key
    (``worker/peer_release.py``) - they would wait for an order that never comes. So each such
    rank is a "lost" notice, and the cycle orders its group out (the plan finds the group
    incomplete: its ranks leave, none saves for it).
    """
    out: list[ev.Decision] = []
    cycle = state.cycle
    if state.job_state is not JobState.RUNNING or cycle.tearing_down:
        return out  # the job ended, or the orders are out: the group is ordered out with them
    topology = [RankInfo.of(s, p.node_id) for s, p in state.registry.ranks_of(cycle.number)]
    notices = [
        EvictionNotice(
            Source.LOST,
            f"rank {rank} of group {group!r} did not register again within {settle_s:.0f}s of "
            "the coordinator's restart: it died or left while no coordinator answered",
            cycle.number,
            state.now,
            rank=(group, rank),
            received_at=state.now,
        )
        for group, ranks in sorted(missing_ranks(topology).items())
        for rank in ranks
    ]
    out += take_notices(state, notices, answer=False, unregistered=True)
    return out
