"""The group agent: one relay for the node agents of up to ``node_group_size`` nodes.

One level of node agents leaves the coordinator two Ray calls per node when an order goes out -
the node's reply and its acknowledgements - serial on its event loop, about 1 ms a node
(docs/benchmarks.md, "fanout"): 2,048 nodes, 2 s. Past ``node_group_size`` nodes, the
coordinator answers further node agents through group agents instead: each is a ``Relay`` whose
members are the processes of its nodes and which offers those nodes the coordinator's own
node-facing calls (``register_node``, ``poll_node``, ``ack_many``, ``report_many``, replies
packed the same way). A node agent cannot tell the two apart. The coordinator then answers one
reply per group, and the groups answer their nodes in parallel, each in its own process.

The coordinator starts its group agents on its own node (``coordinator/groups.py``): the
driver's node, whose loss ends the job anyway, so a group agent is not lost to the evictions it
must carry the orders of. A group agent that dies anyway (its process killed; it dies with the
coordinator, its owner) is noticed by its node agents at their next call: each asks the
coordinator for a group again, and meanwhile tells its processes to register again
(``node/upstream.py``, ``TieredUpstream``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from ..protocol import Ack, PollAnswer, PollKind, PollState, Register, Reply, TeardownReport, wire
from .relay import Batch, Member, Relay, Unreachable, Upstream, poll_wait, refusal
from .upstream import RayUpstream

MAX_CONCURRENCY = 10_000  # held polls and calls one group agent serves at once


class GroupRelay(Relay):
    """Speaks for the processes of many node agents: one held poll per node, here.

    Its downstream is ``Upstream`` - what a node relay calls - so a node relay's upstream may be
    a group relay or the coordinator alike."""

    def __init__(self, key: str, upstream: Upstream, wait_s: float) -> None:
        super().__init__(key, upstream, wait_s)
        self.outbox: dict[str, dict[str, PollAnswer]] = {}  # node key -> answers for it
        self.waiting: dict[str, asyncio.Future] = {}  # node key -> its held poll
        self.node_polls = 0

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]:
        """A node agent's registrations, gathered with other nodes' into one call up."""
        for message in messages:
            self._joining[message.process_id] = Member(node_key=node_key, wait_s=self.wait_s)
        try:
            return await self._each_up(self.registrations, messages)
        finally:
            for message in messages:
                self._joining.pop(message.process_id, None)

    async def poll(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> dict[str, PollAnswer]:
        """A node agent's long poll: at once with any answer for its processes, else when one
        comes or ``wait_s`` ends (``{}``: every process polls again)."""
        self.node_polls += 1
        wait_s = poll_wait(wait_s)
        now = time.monotonic()
        answers = self.outbox.pop(node_key, {})
        for process_id, told in states.items():
            member = self.members.get(process_id)
            cycle, state = told if isinstance(told, tuple) and len(told) == 2 else (None, None)
            if member is None or member.node_key != node_key or not isinstance(state, PollState):
                why = "this process is not registered with its group agent"
                answers.setdefault(process_id, PollAnswer(PollKind.UNKNOWN, reason=why))
                continue
            member.cycle, member.state, member.seen, member.wait_s = cycle, state, now, wait_s
            holding = member.holding
            lost = holding is not None and state.holding != member.holding_id()
            if holding is not None and lost and process_id not in answers:  # never got it: again
                answers[process_id] = holding
        if not answers:
            answers = await self._hold(node_key, wait_s)
        return self._handed(answers)

    async def ack(self, acks: list[Ack]) -> list[Reply]:
        """A node agent's acknowledgements, gathered with other nodes' into one call up."""
        for message in acks:
            self._acknowledged(message.process_id)
        return await self._each_up(self.acks, acks)

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]:
        """Node agents' teardown reports, gathered with other nodes' into one call up."""
        self.reports_relayed += len(reports)
        return await self._each_up(self.reports, reports)

    async def _each_up(self, batch: Batch, items: list[Any]) -> list[Reply]:
        """``items`` up in ``batch``, with what other nodes send meanwhile: a reply each (the
        refusal for all, if the call up failed)."""
        try:
            return list(await asyncio.gather(*(batch.add(item) for item in items)))
        except (Unreachable, TimeoutError) as exc:
            return [refusal(exc)] * len(items)

    def describe(self) -> dict[str, Any]:
        nodes = {m.node_key for m in self.members.values()}
        return {**super().describe(), "nodes": len(nodes), "node_polls": self.node_polls}

    async def _hold(self, node_key: str, wait_s: float) -> dict[str, PollAnswer]:
        earlier = self.waiting.get(node_key)
        if earlier is not None and not earlier.done():
            earlier.set_result(None)  # replaced by this poll of the same node
        mine = self.waiting[node_key] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(mine, timeout=wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            if self.waiting.get(node_key) is mine:
                del self.waiting[node_key]
        if mine.done() and not mine.cancelled() and mine.result() is None:
            return {}  # a newer poll of the node takes the answers
        return self.outbox.pop(node_key, {})

    def _deliver(self, process_id: str, member: Member, answer: PollAnswer) -> None:
        self.outbox.setdefault(member.node_key, {})[process_id] = answer
        held = self.waiting.get(member.node_key)
        if held is not None and not held.done():
            held.set_result(True)  # the node's reply goes out once, with every answer so far

    def _handed(self, answers: dict[str, PollAnswer]) -> dict[str, PollAnswer]:
        for process_id, answer in answers.items():
            self._ended(process_id, answer)
        return answers


class GroupAgent:
    """The actor (async): the coordinator's node-facing calls, for its node agents."""

    def __init__(self, wait_s: float, coordinator: Any, key: str) -> None:
        self.key = key
        self.relay = GroupRelay(key, RayUpstream(coordinator), wait_s)

    async def register_node(self, node_key: str, messages: list[Register]) -> bytes:
        if not isinstance(messages, list) or not all(isinstance(m, Register) for m in messages):
            why = "a node agent registers a list of Register messages"
            return wire.pack([Reply.refused(why)])
        return wire.pack(await self.relay.register(str(node_key), messages))

    async def poll_node(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> bytes:
        if not isinstance(states, dict) or not isinstance(wait_s, int | float):
            return wire.pack({})  # not a node agent's poll: nothing for it
        return wire.pack(await self.relay.poll(str(node_key), states, wait_s))

    async def ack_many(self, acks: list[Ack]) -> bytes:
        listed = acks if isinstance(acks, list) else [acks]
        good = [m for m in listed if isinstance(m, Ack)]
        if len(good) != len(listed):
            return wire.pack([Reply.refused("a node agent acknowledges with Ack messages")])
        return wire.pack(await self.relay.ack(good))

    async def report_many(self, reports: list[tuple[str, TeardownReport]]) -> bytes:
        listed = reports if isinstance(reports, list) else [reports]
        if not all(isinstance(r, tuple) and len(r) == 2 for r in listed):
            return wire.pack([Reply.refused("a node agent reports (process id, report) pairs")])
        return wire.pack(await self.relay.report(listed))

    async def describe(self) -> dict[str, Any]:
        """Its relay's account (the coordinator asks once, to know it is up)."""
        return {**self.relay.describe(), "key": self.key, "pid": os.getpid()}


def start_group_agent(wait_s: float, node_id: str, index: int) -> tuple[str, Any]:
    """A new group agent on ``node_id``; (its key, its handle).

    Called in the coordinator actor, on its own node: the group agent polls it, and is owned
    by it, so it ends with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    coordinator = ray.get_runtime_context().current_actor
    key = f"group-{index}-{uuid.uuid4().hex[:8]}"
    handle = (
        ray.remote(GroupAgent)
        .options(
            num_cpus=0,
            max_concurrency=MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(wait_s, coordinator, key)
    )
    return key, handle
