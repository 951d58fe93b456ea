"""The node agent's relay and the coordinator's fan-out, without Ray: a fake coordinator behind
the relay's ``Upstream`` seam, the real ``Fanout`` behind the fake."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ray_graceful.coordinator.fanout import Fanout
from ray_graceful.health import FAULTY, HEALTHY, HealthReport
from ray_graceful.node.relay import Member, NodeRelay, Unreachable
from ray_graceful.protocol import (
    Ack,
    PollAnswer,
    PollKind,
    PollState,
    RankSpec,
    Register,
    Reply,
    TeardownOrder,
    TeardownReport,
    wire,
)
from tests.helpers import until as wait_until

pytestmark = pytest.mark.unit


def register(i: int) -> Register:
    return Register(f"p{i}", "node-a", 100 + i, "host", "job", (RankSpec("g", i, 8, str(i), True),))


def order(i: int) -> TeardownOrder:
    return TeardownOrder("job", 0, f"o{i}", deadline=0.0, trigger="test")


class FakeCoordinator:
    """Answers like the coordinator actor: registrations accepted into cycle 0, polls held in
    a real ``Fanout`` until ``order`` hands them answers; every call is recorded."""

    def __init__(self) -> None:
        self.fanout = Fanout()
        self.calls: list[tuple[str, int]] = []  # (what, how many messages it carried)
        self.states: list[dict] = []
        self.unreachable: Unreachable | None = None

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]:
        self.calls.append(("register", len(messages)))
        if self.unreachable:
            raise self.unreachable
        for message in messages:
            self.fanout.through_node(message.process_id, node_key)
        return [Reply.ok(0) for _ in messages]

    async def poll(self, node_key: str, states: dict, wait_s: float) -> dict[str, PollAnswer]:
        self.calls.append(("poll", len(states)))
        self.states.append(states)
        if self.unreachable:
            raise self.unreachable
        return await self.fanout.hold_node(node_key, {}, wait_s)

    async def ack(self, acks: list[Ack]) -> list[Reply]:
        self.calls.append(("ack", len(acks)))
        return [Reply.ok(0) for _ in acks]

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]:
        self.calls.append(("report", len(reports)))
        if self.unreachable:
            raise self.unreachable
        return [Reply.ok(0) for _ in reports]

    def count(self, what: str) -> int:
        return sum(1 for call, _ in self.calls if call == what)


class FixedProbe:
    def __init__(self, gpus: tuple[int, ...], faulty: set[int], checks: list) -> None:
        self.gpus, self.faulty, self.checks = gpus, faulty, checks

    def check(self) -> HealthReport:
        self.checks.append(self.gpus)
        bad = self.faulty & set(self.gpus)
        return HealthReport(FAULTY if bad else HEALTHY, probe=f"gpus {self.gpus}")


async def until(condition, timeout: float = 5.0) -> None:
    await wait_until(condition, timeout, "the relay's state")


def test_a_node_registers_polls_and_is_ordered_in_one_message_each():
    async def scenario():
        coordinator = FakeCoordinator()
        relay = NodeRelay("node-a-1", coordinator, wait_s=30.0)
        replies = await asyncio.gather(*(relay.register(register(i)) for i in range(8)))
        assert all(r.accepted and r.cycle == 0 for r in replies)
        registrations = [n for call, n in coordinator.calls if call == "register"]
        assert registrations == [8], "eight registrations, one message"

        polls = [
            asyncio.ensure_future(relay.poll(f"p{i}", 0, PollState(last_step=7), 30.0))
            for i in range(8)
        ]
        await until(lambda: coordinator.fanout.pending() == 8)
        assert coordinator.count("poll") == 1, "one long poll holds the whole node"

        for i in range(8):  # the coordinator's step: every order of the node at once
            coordinator.fanout.answer(f"p{i}", PollAnswer(PollKind.ORDER, order(i)))
        answers = await asyncio.wait_for(asyncio.gather(*polls), 5)
        assert [a.order.order_id for a in answers] == [f"o{i}" for i in range(8)]
        assert coordinator.count("poll") <= 2, "the orders came back in the node's one reply"

        acks = await asyncio.gather(*(relay.ack(Ack(f"p{i}", 0, f"o{i}")) for i in range(8)))
        assert all(a.accepted for a in acks)
        assert [n for c, n in coordinator.calls if c == "ack"] == [8], "acks go up together"
        assert relay.members == {}, "an acknowledged process is no longer polled for"

    asyncio.run(scenario())


def test_an_order_that_comes_between_two_polls_waits_for_the_next():
    async def scenario():
        coordinator = FakeCoordinator()
        relay = NodeRelay("node-a-1", coordinator, wait_s=30.0)
        await relay.register(register(0))
        first = asyncio.ensure_future(relay.poll("p0", 0, PollState(), 0.05))
        assert (await first).kind is PollKind.IDLE
        await until(lambda: coordinator.fanout.pending() == 1)
        coordinator.fanout.answer("p0", PollAnswer(PollKind.ORDER, order(0)))
        await until(lambda: relay.members["p0"].answer is not None)  # kept: p0 held no poll
        answer = await asyncio.wait_for(relay.poll("p0", 0, PollState(), 30.0), 1)
        assert answer.kind is PollKind.ORDER, "kept for it, handed to its next poll at once"

    asyncio.run(scenario())


def test_health_is_probed_once_per_gpu_and_each_verdict_reaches_its_ranks():
    async def scenario():
        coordinator, checks = FakeCoordinator(), []
        relay = NodeRelay(
            "node-a-1",
            coordinator,
            wait_s=0.1,
            probe_for=lambda gpus: FixedProbe(gpus, faulty={1}, checks=checks),
        )
        # four processes on two GPUs: two per GPU (verl's colocated roles, say)
        await asyncio.gather(*(relay.register(register(i), gpus=(i % 2,)) for i in range(4)))
        held = [  # noqa: F841 (held: the processes' polls stay open)
            asyncio.ensure_future(relay.poll(f"p{i}", 0, PollState(last_step=i), 30.0))
            for i in range(4)
        ]
        await until(lambda: len(coordinator.states) >= 2)
        states = coordinator.states[-1]
        verdicts = {pid: state.health.verdict for pid, (_cycle, state) in states.items()}
        assert verdicts == {"p0": HEALTHY, "p1": FAULTY, "p2": HEALTHY, "p3": FAULTY}
        assert {pid: state.last_step for pid, (_c, state) in states.items()} == {
            "p0": 0,
            "p1": 1,
            "p2": 2,
            "p3": 3,
        }
        polls = coordinator.count("poll")
        assert len(checks) <= 2 * polls and set(checks) == {(0,), (1,)}, "once per GPU a poll"

    asyncio.run(scenario())


def test_an_unreachable_coordinator_sends_every_process_to_register_again():
    async def scenario():
        coordinator = FakeCoordinator()
        relay = NodeRelay("node-a-1", coordinator, wait_s=30.0)
        await asyncio.gather(*(relay.register(register(i)) for i in range(3)))
        polls = [asyncio.ensure_future(relay.poll(f"p{i}", 0, PollState(), 30.0)) for i in range(3)]
        await until(lambda: coordinator.fanout.pending() == 3)
        coordinator.unreachable = Unreachable("ActorUnavailableError: restarting", True)
        coordinator.fanout.forget_except(set())  # the held poll fails: the relay polls again
        answers = await asyncio.wait_for(asyncio.gather(*polls), 5)
        assert {a.kind for a in answers} == {PollKind.AWAY}
        assert "restarting" in answers[0].reason
        again = await relay.register(register(0))
        assert not again.accepted and again.retry, "restarting: the process tries again"
        coordinator.unreachable = Unreachable("ActorDiedError: gone", False)
        gone = await relay.register(register(0))
        assert not gone.accepted and not gone.retry, "gone for good: no retry"

    asyncio.run(scenario())


def test_a_process_between_polls_when_the_coordinator_went_away_is_told_it_is_unknown():
    """The relay forgets every process when its poll finds the coordinator away; one that held
    no poll then hears it on its next poll - "not registered" - and registers again (the control
    channel reconnects on UNKNOWN as on AWAY; it once took UNKNOWN for the end of the link)."""

    async def scenario():
        coordinator = FakeCoordinator()
        relay = NodeRelay("node-a-1", coordinator, wait_s=30.0)
        await asyncio.gather(*(relay.register(register(i)) for i in range(2)))
        held = asyncio.ensure_future(relay.poll("p0", 0, PollState(), 30.0))  # p1: between polls
        await until(lambda: coordinator.fanout.pending() == 2)  # the relay's poll, for both
        coordinator.unreachable = Unreachable("ActorUnavailableError: restarting", True)
        coordinator.fanout.forget_except(set())
        assert (await asyncio.wait_for(held, 5)).kind is PollKind.AWAY
        late = await asyncio.wait_for(relay.poll("p1", 0, PollState(), 30.0), 5)
        assert late.kind is PollKind.UNKNOWN and "not registered" in late.reason

    asyncio.run(scenario())


def test_a_nodes_reports_go_up_in_one_call_and_an_unreachable_coordinator_says_retry():
    async def scenario():
        coordinator = FakeCoordinator()
        relay = NodeRelay("node-a-1", coordinator, wait_s=30.0)
        reports = [
            TeardownReport(100 + i, "h", "node-a", "job", [], "t", 0, 0.0, 1.0) for i in range(8)
        ]
        replies = await asyncio.gather(*(relay.report(f"p{i}", r) for i, r in enumerate(reports)))
        assert all(r.accepted for r in replies)
        assert [n for c, n in coordinator.calls if c == "report"] == [8], "one call up"
        coordinator.unreachable = Unreachable("ActorUnavailableError: restarting", True)
        refused = await relay.report("p0", reports[0])
        assert not refused.accepted and refused.retry, "the process sends it itself"
        assert relay.describe()["reports_relayed"] == 9

    asyncio.run(scenario())


def test_a_process_that_polls_without_registering_is_told_so():
    async def scenario():
        relay = NodeRelay("node-a-1", FakeCoordinator(), wait_s=30.0)
        answer = await relay.poll("stranger", 0, PollState(), 1.0)
        assert answer.kind is PollKind.UNKNOWN and "not registered" in answer.reason

    asyncio.run(scenario())


def test_the_fanout_routes_each_answer_to_the_poll_its_process_holds():
    async def scenario():
        fanout = Fanout()
        fanout.through_node("p0", "node-a")
        fanout.through_node("p1", "node-a")
        node = asyncio.ensure_future(fanout.hold_node("node-a", {}, 30.0))
        direct = asyncio.ensure_future(fanout.hold("p2", 30.0))
        await until(lambda: fanout.pending() == 3)
        for pid in ("p0", "p1", "p2"):
            fanout.answer(pid, PollAnswer(PollKind.ORDER, order(0)))
        answers = await asyncio.wait_for(node, 1)
        assert set(answers) == {"p0", "p1"}, "one reply carries the node's answers"
        assert (await asyncio.wait_for(direct, 1)).kind is PollKind.ORDER

        fanout.directly("p1")  # its agent died: it registered again on its own
        assert fanout.served_by == {"p0": "node-a"}
        fanout.forget_except({"p1"})
        assert fanout.served_by == {} and fanout.nodes == {}, "nothing kept for the gone"
        assert fanout.calls == 2

    asyncio.run(scenario())


class InProcessCoordinator:
    """The real coordinator actor's node methods, called in-process (packed replies unpacked
    as ``node/upstream.py``'s ``RayUpstream`` does)."""

    def __init__(self, coord) -> None:
        self.coord = coord

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]:
        return wire.unpack(await self.coord.register_node(node_key, messages), list, "register")

    async def poll(self, node_key: str, states: dict, wait_s: float) -> dict[str, PollAnswer]:
        return wire.unpack(await self.coord.poll_node(node_key, states, wait_s), dict, "poll")

    async def ack(self, acks: list[Ack]) -> list[Reply]:
        return wire.unpack(await self.coord.ack_many(acks), list, "ack")

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]:
        return wire.unpack(await self.coord.report_many(reports), list, "report")


