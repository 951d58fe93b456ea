"""From the notices to every process's order (GATHERING -> TEARING_DOWN).

``plan_and_order`` makes the plan (``plan.py``: who saves, who backs up, who leaves, by when), then
a ``TeardownOrder`` for each process: its earliest deadline, what it saves and where - a checkpoint
directory, or the keepers that hold the shard in memory (``memory/placement.py``: surviving, not
FAULTY nodes, the node of the spare that will load it first) - and whether it rejoins in a warm
restart. Processes told the same share one order. Every order goes out at once (``OrderOut``):
the fan-out.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from ..health import FAULTY
from ..memory.placement import KeeperPool
from ..notices import Source
from ..place import destination
from ..plan import RankInfo, RankPlan, TerminationPlan, cyclic_gc_paused, plan_termination
from ..protocol import (
    Action,
    PollAnswer,
    PollKind,
    RankKey,
    SaveAssignment,
    ShardId,
    TeardownOrder,
)
from . import events as ev
from .cycle import Cycle, Phase
from .spare_pool import SpareRecord
from .state import CoordinatorState
from .warm_restarts import WarmRestarts


class KeeperPlacement(Protocol):
    """The memory tier as the planner sees it: where a shard's copies may go."""

    def nodes(self) -> list[str]:
        """Nodes with a keeper that is not leaving."""
        ...

    def names(self, nodes: Sequence[str]) -> tuple[str, ...]:
        """The keepers' actor names on ``nodes`` (what a save assignment carries)."""
        ...


def plan_and_order(
    state: CoordinatorState,
    warm: WarmRestarts,
    spares: Iterable[SpareRecord],
    placement: KeeperPlacement | None,
) -> list[ev.Decision]:
    with cyclic_gc_paused():  # one order per process, all kept: see cyclic_gc_paused
        return _plan_and_order(state, warm, spares, placement)


def _plan_and_order(
    state: CoordinatorState,
    warm: WarmRestarts,
    spares: Iterable[SpareRecord],
    placement: KeeperPlacement | None,
) -> list[ev.Decision]:
    out: list[ev.Decision] = []
    cycle, config = state.cycle, state.config
    plan, process_of = _plan(state, cycle)
    cycle.move(Phase.TEARING_DOWN, state.now)
    by_process: dict[str, list[RankPlan]] = {}
    for rank_order in plan.orders:
        by_process.setdefault(process_of[rank_order.group, rank_order.rank], []).append(rank_order)
    for notice in cycle.notices:  # a node-level notice: the node's keeper goes too
        if notice.node_id is not None:
            deadline = notice.effective_deadline(config.teardown_timeout_s)
            out.append(ev.NodeLeaving(notice.node_id, deadline))
    keepers = KeeperPool(_surviving_keepers(plan, placement))
    rejoiners = warm.choose_survivors(plan, state.active(), cycle.train_fn_saves)
    spare_nodes = warm.spare_nodes(plan, spares)
    holding = warm.may_hold(plan, spare_nodes)
    order_for = _OrderMaker(
        state,
        trigger="; ".join(f"{n.source}: {n.reason} ({n.target})" for n in cycle.notices[:3]),
        # A step boundary serves a save (its state is the step's) or a survivor's clean step.
        boundary_needed=bool(rejoiners) or any(o.action is not Action.LEAVE for o in plan.orders),
        agree_stop_step=_every_rank_answers(cycle, plan) and bool(holding),
    )
    for process_id, orders in by_process.items():
        saves = tuple(
            _assignment(state, plan, o, placement, keepers, spare_nodes, holding)
            for o in orders
            if o.action is not Action.LEAVE
        )
        answer = order_for(orders, saves, rejoin=process_id in rejoiners)
        state.registry.processes[process_id].order = answer.order
        out.append(ev.OrderOut(process_id, answer))
    cycle.awaiting_reports = deque(by_process)
    cycle.orders_at = state.now
    out += state.check_all_reported()
    return out


