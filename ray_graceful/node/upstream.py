"""The way up from a relay, over Ray: the coordinator actor, or a group agent in front of it.

``RayUpstream`` calls one actor that offers the coordinator's node-facing calls - the
coordinator itself, or a group agent (``group.py``), which offers the same - and turns Ray's
errors into ``Unreachable``. ``TieredUpstream`` is a node agent's choice between the two: it
asks the coordinator once which way to go (``join_group``), and asks again when its group
agent died.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..protocol import Ack, PollAnswer, PollState, Register, Reply, TeardownReport, wire
from .relay import Unreachable

logger = logging.getLogger(__name__)

UPSTREAM_GRACE_S = 30.0  # beyond a poll's wait, how long a call to the coordinator may take
GROUP_READY_S = 60.0  # how long the coordinator waits for a new group agent to answer


class RayUpstream:
    """The coordinator actor, as ``NodeRelay`` calls it: Ray's errors become ``Unreachable``."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    async def _call(self, ref: Any, timeout: float) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, timeout=timeout)
        except ray.exceptions.ActorUnavailableError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}"[:300], restarting=True) from None
        except ray.exceptions.ActorDiedError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}"[:300], restarting=False) from None

    async def join_group(self, node_id: str, gone: str) -> tuple[str, Any] | None:
        """The group agent to go through (its key and handle), or None: the coordinator."""
        ref = self.coordinator.join_group.remote(node_id, gone)
        return await self._call(ref, GROUP_READY_S + UPSTREAM_GRACE_S)

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]:
        ref = self.coordinator.register_node.remote(node_key, messages)
        return wire.unpack(await self._call(ref, UPSTREAM_GRACE_S), list, "register_node")

    async def poll(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> dict[str, PollAnswer]:
        ref = self.coordinator.poll_node.remote(node_key, states, wait_s)
        return wire.unpack(await self._call(ref, wait_s + UPSTREAM_GRACE_S), dict, "poll_node")

    async def ack(self, acks: list[Ack]) -> list[Reply]:
        ref = self.coordinator.ack_many.remote(acks)
        return wire.unpack(await self._call(ref, UPSTREAM_GRACE_S), list, "ack_many")

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]:
        ref = self.coordinator.report_many.remote(reports)
        return wire.unpack(await self._call(ref, UPSTREAM_GRACE_S), list, "report_many")


class TieredUpstream:
    """A node agent's way up: the group agent the coordinator names for this node, or the
    coordinator itself (``node/group.py``).

    Asked once, at the node's first registration. A group agent that died (its calls raise
    ``Unreachable``, not restarting) is given up: the coordinator is asked again - naming the
    dead group, which it replaces - and the error goes on as ``restarting``, so each process
    registers again, along the new way."""

    def __init__(self, coordinator: Any, node_id: str) -> None:
        self.node_id = node_id
        self.coordinator = RayUpstream(coordinator)
        self.group: RayUpstream | None = None
        self.group_key = ""
        self.gone = ""  # the key of a group agent that died, for the coordinator to replace
        self._asked = False
        self._lock = asyncio.Lock()

    async def _route(self) -> RayUpstream:
        async with self._lock:
            if not self._asked:
                self._asked = True
                try:
                    joined = await self.coordinator.join_group(self.node_id, self.gone)
                except Unreachable as exc:  # Ray restarts it, or it is gone: asked again later
                    self._asked = not exc.restarting
                    return self.coordinator
                except Exception as exc:  # a broken answer: this node polls it directly
                    logger.warning("ray_graceful node agent: no group agent (%r)", exc)
                    joined = None
                if isinstance(joined, tuple) and len(joined) == 2:
                    self.group_key, group = joined
                    self.group = RayUpstream(group)
        return self.group or self.coordinator

    async def _through(self, call: Any) -> Any:
        route = await self._route()
        try:
            return await call(route)
        except Unreachable as exc:
            if route is not self.group or exc.restarting:
                raise
            logger.warning(
                "ray_graceful node agent: group agent %s is gone (%s); asking the coordinator "
                "for another",
                self.group_key,
                exc,
            )
            self.gone, self.group, self._asked = self.group_key, None, False
            why = f"the node's group agent {self.group_key} is gone: registering again"
            raise Unreachable(why, restarting=True) from None

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]:
        return await self._through(lambda up: up.register(node_key, messages))

    async def poll(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> dict[str, PollAnswer]:
        return await self._through(lambda up: up.poll(node_key, states, wait_s))

    async def ack(self, acks: list[Ack]) -> list[Reply]:
        return await self._through(lambda up: up.ack(acks))

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]:
        return await self._through(lambda up: up.report(reports))
