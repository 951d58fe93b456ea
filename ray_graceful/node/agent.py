"""The node agent: one actor per job on each node that hosts its ranks.

The first rank process of a job to set up on a node starts it - under Ray Train, the run's
callback, as Train creates the workers (``ensure_agent``: named after
the job, its coordinator and the node, ``get_if_exists``, so the node's other processes find it
instead of starting another; pinned to the node; no CPU). It does per node what each process
did alone:

- relays the node's processes to the coordinator (``relay.py``): one registration, one long
  poll, one NVML probe per set of GPUs - when ``node_agent`` is on (``uses_agent``); past
  ``node_group_size`` nodes, through the group agent the coordinator names (``group.py``;
  the choice: ``upstream.py``);
- polls the cloud's metadata service (``cloud_poller.py``), when ``cloud_notices`` is not off;
- sends the coordinator's host watch a heartbeat (``heartbeat.py``), when ``host_watch`` is on.

Its processes still hold their long polls here, on their own node, from their control threads:
an order reaches a rank blocked in a collective exactly as a direct poll does, one local hop
later. The agent is detached from the process that started it: owned by that rank, it would
end with it (Ray ends an actor with its owner), and the node's ranks that tear down after that
one - in an eviction, most of them - would find it gone and report on their own. It leaves once
its coordinator is gone for good (``leave_with.py``; asked of the GCS only while it relays
nobody). A process whose agent is gone (a crash) registers with the coordinator directly and
polls it from then on; the coordinator logs the move (``coordinator/fanout.py``). An agent
serves one job and one coordinator: a registration of another job's process is refused here
and at the coordinator, and a coordinator started again in the same job gets agents of its own.

The agent is not the memory tier's keeper, although both are per node and per job and both
outlive the ranks: the keeper holds the checkpoint in its process's memory, the coordinator
starts it only for the memory tier, and its budget is that memory. The agent runs NVML and HTTP
against the metadata service - code that can hang or crash on a sick host - and must never take
a checkpoint down with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from .. import ray_adapter
from ..config import GracefulConfig
from ..health import HealthProbe, NullProbe, make_probe
from ..leave_with import leave_with_coordinator
from ..protocol import (
    Ack,
    PollAnswer,
    PollState,
    Register,
    Reply,
    TeardownOrder,
    TeardownReport,
)
from .cloud_poller import CloudWatch
from .heartbeat import Heartbeat
from .relay import NodeRelay
from .upstream import TieredUpstream

logger = logging.getLogger(__name__)

AUTO_MIN_WORLD_SIZE = 32  # node_agent='auto': relay through the agent from this group size on
MAX_CONCURRENCY = 10_000  # held polls and calls one agent serves at once


def uses_agent(config: GracefulConfig, world_size: int) -> bool:
    """Whether a process holding ranks of groups of at most ``world_size`` relays through its
    node's agent."""
    if config.node_agent == "off":
        return False
    if config.host_watch:
        return True  # a host cut off from the coordinator orders its ranks out through here
    if config.node_agent == "auto":
        return world_size >= AUTO_MIN_WORLD_SIZE
    return config.node_agent == "on"


def agent_wanted(config: GracefulConfig, world_size: int) -> bool:
    """Whether the node of a rank of a group of ``world_size`` runs an agent: to relay it, or
    for the cloud's notices or the host watch's heartbeat."""
    return uses_agent(config, world_size) or config.cloud_notices != "off" or config.host_watch


def start_agents(config: GracefulConfig, coordinator: Any, nodes: set[str]) -> list[Any]:
    """The agents of ``nodes``, started now (not waited for): before the ranks there set up,
    so that their registration finds the agent up instead of waiting for its process."""
    return [ensure_agent(config, coordinator, node_id) for node_id in sorted(nodes)]


def agent_name(job_id: str, coordinator_id: str, node_id: str) -> str:
    """The agent of ``node_id`` for the coordinator of Ray id ``coordinator_id``, job ``job_id``."""
    return f"ray_graceful_agent-{job_id}-{coordinator_id[:16]}-{node_id[:16]}"


