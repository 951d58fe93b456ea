"""The coordinator's calls for node and group agents: a node's processes at once.

A node agent (``node/relay.py``) registers its node's processes in one call, holds one long
poll for all of them, and sends their acknowledgements and their teardown reports gathered; a
group agent (``node/group.py``) makes the same calls for the processes of many nodes. Every
reply is packed (``protocol/wire.py``): one pickle, which Ray passes through untouched. Each
message inside is stepped through the cycle machine exactly as the same message sent alone,
so a process cannot tell which way it came; a malformed one is refused one by one.

A part of ``CoordinatorActor`` (``actor.py``), composed in: the actor's methods of the same
names hand the calls on, with what they use given here at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..metrics import NODE_AGENT_POLLS
from ..notices import short
from ..protocol import Ack, PollState, Register, TeardownReport, wire
from . import events as ev
from .fanout import MAX_PER_NODE, Fanout
from .groups import GroupAgents
from .outcomes import OutcomeBoard

MAX_REPORTS = 65_536  # reports one call may carry: a group agent's, every rank of its nodes


class NodeFacingCalls:
    """``join_group``, ``register_node``, ``poll_node``, ``ack_many``, ``report_many``."""

    def __init__(
        self,
        fanout: Fanout,
        groups: GroupAgents,
        outcomes: OutcomeBoard,
        take: Callable[[ev.Event], Any],
        wake: Callable[[], None],
    ) -> None:
        self.fanout, self.groups, self.outcomes = fanout, groups, outcomes
        self._take, self._wake = take, wake  # step the machine; start the actor's watchers
        self.reports_relayed = 0  # reports that came gathered (the fan-out harness reads it)
        self.report_calls = 0  # the calls they came in

    async def join_group(self, node_id: str, gone: str = "") -> tuple[str, Any] | None:
        """A node agent asks which way to poll: a group agent (key, handle) once it answers,
        or None: here (also when its group agent did not start in time)."""
        return await self.groups.ready(self.groups.join(str(node_id), str(gone)))

    async def register_node(self, node_key: str, messages: list[Register]) -> bytes:
        """A node agent registers the processes of its node together: one reply each."""
        self._wake()
        if not isinstance(messages, list) or len(messages) > MAX_PER_NODE:
            why = f"a node registers a list of at most {MAX_PER_NODE} Register messages"
            return wire.pack([self._take(ev.Malformed({"node": short(node_key)}, why))])
        why = "malformed registration: "
        replies = [self._take(ev.admitted(m, Register, "register", why)) for m in messages]
        for message, reply in zip(messages, replies, strict=True):
            if reply.accepted:
                self.fanout.through_node(message.process_id, str(node_key))
        return wire.pack(replies)

    async def poll_node(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> bytes:
        """A node agent's one long poll: every process's state in, every answer out at once."""
        self._wake()
        self.outcomes.count(NODE_AGENT_POLLS)
        if not isinstance(states, dict) or len(states) > MAX_PER_NODE:
            why = f"a node polls with a mapping of at most {MAX_PER_NODE} process states"
            self._take(ev.Malformed({"node": short(node_key)}, why))
            return wire.pack({})
        now = {}
        for process_id, told in states.items():
            cycle, state = told if isinstance(told, tuple) and len(told) == 2 else (None, None)
            answer = self._take(ev.Polled(process_id, cycle, state))
            if answer is not None:
                now[process_id] = answer
        return wire.pack(await self.fanout.hold_node(str(node_key), now, wait_s))

    async def ack_many(self, acks: list[Ack]) -> bytes:
        """A node agent's acknowledgements, gathered (malformed ones are refused one by one)."""
        listed = acks if isinstance(acks, list) else [acks]
        return wire.pack([self._take(ev.admitted(m, Ack, "ack")) for m in listed])

    async def report_many(self, reports: list[tuple[str, TeardownReport]]) -> bytes:
        """Teardown reports gathered by a node or group agent, as ``(process id, report)``:
        one reply each. At 16,384 ranks, one call per rank kept the cycle from concluding for
        25 s after the reports were sent; gathered, 2.5 s with real-length reports
        (docs/benchmarks.md)."""
        if not isinstance(reports, list) or len(reports) > MAX_REPORTS:
            why = f"reports come as a list of at most {MAX_REPORTS} (process id, report) pairs"
            return wire.pack([self._take(ev.Malformed({"reports": short(reports)}, why))])
        self.reports_relayed += len(reports)
        self.report_calls += 1
        pairs = [r if isinstance(r, tuple) and len(r) == 2 else ("", r) for r in reports]
        return wire.pack([self._take(ev.ReportIn(str(pid), report)) for pid, report in pairs])
