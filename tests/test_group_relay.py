"""The tree of agents without Ray: node relays under a group relay under the real coordinator
actor's node calls (in-process), and which way the coordinator places each node agent."""

from __future__ import annotations

import asyncio

import pytest

from ray_graceful.coordinator.groups import GroupAgents
from ray_graceful.node.group import GroupRelay
from ray_graceful.node.relay import NodeRelay, Unreachable
from ray_graceful.protocol import Ack, PollKind, PollState, RankSpec, Register
from tests.helpers import until
from tests.test_node_relay import FakeCoordinator, InProcessCoordinator

pytestmark = pytest.mark.unit

NODES, PER_NODE = 3, 4


def register(node: int, i: int, world: int = NODES * PER_NODE) -> Register:
    rank = node * PER_NODE + i
    spec = (RankSpec("g", rank, world, str(rank), True),)
    return Register(f"p{rank}", f"node-{node}", 100 + rank, "h", "job", spec)


async def start_tree(upstream) -> tuple[GroupRelay, list[NodeRelay], list[asyncio.Future]]:
    """A group relay over ``NODES`` node relays of ``PER_NODE`` processes, every poll held."""
    group = GroupRelay("group-0", upstream, wait_s=30.0)
    nodes = [NodeRelay(f"node-{n}-key", group, wait_s=30.0) for n in range(NODES)]
    replies = await asyncio.gather(
        *(nodes[n].register(register(n, i)) for n in range(NODES) for i in range(PER_NODE))
    )
    assert all(r.accepted for r in replies), replies
    polls = [
        asyncio.ensure_future(nodes[n].poll(f"p{n * PER_NODE + i}", 0, PollState(), 30.0))
        for n in range(NODES)
        for i in range(PER_NODE)
    ]
    return group, nodes, polls


def test_an_order_reaches_every_rank_through_a_group_with_one_reply_from_the_coordinator(
    tmp_path,
):
    from ray_graceful.coordinator import CoordinatorActor
    from tests.helpers import fast_config

    async def scenario():
        config = fast_config(tmp_path, teardown_timeout_s=20.0, save_budget_s=5.0)
        coord = CoordinatorActor(
            config, "job", drain_source=lambda: {}, lost_source=lambda watched: set()
        )
        group, nodes, polls = await start_tree(InProcessCoordinator(coord))
        assert set(coord.fanout.served_by.values()) == {"group-0"}, "one member: the group"
        await until(lambda: coord.fanout.pending() == NODES * PER_NODE, 5, "the group's poll")
        assert coord.fanout.calls == 1, "one poll holds every process of the three nodes"

        assert (await coord.notify({"node_id": "node-0", "reason": "test"})).accepted
        answers = await asyncio.wait_for(asyncio.gather(*polls), 10)
        assert {a.kind for a in answers} == {PollKind.ORDER}, "every rank of the group"
        await until(lambda: group.parked, 5, "the group to stop polling")
        assert coord.fanout.calls <= 2, f"the coordinator answered {coord.fanout.calls} polls"
        assert group.node_polls <= 2 * NODES, "one reply per node, at most once more"

        replies = await asyncio.gather(
            *(
                nodes[k // PER_NODE].ack(Ack(f"p{k}", 0, answer.order.order_id))
                for k, answer in enumerate(answers)
            )
        )
        assert all(r.accepted for r in replies)
        assert all(p.acked for p in coord.machine.registry.processes.values())
        assert group.members == {} and all(n.members == {} for n in nodes)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_node_that_lost_its_reply_gets_its_orders_again_and_one_that_holds_them_does_not():
    async def scenario():
        from ray_graceful.protocol import PollAnswer, TeardownOrder

        coordinator = FakeCoordinator()
        group = GroupRelay("group-0", coordinator, wait_s=30.0)
        await asyncio.gather(*(group.register("node-a", [register(0, i)]) for i in range(2)))
        held = asyncio.ensure_future(group.poll("node-a", {"p0": (0, PollState())}, 30.0))
        await until(lambda: coordinator.fanout.pending() == 2, 5, "the group's poll")
        order = TeardownOrder("job", 0, "o0", deadline=0.0, trigger="test")
        coordinator.fanout.answer("p0", PollAnswer(PollKind.ORDER, order))
        assert (await asyncio.wait_for(held, 5))["p0"].order.order_id == "o0"

        lost = await asyncio.wait_for(group.poll("node-a", {"p0": (0, PollState())}, 30.0), 1)
        assert lost["p0"].order.order_id == "o0", "its node never got it: sent again"
        holds = PollState(holding="o0")
        kept = await group.poll("node-a", {"p0": (0, holds)}, 0.2)
        assert kept == {}, "its node holds it: not sent again"

        stranger = await group.poll("node-b", {"p1": (0, PollState())}, 1.0)
        assert stranger["p1"].kind is PollKind.UNKNOWN, "p1 registered through node-a"

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_an_unreachable_coordinator_reaches_every_process_through_both_levels():
    async def scenario():
        coordinator = FakeCoordinator()
        _group, nodes, polls = await start_tree(coordinator)
        await until(lambda: coordinator.fanout.pending() == NODES * PER_NODE, 5, "polls")
        coordinator.unreachable = Unreachable("ActorUnavailableError: restarting", True)
        coordinator.fanout.forget_except(set())  # the held poll ends; the next one fails
        answers = await asyncio.wait_for(asyncio.gather(*polls), 10)
        assert {a.kind for a in answers} == {PollKind.AWAY}, "each process registers again"
        again = await nodes[0].register(register(0, 0))
        assert not again.accepted and again.retry, "refused through both levels, to retry"

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_the_coordinator_answers_the_first_nodes_itself_and_groups_the_rest():
    started: list[int] = []

    def start(index: int) -> tuple[str, object]:
        started.append(index)
        return f"group-{index}-{len(started)}", object()

    live = {"a", "b", "c", "d", "e", "f"}  # the nodes hosting ranks of the job
    groups = GroupAgents(2, start, lambda: live, grace_s=0.0)
    ways = {n: groups.join(n) for n in ("a", "b", "c", "d", "e")}
    assert ways["a"] is None and ways["b"] is None, "the first two poll the coordinator"
    assert ways["c"] == ways["d"] == groups.groups[0], "the next two share group 0"
    assert ways["e"] == groups.groups[1] and started == [0, 1]
    assert groups.join("c") == groups.groups[0], "a node keeps its place"
    assert groups.describe()["groups"] == {"group-0-1": 2, "group-1-2": 1}

    dead = groups.groups[0][0]
    assert groups.join("d", gone=dead)[0] == "group-0-3", "a dead group is started afresh"
    assert groups.join("c", gone=dead)[0] == "group-0-3", "once, whoever names it"
    assert started == [0, 1, 0]

    live.discard("b")  # b left the job; group 1 has room for one more
    groups.join("f")
    assert started == [0, 1, 0], "f takes group 1's free place"
    assert groups.join("g") is None, "every place taken: b's is freed, and given to g"
    assert GroupAgents(0, start, lambda: live).join("x") is None, "0: never a group"