async def ordered_through_a_relay(tmp_path) -> tuple[Any, NodeRelay, list[PollAnswer]]:
    """The real coordinator actor's class, in-process, with two processes of node "node-a"
    registered through a relay; node-a noticed: (coordinator, relay, the two orders)."""
    from ray_graceful.coordinator import CoordinatorActor
    from tests.helpers import fast_config

    config = fast_config(tmp_path, teardown_timeout_s=20.0, save_budget_s=5.0)
    coord = CoordinatorActor(config, "job", drain_source=lambda: {}, lost_source=lambda w: set())
    relay = NodeRelay("node-a-1", InProcessCoordinator(coord), wait_s=30.0)
    messages = [
        Register(f"p{i}", "node-a", 100 + i, "h", "job", (RankSpec("g", i, 2, str(i), True),))
        for i in range(2)
    ]
    assert all(r.accepted for r in await asyncio.gather(*map(relay.register, messages)))
    polls = [asyncio.ensure_future(relay.poll(f"p{i}", 0, PollState(), 30.0)) for i in (0, 1)]
    await until(lambda: coord.fanout.pending() == 2)
    assert (await coord.notify({"node_id": "node-a", "reason": "test"})).accepted
    first = [await p for p in polls]
    assert {a.kind for a in first} == {PollKind.ORDER}
    return coord, relay, first


