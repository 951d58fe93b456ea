"""The node agent: one actor per job on each node that hosts its ranks.

The first rank process of a job to set up on a node starts it (``ensure_agent``: named after
the job and the node, ``get_if_exists``, so the node's other processes find it instead of
starting another; pinned to the node; no CPU). It does per node what each process did alone:

- relays the node's processes to the coordinator (``relay.py``): one registration, one long
  poll, one NVML probe per set of GPUs - when ``node_agent`` is on (``uses_agent``); past
  ``node_group_size`` nodes, through the group agent the coordinator names (``group.py``,
  ``TieredUpstream``);
- polls the cloud's metadata service (``cloud_poller.py``), when ``cloud_notices`` is not off.

Its processes still hold their long polls here, on their own node, from their control threads:
an order reaches a rank blocked in a collective exactly as a direct poll does, one local hop
later. The agent lives as long as the process that started it (Ray ends an actor with its
owner). A process whose agent is gone registers with the coordinator directly and polls it
from then on; the coordinator logs the move (``coordinator/fanout.py``). An agent serves one
job: a registration of another job's process is refused here and at the coordinator.

The agent is not the memory tier's keeper, although both are per node and per job: the keeper
holds the checkpoint in its process's memory and must outlive the ranks, the coordinator
starts it only for the memory tier, and its budget is that memory. The agent runs NVML and HTTP
against the metadata service - code that can hang or crash on a sick host - and must never take
a checkpoint down with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

from ..config import GracefulConfig
from ..health import HealthProbe, NullProbe, make_probe
from ..protocol import Ack, PollAnswer, PollState, RankSpec, Register, Reply, wire
from .cloud_poller import CloudWatch
from .relay import NodeRelay, Unreachable

logger = logging.getLogger(__name__)

AUTO_MIN_WORLD_SIZE = 32  # node_agent='auto': relay through the agent from this group size on
MAX_CONCURRENCY = 10_000  # held polls and calls one agent serves at once
UPSTREAM_GRACE_S = 30.0  # beyond a poll's wait, how long a call to the coordinator may take
GROUP_READY_S = 60.0  # how long the coordinator waits for a new group agent to answer


def uses_agent(config: GracefulConfig, ranks: tuple[RankSpec, ...]) -> bool:
    """Whether a process holding ``ranks`` relays through its node's agent."""
    if config.node_agent == "auto":
        return any(spec.world_size >= AUTO_MIN_WORLD_SIZE for spec in ranks)
    return config.node_agent == "on"


def agent_name(job_id: str, node_id: str) -> str:
    return f"ray_graceful_agent-{job_id}-{node_id[:16]}"


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


class NodeAgent:
    """The actor (async): the relay's calls, and the cloud poller's thread."""

    def __init__(self, config: GracefulConfig, node_id: str, job_id: str, coordinator: Any) -> None:
        self.config, self.node_id, self.job_id = config, node_id, job_id
        node_key = f"{node_id[:16]}-{uuid.uuid4().hex[:8]}"  # a new agent: a new key
        self.relay = NodeRelay(
            node_key,
            TieredUpstream(coordinator, node_id),
            config.health_interval_s,
            self._probe_for,
        )
        self.cloud = None
        if config.cloud_notices != "off":
            self.cloud = CloudWatch(config, node_id, coordinator)

    def _probe_for(self, gpus: tuple[int, ...]) -> HealthProbe:
        try:
            return make_probe(self.config, list(gpus), self.node_id)
        except Exception as exc:  # an explicit health_probe='nvml' without NVML, say
            logger.warning("ray_graceful node agent: health probe unavailable: %s", exc)
            return NullProbe(f"probe failed to start: {exc}", "probe_failed")

    async def register(self, message: Register, gpus: tuple[int, ...] = ()) -> Reply:
        job_id = getattr(message, "job_id", None)
        if job_id != self.job_id:
            return Reply.refused(
                f"this node agent serves job {self.job_id}, not job {job_id!r}: each job "
                "starts its own"
            )
        if not isinstance(gpus, tuple) or not all(isinstance(g, int) for g in gpus):
            return Reply.refused("gpus must be a tuple of GPU indices")
        return await self.relay.register(message, gpus)

    async def poll(
        self, process_id: str, cycle: int, state: PollState, wait_s: float
    ) -> PollAnswer:
        return await self.relay.poll(process_id, cycle, state, wait_s)

    async def ack(self, message: Ack) -> Reply:
        return await self.relay.ack(message)

    async def describe(self) -> dict[str, Any]:
        """What ``ray-graceful status`` and the tests read: the relay and the cloud poller."""
        return {
            **self.relay.describe(),
            "node_id": self.node_id,
            "job_id": self.job_id,
            "pid": os.getpid(),
            "cloud": self.cloud.seen() if self.cloud else None,
        }

    async def seen(self) -> dict:
        """The cloud poller's detection and events (``{"cloud": None}`` with it off)."""
        return self.cloud.seen() if self.cloud else {"cloud": None, "events": []}


def ensure_agent(config: GracefulConfig, coordinator: Any) -> Any:
    """This node's agent for this job, started unless one runs already.

    The caller keeps the handle: Ray ends an actor once no handle to it is left."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.get_runtime_context()
    node_id, job_id = ctx.get_node_id(), ctx.get_job_id()
    return (
        ray.remote(NodeAgent)
        .options(
            name=agent_name(job_id, node_id),
            namespace=config.coordinator_namespace,
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(config, node_id, job_id, coordinator)
    )
