"""Which way each node agent polls: the coordinator itself, or one of its group agents.

The coordinator answers the first ``node_group_size`` node agents itself; each further one is
placed in a group agent of up to ``node_group_size`` nodes (``node/group.py``), started here on
demand. A job of up to 64 nodes (the default) has no group agent and no extra hop; at 2,048
nodes the coordinator answers 64 node agents and 31 groups instead of 2,048 node agents.

A node keeps its place while it hosts ranks of the job. Places of nodes that left are given to
new nodes once every place is taken (a node's place is kept for ``JOIN_GRACE_S`` after it
joined, so a node whose processes are still registering keeps it), so a long job whose nodes
are replaced does not start group agents without end. A node agent that found its group agent
dead names it when it joins again, and the group is started afresh (its nodes all come back
to the new one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..node.upstream import GROUP_READY_S

logger = logging.getLogger(__name__)

MAX_GROUPS = 256  # past 64 + 256 x 64 = 16,448 nodes (the default), node agents poll directly
JOIN_GRACE_S = 120.0  # a node's place is kept this long after it joined, ranks or not

GroupStarter = Callable[[int], tuple[str, Any]]  # group index -> (its key, its handle)


class GroupAgents:
    """The places of the job's node agents: polled directly, or through which group."""

    def __init__(
        self,
        size: int,
        start: GroupStarter,
        live_nodes: Callable[[], set[str]],
        grace_s: float = JOIN_GRACE_S,
    ) -> None:
        self.size, self.start, self.live_nodes, self.grace_s = size, start, live_nodes, grace_s
        self.direct: dict[str, float] = {}  # node id -> when it joined: it polls us itself
        self.placed: dict[str, tuple[int, float]] = {}  # node id -> (its group, when it joined)
        self.groups: list[tuple[str, Any]] = []  # by index: (key, handle)
        self.answered: set[str] = set()  # group agents known to be up

    def join(self, node_id: str, gone: str = "") -> tuple[str, Any] | None:
        """The group agent ``node_id``'s agent polls through (key, handle); None: us."""
        if self.size <= 0:
            return None
        if gone:
            self._replace(gone)
        if node_id in self.direct:
            return None
        if node_id in self.placed:
            return self.groups[self.placed[node_id][0]]
        if len(self.direct) >= self.size and self._full():
            self._forget_departed()
        if len(self.direct) < self.size:
            self.direct[node_id] = time.monotonic()
            return None
        counts = Counter(index for index, _ in self.placed.values())
        index = next((i for i in range(len(self.groups)) if counts[i] < self.size), None)
        if index is None and len(self.groups) >= MAX_GROUPS:
            return None  # more nodes than the tree was sized for: they poll us, as before
        if index is None:
            index = len(self.groups)
            self.groups.append(self.start(index))
            logger.info("ray_graceful coordinator: group agent %s started", self.groups[-1][0])
        self.placed[node_id] = (index, time.monotonic())
        return self.groups[index]

    async def ready(self, group: tuple[str, Any] | None) -> tuple[str, Any] | None:
        """``group`` once its agent answers: a node agent's first call must not wait out a
        process start (about 2 s, and Ray starts as many at once as the node has CPUs); None
        (the node polls us) if it does not answer within ``GROUP_READY_S``."""
        if group is None:
            return None
        key, handle = group
        if key not in self.answered:
            try:
                await asyncio.wait_for(handle.describe.remote(), GROUP_READY_S)
            except Exception as exc:
                logger.warning("ray_graceful coordinator: group agent %s not ready: %r", key, exc)
                return None
            self.answered.add(key)
        return group

    def describe(self) -> dict[str, Any]:
        counts = Counter(index for index, _ in self.placed.values())
        return {
            "direct_nodes": len(self.direct),
            "groups": {key: counts[i] for i, (key, _) in enumerate(self.groups)},
        }

    def _full(self) -> bool:
        return len(self.placed) >= self.size * len(self.groups)

    def _forget_departed(self) -> None:
        live, now = self.live_nodes(), time.monotonic()

        def keep(node_id: str, joined: float) -> bool:
            return node_id in live or now - joined < self.grace_s

        self.direct = {n: t for n, t in self.direct.items() if keep(n, t)}
        self.placed = {n: (g, t) for n, (g, t) in self.placed.items() if keep(n, t)}

    def _replace(self, gone: str) -> None:
        for index, (key, _) in enumerate(self.groups):
            if key == gone:
                self.groups[index] = self.start(index)
                logger.warning(
                    "ray_graceful coordinator: group agent %s is gone; %s replaces it",
                    gone,
                    self.groups[index][0],
                )