def test_an_order_the_relay_holds_is_not_sent_back_to_it_until_acknowledged(tmp_path):
    """The relay polled again as soon as its orders came, and the coordinator answered that
    poll at once with the same orders (not yet acknowledged), again and again - at thousands
    of nodes every agent spun between its orders and the acknowledgement. Now a relay whose
    processes all hold their orders sends no poll up until they acknowledged (or one more
    registers), hands an order again to a process that polls without acknowledging it, and a
    poll that does go up says which order it holds, so it is not sent back."""
    from ray_graceful.coordinator import events as ev

    async def scenario():
        coord, relay, first = await ordered_through_a_relay(tmp_path)
        await until(lambda: relay.parked)
        assert relay.upstream_polls <= 2, f"the relay's poll spun: {relay.upstream_polls} polls"
        held = PollState(holding=first[0].order.order_id)
        polled = coord.machine.step(ev.Polled("p0", 0, held), time.time())
        assert polled == [ev.HoldPoll("p0")], "not again"
        again = await asyncio.wait_for(relay.poll("p0", 0, PollState(), 30.0), 1)
        assert again.order.order_id == first[0].order.order_id, "handed again, not lost"
        replies = await asyncio.gather(
            *(relay.ack(Ack(f"p{i}", 0, first[i].order.order_id)) for i in (0, 1))
        )
        assert all(r.accepted for r in replies)
        return [p.acked for p in coord.machine.registry.processes.values()]

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [True, True]