class NodeAgent:
    """The actor (async): the relay's calls, and the cloud poller's thread."""

    def __init__(
        self,
        config: GracefulConfig,
        node_id: str,
        job_id: str,
        coordinator: Any,
        coordinator_id: str,
    ) -> None:
        self.config, self.node_id, self.job_id = config, node_id, job_id
        node_key = f"{node_id[:16]}-{uuid.uuid4().hex[:8]}"  # a new agent: a new key
        self.relay = NodeRelay(
            node_key,
            TieredUpstream(coordinator, node_id),
            config.health_interval_s,
            self._probe_for,
        )
        self.heartbeat = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the actor's, from its first call
        if config.host_watch:  # the coordinator hears this host go silent within about 1 s
            timing = (config.host_heartbeat_s, config.host_suspect_s, config.host_confirm_s)
            self.heartbeat = Heartbeat(coordinator, node_id, *timing, on_cut_off=self._cut_off)
        self.cloud = None
        if config.cloud_notices != "off":
            self.cloud = CloudWatch(config, node_id, coordinator)
        # Busy while it relays: its processes' polls would fail and leave it, were the
        # coordinator gone; the GCS is asked only once nobody is relayed.
        leave_with_coordinator(coordinator_id, "node agent", busy=self.relay.relaying)

    def _cut_off(self, evidence: str) -> None:
        """This host lost the coordinator (``heartbeat.py``): every rank relayed here is
        ordered out, saving nothing - it can prove no committed step, and the coordinator,
        declaring this host lost, has the replicas elsewhere save. From the heartbeat's thread:
        the relay lives on the actor's event loop."""
        if self.loop is None:
            return  # no call came yet: no rank is relayed here
        deadline = time.time() + self.config.teardown_timeout_s

        def order_for(cycle: int) -> TeardownOrder:
            return TeardownOrder(
                self.job_id,
                cycle,
                f"cut-off-{self.node_id[:12]}-{cycle}",
                deadline,
                f"cut off from the coordinator: {evidence}"[:500],
                skip_reason="this host is cut off: its state is no committed step",
                boundary_needed=False,
            )

        self.loop.call_soon_threadsafe(self.relay.order_out, order_for)

    async def leave(self) -> None:
        """End this agent (its coordinator is gone for good): an intended exit."""
        import ray

        ray.actor.exit_actor()

    def _probe_for(self, gpus: tuple[int, ...]) -> HealthProbe:
        try:
            return make_probe(self.config, list(gpus), self.node_id)
        except Exception as exc:  # an explicit health_probe='nvml' without NVML, say
            logger.warning("ray_graceful node agent: health probe unavailable: %s", exc)
            return NullProbe(f"probe failed to start: {exc}", "probe_failed")

    async def register(self, message: Register, gpus: tuple[int, ...] = ()) -> Reply:
        self.loop = asyncio.get_running_loop()
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

    async def report_teardown(self, process_id: str, report: TeardownReport) -> Reply:
        """A process's teardown report, sent up with its node's (the coordinator's own call)."""
        if not isinstance(report, TeardownReport):
            return Reply.refused("a report is a TeardownReport")
        return await self.relay.report(str(process_id), report)

    async def describe(self) -> dict[str, Any]:
        """What ``ray-graceful status`` and the tests read: the relay and the cloud poller."""
        return {
            **self.relay.describe(),
            "node_id": self.node_id,
            "job_id": self.job_id,
            "pid": os.getpid(),
            "cloud": self.cloud.seen() if self.cloud else None,
            "heartbeats": self.heartbeat.beats if self.heartbeat else None,
        }

    async def seen(self) -> dict:
        """The cloud poller's detection and events (``{"cloud": None}`` with it off)."""
        return self.cloud.seen() if self.cloud else {"cloud": None, "events": []}


def ensure_agent(config: GracefulConfig, coordinator: Any, node_id: str | None = None) -> Any:
    """The agent of ``node_id`` (default: this process's node) for this job's coordinator,
    started unless one runs already.

    Detached: it outlives the process that started it, and leaves with its coordinator."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.get_runtime_context()
    node_id, job_id = node_id or ctx.get_node_id(), ctx.get_job_id()
    coordinator_id = ray_adapter.actor_id_of(coordinator)
    return (
        ray.remote(NodeAgent)
        .options(
            name=agent_name(job_id, coordinator_id, node_id),
            namespace=config.coordinator_namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(config, node_id, job_id, coordinator, coordinator_id)
    )
