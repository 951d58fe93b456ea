"""The long polls the coordinator holds open, and how an answer finds its way to one.

An order reaches a rank whose training thread is stuck in a collective because the rank's
control thread holds a poll open here, and the order is that poll's answer. A process polls in
one of two ways:

- **directly**: one held poll per process (``hold``), answered with its own ``PollAnswer``;
- **through its node's agent** (``node/relay.py``): one held poll per node (``hold_node``),
  answered with the answers of every process of that node at once - one reply per node.

``answer(process_id, ...)`` routes to whichever the process registered through last: a process
whose agent died registers again directly, and is answered directly from then on. Spares and
standbys hold polls of their own (``hold_spare``), and warm-restart members theirs
(``warm_restarts.py``), through the same ``held`` / ``resolve``. Asyncio only; the actor owns
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..protocol import PollAnswer, PollKind
from .registry import poll_timeout

logger = logging.getLogger(__name__)

MAX_PER_NODE = 4096  # processes one node agent may speak for


@dataclass
class NodeSlot:
    """One node agent's poll: the answers waiting for it, and the poll held, if any."""

    outbox: dict[str, PollAnswer] = field(default_factory=dict)
    future: asyncio.Future | None = None
    last_poll: float = 0.0

    def wake(self) -> None:
        resolve(self.future, None)


def resolve(future: asyncio.Future | None, value: Any) -> None:
    """Answer a held poll, if it is still held."""
    if future is not None and not future.done():
        future.set_result(value)


async def held(table: dict[str, asyncio.Future], key: str, wait_s: float) -> Any | None:
    """Hold a poll under ``table[key]`` until it is answered (its value) or ``wait_s`` ends
    (None); a newer poll under the same key replaces it in the table."""
    future = asyncio.get_running_loop().create_future()
    table[key] = future
    try:
        return await asyncio.wait_for(future, timeout=poll_timeout(wait_s))
    except asyncio.TimeoutError:
        return None
    finally:
        if table.get(key) is future:
            del table[key]


class Fanout:
    """Every held poll: per process, per node agent, per spare."""

    def __init__(self) -> None:
        self.direct: dict[str, asyncio.Future] = {}  # process id -> its held poll
        self.nodes: dict[str, NodeSlot] = {}  # node key -> its agent's poll
        self.served_by: dict[str, str] = {}  # process id -> the node key it polls through
        self.spares: dict[str, asyncio.Future] = {}
        self.calls = 0  # polls that reached the coordinator (direct + per node)

    # --- who polls how ---------------------------------------------------------------------

    def through_node(self, process_id: str, node_key: str) -> None:
        self.served_by[process_id] = node_key
        self.nodes.setdefault(node_key, NodeSlot())

    def directly(self, process_id: str) -> None:
        node_key = self.served_by.pop(process_id, None)
        if node_key is not None:
            logger.warning(
                "ray_graceful coordinator: process %s polls directly now, no longer through "
                "node agent %s (the agent is gone)",
                process_id,
                node_key,
            )

    def forget_except(self, processes: set[str]) -> None:
        """Drop what belongs to processes no longer registered, and nodes serving none."""
        self.served_by = {p: n for p, n in self.served_by.items() if p in processes}
        serving = set(self.served_by.values())
        for node_key in [n for n in self.nodes if n not in serving]:
            slot = self.nodes.pop(node_key)
            slot.wake()

    # --- answers ---------------------------------------------------------------------------

    def answer(self, process_id: str, answer: PollAnswer) -> None:
        """Hand ``answer`` to the process's held poll: its own, or its node's."""
        node_key = self.served_by.get(process_id)
        if node_key is not None:
            slot = self.nodes.setdefault(node_key, NodeSlot())
            slot.outbox[process_id] = answer
            slot.wake()  # the node's reply goes out once, with every answer of this step
            return
        resolve(self.direct.get(process_id), answer)

    async def hold(self, process_id: str, wait_s: float) -> PollAnswer:
        """A process's own poll, until answered or ``wait_s`` ends (IDLE)."""
        self.calls += 1
        answer = await held(self.direct, process_id, wait_s)
        return PollAnswer(PollKind.IDLE) if answer is None else answer

    async def hold_node(
        self, node_key: str, now: dict[str, PollAnswer], wait_s: float
    ) -> dict[str, PollAnswer]:
        """A node agent's poll: at once if any answer waits, else until one comes or
        ``wait_s`` ends (no answers: every process polls again, IDLE)."""
        self.calls += 1
        slot = self.nodes.setdefault(node_key, NodeSlot())
        slot.last_poll = time.time()
        slot.outbox.update(now)
        if slot.outbox:
            answers, slot.outbox = slot.outbox, {}
            return answers
        slot.wake()  # an earlier poll of the same agent, still held: this one replaces it
        mine = slot.future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(mine, timeout=poll_timeout(wait_s))
        except asyncio.TimeoutError:
            pass
        if slot.future is not mine:
            return {}  # replaced: the newer poll takes the answers
        slot.future = None
        answers, slot.outbox = slot.outbox, {}
        return answers

    async def hold_spare(self, spare_id: str, wait_s: float) -> None:
        """A spare's or standby's poll, until told (its word is then in the spare pool)."""
        await held(self.spares, spare_id, wait_s)

    def tell_spare(self, spare_id: str) -> None:
        resolve(self.spares.get(spare_id), None)

    # --- reading ---------------------------------------------------------------------------

    def pending(self) -> int:
        """Processes whose poll is held now (a node's poll holds all of its processes)."""
        held_nodes = {n for n, s in self.nodes.items() if s.future and not s.future.done()}
        through = sum(1 for n in self.served_by.values() if n in held_nodes)
        return through + sum(1 for f in self.direct.values() if not f.done())

    def describe(self) -> dict[str, Any]:
        """Each node agent serving processes: how many, and when it last polled."""
        now = time.time()
        counts: dict[str, int] = {}
        for node_key in self.served_by.values():
            counts[node_key] = counts.get(node_key, 0) + 1
        return {
            node_key: {
                "processes": counts.get(node_key, 0),
                "last_poll_s_ago": round(now - slot.last_poll, 1) if slot.last_poll else None,
            }
            for node_key, slot in self.nodes.items()
            if counts.get(node_key)
        }