def test_reports_a_node_gathers_reach_the_coordinator_as_if_each_came_alone(tmp_path):
    """The real coordinator, in-process: a node's teardown reports go up in one call and the
    cycle concludes on them; a malformed one in such a call is refused on its own."""
    import time

    async def scenario():
        coord, relay, _ = await ordered_through_a_relay(tmp_path)
        now = time.time()
        reports = [
            TeardownReport(100 + i, "h", "node-a", "job", [], "t", 0, now, now) for i in (0, 1)
        ]
        replies = await asyncio.gather(*(relay.report(f"p{i}", reports[i]) for i in (0, 1)))
        assert all(r.accepted for r in replies), replies
        outcome = await coord.wait_outcome(0, 20)
        assert outcome is not None and len(outcome.reports) == 2 and outcome.missing == []
        assert coord.nodes.reports_relayed == 2, "both came in the relay's one call"
        bad = wire.unpack(await coord.report_many([("p0", "no report"), "junk"]), list, "bad")
        assert [r.accepted for r in bad] == [False, False] and "TeardownReport" in bad[0].reason
        (not_a_list,) = wire.unpack(await coord.report_many("junk"), list, "not a list")
        assert not not_a_list.accepted and "(process id, report) pairs" in not_a_list.reason

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_agent_leaves_once_its_coordinator_is_gone_for_good_and_asks_only_when_idle():
    """``leave_with.py``: a busy relay asks the GCS nothing; an idle one asks until the
    coordinator is DEAD (a failed look is asked again), then leaves, once."""
    import threading

    from ray_graceful.leave_with import leave_with_coordinator

    relay = NodeRelay("node-a", FakeCoordinator(), 5.0)
    asked: list[str] = []
    left = threading.Event()
    answers = iter([RuntimeError("GCS away"), False, True])

    def is_gone(coordinator_id: str) -> bool:
        asked.append(coordinator_id)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    relay.members["p0"] = Member()  # a process relayed: the agent is busy
    watch = leave_with_coordinator(
        "c0ffee", "node agent", busy=relay.relaying, every_s=0.01, is_gone=is_gone, leave=left.set
    )
    assert not left.wait(0.2) and asked == [], "a busy agent asks the GCS nothing"
    relay.members.clear()  # its processes left it
    assert left.wait(5), "an idle agent leaves once its coordinator is gone for good"
    watch.join(5)
    assert asked == ["c0ffee"] * 3 and not watch.is_alive(), asked


def test_a_host_cut_off_orders_every_relayed_process_out_held_poll_or_not():
    """The agent's own order (``NodeRelay.order_out``): a process holding its poll gets it at
    once, one between two polls at its next; each order says why and saves nothing."""

    def cut_off(cycle: int) -> TeardownOrder:
        return TeardownOrder("job", cycle, f"cut-off-{cycle}", time.time() + 25, "cut off: test")

    async def scenario():
        relay = NodeRelay("node-a-1", FakeCoordinator(), wait_s=30.0)
        await relay.register(register(0))
        await relay.register(register(1))
        held = asyncio.ensure_future(relay.poll("p0", 0, PollState(), 30.0))
        await until(lambda: relay.members["p0"].waiting is not None)
        assert relay.order_out(cut_off) == 2
        first = await asyncio.wait_for(held, 1)
        second = await asyncio.wait_for(relay.poll("p1", 0, PollState(), 30.0), 1)
        return first, second

    first, second = asyncio.run(scenario())
    for answer in (first, second):
        assert answer.kind is PollKind.ORDER and answer.order.trigger == "cut off: test"
        assert answer.order.saves == () and answer.order.cycle == 0
