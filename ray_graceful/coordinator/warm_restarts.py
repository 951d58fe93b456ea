"""Warm restart, on the coordinator's side: who rejoins, which spare takes which slot, and where.

An owned part of the coordinator's machine: plain state and rules - no Ray, no I/O, no futures
(the actor hosts the store the new groups form through, and holds the members' long polls).
Its life in one cycle:

1. ``survivors`` - at plan time: the processes that stay. A process stays when it holds exactly
   one rank, that rank is not evicted and not on FAULTY hardware, and the cycle is not one
   where the training function saves (Ray Train's cold path: Train restarts its whole worker
   group). Their order carries ``rejoin``: the teardown releases their peers and saves as
   planned, and ends without an exit.
2. ``decide`` - when the cycle concluded: the new membership of every group. Each evicted slot
   goes to a waiting spare on a node no notice named; in a group Ray Train replaces by slot
   (``RankSpec.replaced_by``), else to the process Train starts there - named by its slot,
   as it does not exist yet (``train_slot_member``); where none is free the group continues
   smaller if ``min_world_size`` allows it and every shard keeps a holder. Anything short of
   that - no committed step, a slot with no spare, a process that did not report - and every
   survivor is told to leave: the ending is today's clean one, with the reason.
3. ``answer`` - each member's ``Rendezvous`` (the actor holds its long poll: it may ask before
   the cycle concluded, and is answered once ``decide`` made one). Members form the next
   cycle's group through one long-lived store with a prefix per cycle and group: 8 gloo ranks
   re-formed in 78 ms that way, where a new store per cycle had 5 s outliers
   (``docs/concepts.md``, "Warm restart").
4. ``joined`` - each member says what it did (``Rejoined``: loaded from where, how long). The
   record of the warm restart is complete when every member has spoken; a member that could
   not join makes it ``failed``, and the coordinator then ends the others cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import GracefulConfig
from ..health import FAULTY
from ..place import Place
from ..plan import TerminationPlan
from ..protocol import (
    RankKey,
    RankSpec,
    Rejoined,
    Rendezvous,
    RendezvousAction,
    Replacement,
    SpareAction,
    SpareAnswer,
    WarmResult,
    shard_key,
    train_slot_member,
)
from .cycle import Cycle
from .registry import Process, Registry
from .spare_pool import SpareRecord, free_spares

# Ray Train starts the new worker for an evicted slot in the slot's placement-group bundle, which
# stays on a drained node until that node is gone (measured: the new worker came 4.2 s after the
# node's removal at its deadline). Its full restart - a new placement group, every worker anew -
# took 11-12 s on this machine (docs/benchmarks.md, the race). A slot freed later than this is
# not waited for: Train restarts the group.
TRAIN_SLOT_WAIT_LIMIT_S = 8.0

TRAIN_SLOT_PREFIX = train_slot_member("", 0).partition(":")[0] + ":"


@dataclass(frozen=True)
class Survivor:
    """A process ordered to rejoin, as it was before the cycle ended."""

    process_id: str
    spec: RankSpec
    node_id: str
    pid: int


@dataclass
class WarmRecord:
    """One warm restart, from the cycle that ended into the next one."""

    from_cycle: int
    cycle: int
    step: int
    result: WarmResult
    reason: str = ""
    members: dict[str, Rendezvous] = field(default_factory=dict)  # member id -> its answer
    told_to_leave: dict[str, str] = field(default_factory=dict)  # member id -> why
    results: dict[str, Rejoined] = field(default_factory=dict)
    started_at: float = 0.0  # when it was decided (the event's time)
    finished_at: float | None = None
    join_by: float = float("inf")  # every member has said what it did by then, or it failed
    # The groups Ray Train refills by slot, and the shards a survivor holds with no copy yet:
    # where a survivor leaves before its rendezvous, whether Train's next worker can take it
    train_groups: frozenset[str] = frozenset()
    held_shards: frozenset[str] = frozenset()
    # Every slot handed to Ray Train's next worker (``WarmRestarts._every_slot_anew``): where
    # Train restarted the whole group instead, its workers registered at those slots without
    # joining this record, so its failure ends only members that said they joined.
    anew: bool = False

    @property
    def finished(self) -> bool:
        """Every member said what it did, or the warm restart failed or never began."""
        return self.finished_at is not None

    def waits_for(self, member: str) -> bool:
        """Whether ``member`` is a member still to say what it did, the restart still open."""
        return (
            self.result is WarmResult.REJOINING
            and member in self.members
            and member not in self.results
        )

    def fail_silent(self, why: Callable[[int], str], now: float) -> None:
        """Failed for the members that never said what they did: ``why(how many)``, and what
        the first of them were."""
        silent = [self.members[m].was for m in self.members if m not in self.results]
        self.result, self.finished_at = WarmResult.FAILED, now
        self.reason = f"{why(len(silent))} ({', '.join(silent[:3])})"

    def take(self, result: Rejoined, now: float) -> bool:
        """One member's result (``result.member`` is a member); whether it failed the record
        just now. Complete once every member has spoken."""
        self.results[result.member] = result
        failed_now = not result.joined and self.result is WarmResult.REJOINING
        if failed_now:
            self.result = WarmResult.FAILED
            self.reason = f"{self.members[result.member].was}: {result.reason}"[:500]
        if set(self.results) >= set(self.members) or failed_now:
            if self.result is WarmResult.REJOINING:
                self.result = WarmResult.REJOINED
            self.finished_at = now
        return failed_now

    def member_left(self, member: str, why: str, now: float) -> bool:
        """A member gone before it had its answer (``WarmRestarts.left_unanswered``): in a group
        Ray Train refills by slot, where the slot's shard is not one only a survivor held, the
        slot's next worker takes its place; else the record fails now. Whether it failed."""
        if self.result is not WarmResult.REJOINING or member not in self.members:
            return False  # over already, or told to leave
        if member in self.results:
            return False  # it joined already
        answer = self.members[member]
        key = shard_key(answer.group, answer.shard)
        if answer.group in self.train_groups and key not in self.held_shards:
            was = f"Ray Train's new worker for rank {answer.rank} (its survivor left)"
            del self.members[member]
            self.members[train_slot_member(answer.group, answer.rank)] = replace(answer, was=was)
            self.told_to_leave[member] = why
            return False
        self.result, self.finished_at = WarmResult.FAILED, now
        self.reason = f"{answer.was}: {why}"[:500]
        return True

    def to_dict(self) -> dict[str, Any]:
        """What the outcome and ``Coordinator.wait_rejoined`` show: who, from where, how long."""
        return {
            "from_cycle": self.from_cycle,
            "cycle": self.cycle,
            "resume_step": self.step,
            "result": self.result,
            "reason": self.reason,
            "members": [
                {
                    "member": member,
                    "group": r.group,
                    "rank": r.rank,
                    "world_size": r.world_size,
                    "shard": r.shard,
                    "was": r.was,
                    **_result_fields(self.results.get(member)),
                }
                for member, r in sorted(self.members.items(), key=lambda m: (m[1].group, m[1].rank))
            ],
            "told_to_leave": dict(self.told_to_leave),
            "seconds": (self.finished_at - self.started_at) if self.finished_at else None,
        }