def _plan(state: CoordinatorState, cycle: Cycle) -> tuple[TerminationPlan, dict[RankKey, str]]:
    """The cycle's plan, from every rank it involves and their health; and who holds each."""
    topology, health, notes = [], {}, {}
    process_of: dict[RankKey, str] = {}
    for spec, process in state.registry.ranks_of(cycle.number):
        topology.append(RankInfo.of(spec, process.node_id))
        process_of[spec.key] = process.process_id
        if process.health is not None:
            health[spec.key] = process.health.verdict
            notes[spec.key] = process.health.summary()
        cycle.train_fn_saves = cycle.train_fn_saves or spec.train_fn_saves
    cycle.plan = plan = plan_termination(
        topology,
        cycle.notices,
        health,
        state.config,
        state.now,
        expected_save_s=state.save_times,
        health_notes=notes,
        destination=destination(
            state.config.checkpoint_dir, state.config.memory_replicas, cycle.train_fn_saves
        ),
    )
    return plan, process_of


class _OrderMaker:
    """Processes told the same thing share one order object, and one id: an order id only has
    to tell one order of a process from another (a process acknowledges the one it got), and
    most processes of a large job get the same order ("leave by T"). Shared, it is built once
    and pickled once per node or group reply (pickle keeps one copy of an object it meets
    twice), not once per process: at 16,384 processes that was most of the fan-out's bytes.
    One random prefix per cycle and a counter, not a uuid4 per order (0.1 s at 16,384)."""

    def __init__(
        self,
        state: CoordinatorState,
        trigger: str,
        boundary_needed: bool,
        agree_stop_step: bool = False,
    ) -> None:
        self.state, self.trigger, self.boundary_needed = state, trigger, boundary_needed
        self.agree_stop_step = agree_stop_step
        self.prefix = uuid.uuid4().hex[:16]
        self.told: dict[tuple, PollAnswer] = {}

    def __call__(
        self, orders: list[RankPlan], saves: tuple[SaveAssignment, ...], rejoin: bool
    ) -> PollAnswer:
        deadline = min(o.deadline for o in orders)
        skip_reason = "; ".join(o.reason for o in orders if o.action is not Action.SAVE)
        what = (deadline, saves, skip_reason, rejoin)
        answer = self.told.get(what)
        if answer is None:
            state = self.state
            answer = self.told[what] = PollAnswer(
                PollKind.ORDER,
                TeardownOrder(
                    job_id=state.job_id,
                    cycle=state.cycle.number,
                    order_id=f"{self.prefix}-{len(self.told)}",
                    deadline=deadline,
                    trigger=self.trigger,
                    saves=saves,
                    skip_reason=skip_reason,
                    save_budget_s=state.config.save_budget_s,
                    rejoin=rejoin,
                    boundary_needed=self.boundary_needed,
                    agree_stop_step=self.agree_stop_step,
                ),
            )
        return answer


def _every_rank_answers(cycle: Cycle, plan: TerminationPlan) -> bool:
    """Whether every rank of the cycle can take part in agreeing on its stop step: none lost
    (a dead actor, a silent host) or FAULTY (a GPU that may not answer). Where one cannot, the
    others would wait out the agreement for nothing: they are released as before."""
    silent = (Source.LOST, Source.HOST_LOST, Source.HEALTH)
    if any(n.source in silent for n in cycle.notices):
        return False
    return not any(o.health == FAULTY for o in plan.orders)


def _surviving_keepers(plan: TerminationPlan, placement: KeeperPlacement | None) -> list[str]:
    """Nodes with a keeper that are neither being evicted nor FAULTY in this plan."""
    if placement is None:
        return []
    out = {o.node_id for o in plan.orders if o.evicted or o.health == FAULTY}
    return [node for node in placement.nodes() if node not in out]


def _assignment(
    state: CoordinatorState,
    plan: TerminationPlan,
    order: RankPlan,
    placement: KeeperPlacement | None,
    keepers: KeeperPool,
    spare_nodes: dict[str, list[str]],
    holding: set[RankKey],
) -> SaveAssignment:
    shard = ShardId(order.group, order.shard)
    backup_for = plan.savers[shard][1] if order.action is Action.BACKUP else None
    key = shard.key
    holders: tuple[str, ...] = ()
    replicas = state.config.memory_replicas
    if placement is not None and replicas > 0:
        preferred = spare_nodes.get(key, ())
        holders = placement.names(keepers.choose(key, order.node_id, replicas, preferred))
    return SaveAssignment(
        order.group,
        order.rank,
        key,
        state.config.checkpoint_dir or "",
        backup_for=backup_for,
        start_by=order.start_by,
        keepers=holders,
        # Its own shard, which it keeps training from: held, copied to ``holders`` later
        hold=bool(holders) and backup_for is None and (order.group, order.rank) in holding,
    )