def _result_fields(result: Rejoined | None) -> dict[str, Any]:
    if result is None:
        return {"action": "pending"}
    return {
        "action": result.action,
        "loaded_from": result.loaded_from,
        "seconds": dict(result.seconds),
        "started_at": result.started_at,
        "pid": result.pid,
        "node_id": result.node_id,
        "reason": result.reason,
    }


class WarmRestarts:
    """The coordinator's warm-restart part (see the module docstring)."""

    def __init__(self, config: GracefulConfig, store: tuple[str, int] | None) -> None:
        self.config = config
        # The long-lived store the new groups form through, hosted by the actor before any
        # eviction (hosting it imports torch: about a second in a fresh process). None: warm
        # restarts are off.
        self.store = store
        # Of the cycle in flight, from its plan until ``decide`` consumed them: a member found
        # here is waiting for a decision not made yet.
        self.survivors: dict[str, Survivor] = {}
        # Survivors that left before the decision (``left_unanswered``): member -> why. Their
        # ranks are handed out as the evicted ones are.
        self.withdrawn: dict[str, str] = {}
        # The groups of the cycle in flight whose slots Ray Train refills one by one (its
        # replica groups): should every worker of one go, Train may still replace them one at a
        # time, and its new workers then start the group anew (``_every_slot_anew``).
        self.train_slot_groups: set[str] = set()
        self.current: WarmRecord | None = None
        self.records: dict[int, WarmRecord] = {}  # by the new cycle's number

    @property
    def enabled(self) -> bool:
        return self.config.warm_restart

    # --- 1. at plan time ---------------------------------------------------------------------

    def choose_survivors(
        self, plan: TerminationPlan, processes: Iterable[Process], train_fn_saves: bool
    ) -> set[str]:
        """The processes whose order says ``rejoin``; remembered for ``decide``."""
        self.survivors, self.withdrawn, self.train_slot_groups = {}, {}, set()
        if not self.enabled or train_fn_saves or plan.abandoned:
            return set()
        self.train_slot_groups = {
            spec.group
            for process in processes
            for spec in process.registration.ranks
            if spec.replaced_by is Replacement.TRAIN_SLOT and spec.group not in plan.incomplete
        }
        staying = {(o.group, o.rank) for o in plan.orders if not o.evicted and o.health != FAULTY}
        for process in processes:
            specs = [s for s in process.registration.ranks if s.key in process.keys]
            if (
                len(specs) == 1
                and specs[0].key in staying
                and specs[0].group not in plan.incomplete
                and specs[0].replaced_by is not Replacement.WHOLE_GROUP
            ):
                self.survivors[process.process_id] = Survivor(
                    process.process_id, specs[0], process.node_id, process.registration.pid
                )
        return set(self.survivors)

    def spare_nodes(
        self, plan: TerminationPlan, spares: Iterable[SpareRecord]
    ) -> dict[str, list[str]]:
        """Per shard key, the nodes of the spares that ``decide`` will hand its evicted slots.

        ``decide`` hands the evicted slots of the survivors' groups, in (group, rank) order, to
        the free spares in their registration order; the same pairing here lets the memory tier
        put each evicted shard's copy on its spare's node (``memory/placement.py``). A hint
        only: should the pool change before ``decide``, a spare loads from a peer instead.
        """
        free = free_spares(spares)
        if not self.survivors or not free:  # no warm restart to place for (16,384 ranks: 0.1 s)
            return {}
        groups = {s.spec.group for s in self.survivors.values()}
        staying = {(s.spec.group, s.spec.rank) for s in self.survivors.values()}
        out: dict[str, list[str]] = {}
        for order in sorted(plan.orders, key=lambda o: (o.group, o.rank)):
            if order.group in groups and (order.group, order.rank) not in staying and free:
                out.setdefault(shard_key(order.group, order.shard), []).append(free.pop(0).node_id)
        return out

    def may_hold(self, plan: TerminationPlan, spare_nodes: dict[str, list[str]]) -> set[RankKey]:
        """The survivors' ranks that hold their own shard instead of saving it before anyone
        trains again (``coordinator/held.py``): with a memory tier and ``warm_restart_holds``,
        where every evicted slot of their group has a spare (the warm restart should go ahead).
        A spare whose shard such a survivor holds receives it from that survivor over the new
        group (``decide``)."""
        if not (self.survivors and self.config.warm_restart_holds):
            return set()
        if self.config.memory_replicas <= 0:
            return set()
        staying = {s.spec.key for s in self.survivors.values()}
        evicted: dict[str, int] = {}
        for order in plan.orders:
            if (order.group, order.rank) not in staying:
                evicted[order.group] = evicted.get(order.group, 0) + 1
        spared: dict[str, int] = {}
        for key, nodes in spare_nodes.items():
            group = key.partition("/")[0]
            spared[group] = spared.get(group, 0) + len(nodes)
        for group in self._train_groups():  # Ray Train starts a process in every evicted slot
            spared[group] = evicted.get(group, 0)
        return {
            s.spec.key
            for s in self.survivors.values()
            if evicted.get(s.spec.group, 0) <= spared.get(s.spec.group, 0)
        }

    # --- 2. when the cycle concluded ---------------------------------------------------------

    def decide(
        self,
        from_cycle: int,
        step: int | None,
        committed: bool,
        reported: dict[str, bool],
        evicted_ranks: dict[str, dict[int, str]],
        spares: list[SpareRecord],
        evicted_nodes: frozenset[str],
        held: dict[str, tuple[str, int]] | None = None,
        parked: frozenset[str] = frozenset(),
        slots_free_at: dict[RankKey, float] | None = None,
        *,
        now: float,
    ) -> WarmRecord | None:
        """The next cycle's membership, or every survivor told to leave (with the reason).

        ``held``: shard key -> (the survivor's process id, bytes) for each shard a survivor
        holds without a copy anywhere yet; a member that takes such a shard and cannot prove it
        (a spare, or a survivor not in ``parked``: its training thread was not parked at the
        step) receives it from that survivor over the new group. A holder that left before
        the decision copied its shard to the keepers as it went (``held.py`` keeps that early
        copy): its slot's taker loads it from there.

        ``reported``: survivor process id -> whether its teardown reported in time (one that did
        not cannot be trusted to be out of its collective). ``evicted_ranks``: group -> the
        ranks that left, with their shard labels. Spares handed a slot are taken out of
        ``spares`` by the caller (``assigned``). ``slots_free_at``: an evicted rank whose node
        is drained -> the node's deadline (a slot Ray Train refills only once it passed).
        """
        if not self.survivors:
            return None
        record = WarmRecord(
            from_cycle, from_cycle + 1, step if step is not None else -1, WarmResult.COLD,
            started_at=now, train_groups=frozenset(self._train_groups()),
            held_shards=frozenset(held or {}),
        )  # fmt: skip
        why = self._why_not(step, committed, reported)
        if why is None:
            why = self._plan_members(
                record, evicted_ranks, spares, evicted_nodes, slots_free_at or {}, now
            )
        if why is None:
            self._peers(record, held or {}, parked)
        if why is not None:
            record.result, record.reason = WarmResult.COLD, why
            record.members = {}
            record.told_to_leave = {pid: why for pid in self.survivors}
            record.finished_at = now
        else:
            record.result = WarmResult.REJOINING
            # A survivor begins its rejoin within rejoin_timeout_s of this decision or leaves by
            # itself; then the group forms within rejoin_timeout_s or every member fails.
            record.join_by = record.started_at + 2 * self.config.rejoin_timeout_s
        self.current = record
        self.records[record.cycle] = record
        for old in [c for c in self.records if c < record.cycle - 16]:
            del self.records[old]
        # Decided: a later cycle that ends before its plan (a failed cycle) finds none left.
        self.survivors = {}
        return record

    def _why_not(self, step: int | None, committed: bool, reported: dict[str, bool]) -> str | None:
        if not committed or step is None or step < 0:
            return "no checkpoint was committed at one step: the survivors cannot all hold it"
        silent = [pid for pid in self.survivors if not reported.get(pid)]
        if silent:
            names = ", ".join(f"pid {self.survivors[p].pid}" for p in silent[:3])
            return f"{len(silent)} survivor(s) sent no teardown report ({names})"
        return None

    def _plan_members(
        self,
        record: WarmRecord,
        evicted_ranks: dict[str, dict[int, str]],
        spares: list[SpareRecord],
        evicted_nodes: frozenset[str],
        slots_free_at: dict[RankKey, float],
        now: float,
    ) -> str | None:
        """Fill ``record.members``; the reason when a group cannot continue."""
        free = free_spares(spares, evicted_nodes)
        groups: dict[str, list[Survivor]] = {}
        for survivor in self.survivors.values():
            groups.setdefault(survivor.spec.group, []).append(survivor)
        for group, survivors in sorted(groups.items()):
            world = survivors[0].spec.world_size
            slots = [
                (s.spec.rank, s.process_id, s.spec.shard, f"survivor of rank {s.spec.rank}")
                for s in survivors
            ]
            train_slots = survivors[0].spec.replaced_by is Replacement.TRAIN_SLOT
            for rank, shard in sorted(evicted_ranks.get(group, {}).items()):
                if free:
                    slots.append((rank, free.pop(0).spare_id, shard, f"spare for rank {rank}"))
                elif train_slots:  # the process Ray Train starts in the slot takes it
                    wait = slots_free_at.get((group, rank), now) - now
                    if wait > TRAIN_SLOT_WAIT_LIMIT_S:
                        return (
                            f"group {group!r}: rank {rank}'s node is drained until its deadline "
                            f"in {wait:.0f}s, and Ray Train starts the new worker in the same "
                            "placement-group bundle only once the node is gone: its full "
                            "restart is sooner"
                        )
                    member = train_slot_member(group, rank)
                    slots.append((rank, member, shard, f"Ray Train's new worker for rank {rank}"))
            slots.sort()
            if len(slots) < world:
                why = why_not_smaller(
                    group, world, slots, evicted_ranks.get(group, {}), self.config.min_world_size
                )
                if why is not None:
                    return why
                slots = [(i, *slot[1:]) for i, slot in enumerate(slots)]  # renumbered, in order
                world = len(slots)
            for rank, member, shard, was in slots:
                record.members[member] = self._rendezvous(record, group, rank, world, shard, was)
        return None

    def _peers(
        self, record: WarmRecord, held: dict[str, tuple[str, int]], parked: frozenset[str]
    ) -> None:
        """A member whose shard a survivor holds (no keeper has it yet) and who cannot prove
        that shard itself - a spare, or a survivor whose thread was not parked at the step (a
        backup released from inside its step) - receives it from that survivor once the new
        group formed: the holder sends, the receiver checks the step and the size. Both sides
        follow this record, so no send waits for a receiver that will not come."""
        for member, answer in list(record.members.items()):
            holder, nbytes = held.get(shard_key(answer.group, answer.shard), ("", 0))
            source = record.members.get(holder)
            if member == holder or source is None or source.group != answer.group:
                continue
            if member in parked:  # only survivors have a parked step
                continue  # it holds the step itself (rejoin.py checks it is parked there)
            record.members[member] = replace(answer, peer=source.rank, shard_bytes=nbytes)
            source = record.members[holder]
            record.members[holder] = replace(source, send_to=(*source.send_to, answer.rank))

    def _train_groups(self) -> set[str]:
        """The survivors' groups whose evicted slots Ray Train fills (its replica groups)."""
        return {
            s.spec.group
            for s in self.survivors.values()
            if s.spec.replaced_by is Replacement.TRAIN_SLOT
        }

    def _rendezvous(
        self, record: WarmRecord, group: str, rank: int, world: int, shard: str, was: str
    ) -> Rendezvous:
        assert self.store is not None, "a warm restart was decided without a store"
        host, port = self.store
        return Rendezvous(
            RendezvousAction.JOIN,
            cycle=record.cycle,
            group=group,
            rank=rank,
            world_size=world,
            shard=shard,
            step=record.step,
            store_host=host,
            store_port=port,
            prefix=f"ray_graceful/cycle{record.cycle}/{group}",
            timeout_s=self.config.rejoin_timeout_s,
            was=was,
        )

    def after_cycle(
        self,
        cycle: Cycle,
        step: int | None,
        committed: bool,
        registry: Registry,
        spares: list[SpareRecord],
        now: float,
    ) -> tuple[WarmRecord | None, list[tuple[SpareRecord, SpareAnswer]]]:
        """``decide`` from what the concluded ``cycle`` left: the record, and each spare handed a
        slot with its word (marked ``assigned``; the caller tells it)."""
        going = {**self._going_after_the_plan(cycle), **self.withdrawn}
        for pid in going:
            self.survivors.pop(pid, None)
        train_slot_groups, self.train_slot_groups = self.train_slot_groups, set()
        if not self.survivors:
            self.withdrawn = {}
            anew = self._every_slot_anew(cycle, step, committed, registry, train_slot_groups, now)
            if anew is not None:
                anew.told_to_leave.update(going)
            return anew, []
        involved = [p for p in registry.active(cycle.number) if p.order is not None]
        held = {
            record.shard: (p.process_id, record.bytes)
            for p in involved
            for record in (p.report.saved if p.report is not None else ())
            if record.tier is Place.HELD
        }
        evicted, slots_free_at = self._evicted_slots(cycle, registry)
        record = self.decide(
            cycle.number,
            step,
            committed,
            {p.process_id: p.report is not None for p in involved},
            evicted,
            spares,
            # Nodes that go as a whole (a drain, a node's notice). A spare on a node only one
            # process of which was signalled stays: were the node going, it would be signalled
            # too, and leave the pool (worker/spare_wait.py).
            frozenset(n.node_id for n in cycle.notices + cycle.late_notices if n.node_id),
            held,
            frozenset(
                p.process_id
                for p in involved
                if p.report is not None and step is not None and p.report.parked_at == step
            ),
            slots_free_at,
            now=now,
        )
        self.withdrawn = {}
        if record is not None:  # its slot went to a spare (or Train's new worker) instead
            record.told_to_leave.update(going)
        by_id = {s.spare_id: s for s in spares}
        told = []
        for member, answer in record.members.items() if record else ():
            spare = by_id.get(member)
            if spare is not None:
                spare.assigned = True
                why = f"warm restart: {answer.was}"
                told.append(
                    (
                        spare,
                        SpareAnswer(
                            SpareAction.ASSIGNED, why, answer.group, answer.rank, answer.cycle
                        ),
                    )
                )
        return record, told

    def _every_slot_anew(
        self,
        cycle: Cycle,
        step: int | None,
        committed: bool,
        registry: Registry,
        groups: set[str],
        now: float,
    ) -> WarmRecord | None:
        """Every worker of a Ray Train group left in this cycle (all evicted, or the survivors
        went too): the workers Train starts in its slots form the group anew, each loading the
        committed step - the record names every slot.

        Train restarts the whole group when every replica group fails at once, and its new
        workers then form Train's process group and load the step themselves (``train.setup``:
        they never ask). But it sees failures one poll at a time: one worker's exit seen before
        the others left is replaced alone, and its new worker - and then the others' - would
        find no warm restart to join, and fail in turn until ``max_failures`` is spent. With
        this record they join. One nobody joins fails at its ``join_by`` and ends no one (only
        members that said they joined are ever ended)."""
        if not groups or not committed or step is None or step < 0:
            return None
        evicted, _ = self._evicted_slots(cycle, registry)
        worlds = {spec.group: spec.world_size for spec, _ in registry.ranks_of(cycle.number)}
        record = WarmRecord(
            cycle.number, cycle.number + 1, step, WarmResult.REJOINING, started_at=now,
            train_groups=frozenset(groups), join_by=now + 2 * self.config.rejoin_timeout_s,
            anew=True,
        )  # fmt: skip
        for group in sorted(groups):
            ranks = evicted.get(group, {})
            if not ranks or len(ranks) != worlds.get(group):
                continue  # not every slot of it left: not a group to start anew
            for rank, shard in sorted(ranks.items()):
                was = f"Ray Train's new worker for rank {rank} (every worker of the group left)"
                record.members[train_slot_member(group, rank)] = self._rendezvous(
                    record, group, rank, len(ranks), shard, was
                )
        if not record.members:
            return None
        self.current = record
        self.records[record.cycle] = record
        return record

    def _evicted_slots(
        self, cycle: Cycle, registry: Registry
    ) -> tuple[dict[str, dict[int, str]], dict[RankKey, float]]:
        """The ranks that left (group -> rank -> shard), and for those on a drained node the
        node's deadline (``TRAIN_SLOT_WAIT_LIMIT_S``)."""
        drained = {
            n.node_id: n.deadline
            for n in cycle.notices + cycle.late_notices
            if n.node_id is not None and n.deadline
        }
        evicted: dict[str, dict[int, str]] = {}
        slots_free_at: dict[RankKey, float] = {}
        for spec, process in registry.ranks_of(cycle.number):
            if process.process_id not in self.survivors:
                evicted.setdefault(spec.group, {})[spec.rank] = spec.shard
                if process.node_id in drained:
                    slots_free_at[spec.key] = drained[process.node_id]
        return evicted, slots_free_at

    def _going_after_the_plan(self, cycle: Cycle) -> dict[str, str]:
        """The survivors that may not stay after all, with why: found FAULTY after the plan, or
        named by a notice that came after it (its own SIGTERM, its node drained) - its process
        is going too. Their slots are handed out as the evicted ones are."""
        going = {
            pid: f"found FAULTY after the plan: {why}"[:300]
            for pid, why in cycle.late_faulty.items()
            if pid in self.survivors
        }
        for pid, survivor in self.survivors.items():
            for notice in cycle.late_notices:
                its_rank = notice.rank is not None and tuple(notice.rank) == survivor.spec.key
                its_node = notice.node_id is not None and notice.node_id == survivor.node_id
                if pid not in going and (its_rank or its_node):
                    why = f"a notice after the plan named it ({notice.source}: {notice.reason})"
                    going[pid] = why[:300]
        return going

    # --- 3. the rendezvous -------------------------------------------------------------------

    def answer(self, member: str) -> Rendezvous | None:
        if member in self.survivors:
            # Ordered to rejoin in the cycle in flight: wait for its decision - never hand out
            # the last one, which named the cycle this member is leaving now.
            return None
        slot = member.partition(":")[2] if member.startswith(TRAIN_SLOT_PREFIX) else ""
        if slot and slot.partition("/")[0] in self._train_groups() | self.train_slot_groups:
            return None  # Ray Train's new worker for a slot of the cycle in flight: it waits too
        record = self.current
        if record is not None and member in record.members:
            return record.members[member]
        if record is not None and member in record.told_to_leave:
            return Rendezvous(RendezvousAction.LEAVE, record.told_to_leave[member], record.cycle)
        if slot and record is not None and record.result is WarmResult.COLD:
            return Rendezvous(RendezvousAction.LEAVE, record.reason, record.cycle)
        return Rendezvous(
            RendezvousAction.LEAVE, "not a member of a warm restart (no rejoin order for it)"
        )

    # --- 4. what each member did -------------------------------------------------------------

    def supersede(self, cycle: int, now: float) -> WarmRecord | None:
        """The warm restart into ``cycle``, which just concluded, if a member of it never said
        what it did: over, failed - the cycle's own plan has taken its place (a member that
        died on its way in, Ray Train's new worker killed in its load, is such a cycle's
        notice). Left open, its ``join_by`` would end the members of the group after it.
        Returns the record if it was superseded here."""
        record = self.records.get(cycle)
        if record is None or record.result is not WarmResult.REJOINING:
            return None
        record.fail_silent(lambda n: f"its cycle {cycle} ended before {n} member(s) joined", now)
        return record

    def overdue(self, cycle: int, now: float) -> WarmRecord | None:
        """At the record's ``join_by``: fail the warm restart into ``cycle`` if a member has not
        said what it did - it died or hangs where nothing watches it (a spare killed between its
        assignment and its registration). Returns the record if it just failed."""
        record = self.records.get(cycle)
        if record is None or record.result is not WarmResult.REJOINING or now < record.join_by:
            return None
        limit = self.config.rejoin_timeout_s
        record.fail_silent(
            lambda n: (
                f"{n} member(s) did not join within 2 x rejoin_timeout_s={limit} of the decision"
            ),
            now,
        )
        return record

    def joined(self, result: Rejoined, now: float) -> WarmRecord | None:
        """Record one member's result; returns the record if the warm restart just failed."""
        if not result.joined and not result.cycle:
            return self.left_unanswered(result.member, result.reason, now)
        record = self.records.get(result.cycle)
        if record is None or result.member not in record.members:
            return None
        return record if record.take(result, now) else None

    def left_unanswered(self, member: str, reason: str, now: float) -> WarmRecord | None:
        """A survivor left before it had its rendezvous (a SIGTERM in its teardown or while it
        waited, no word in time): never does a record keep a member that is gone. Before the
        decision it is no survivor any more (``decide`` hands its rank out as an evicted one's);
        after it, ``WarmRecord.member_left``. Returns the record if it just failed."""
        why = f"it left before it had its rendezvous: {reason}"[:300]
        if member in self.survivors:
            del self.survivors[member]
            self.withdrawn[member] = why
            return None
        record = self.current
        return record if record is not None and record.member_left(member, why, now) else None


def why_not_smaller(
    group: str, world: int, slots: list[tuple[Any, ...]], evicted: dict[int, str], floor: int
) -> str | None:
    """Why ``group`` cannot continue with only ``slots`` (no spare for its evicted ranks): its
    ``min_world_size`` ``floor``, or a shard that would have no holder left; None if it can."""
    short = f"group {group!r}: {world - len(slots)} evicted slot(s) and no spare free"
    if floor <= 0:
        return f"{short}; min_world_size is 0, so the group does not continue smaller"
    if len(slots) < floor:
        return f"{short}; {len(slots)} rank(s) left, below min_world_size {floor}"
    held = {slot[2] for slot in slots}
    lost = sorted(set(evicted.values()) - held)
    if lost:
        return (
            f"{short}; shard(s) {', '.join(lost[:3])} would have no holder in a smaller "
            "group (each rank holds its own state: shrinking needs replicas)"
        )
    return None
