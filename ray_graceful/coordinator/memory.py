"""The memory tier, on the coordinator's side: keepers, where shards go, the durable copy.

With ``memory_replicas > 0`` the coordinator starts a keeper on every node that registers ranks
(pinned there, owned by the coordinator: it lives as long as the job's coordinator). When a
plan is made, each save assignment names the keepers to hand the shard to - surviving, not
FAULTY nodes (``memory/placement.py``). A cycle whose shards are all held commits in memory
(``memory/commit.py``); the keepers then write the shards to ``checkpoint_dir`` in the
background and the manifest goes last, with today's guarantees, and the outcome's ``durable``
says when it landed. An older memory checkpoint is released once a newer one is durable; the
shards of a cycle that did not commit are released at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import ray_adapter
from ..checkpoint import CheckpointError, ShardRecord, commit
from ..health import FAULTY
from ..memory.commit import MemoryCheckpoint
from ..memory.keeper import Keeper, keeper_name
from ..memory.placement import choose_holders
from ..plan import TerminationPlan

if TYPE_CHECKING:
    from .actor import CoordinatorActor

logger = logging.getLogger(__name__)

KEEPER_CONCURRENCY = 32


class MemoryTierMixin:
    """The memory tier's part of ``CoordinatorActor``."""

    def _ensure_keeper(self: CoordinatorActor, node_id: str) -> None:
        """Start this node's keeper, once (no wait: it is up long before any eviction).

        The coordinator's own node gets one too: it runs no ranks, but it is the node least
        likely to be evicted (the driver's, usually the head).
        """
        if self.config.memory_replicas <= 0 or not node_id or node_id in self.keepers:
            return
        import ray

        own = ray_adapter.current_node_id()
        if own and own not in self.keepers and own != node_id:
            self._ensure_keeper(own)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = keeper_name(self.job_id, self.instance_id, node_id)
        self.keepers[node_id] = (
            ray.remote(Keeper)
            .options(
                name=name,
                namespace=self.config.coordinator_namespace,
                num_cpus=0,
                max_concurrency=KEEPER_CONCURRENCY,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(self.job_id, node_id, self.config.memory_budget_mb << 20)
        )

    def _surviving_keepers(self: CoordinatorActor, plan: TerminationPlan) -> list[str]:
        """Nodes with a keeper that are neither being evicted nor FAULTY in this plan."""
        out = {o.node_id for o in plan.orders if o.evicted or o.health == FAULTY}
        return [node for node in self.keepers if node not in out]

    def _holders_for(
        self: CoordinatorActor, shard: str, saver_node: str, survivors: list[str]
    ) -> tuple[str, ...]:
        nodes = choose_holders(shard, saver_node, survivors, self.config.memory_replicas)
        return tuple(keeper_name(self.job_id, self.instance_id, node) for node in nodes)

    # --- after a cycle concluded ----------------------------------------------------------

    def _after_memory_commit(
        self: CoordinatorActor, cycle_number: int, memory: MemoryCheckpoint | None
    ) -> None:
        """Start the durable copy of a memory commit; release what a failed cycle handed over."""
        if memory is None:
            for keeper in self.keepers.values():
                keeper.release.remote(cycle=cycle_number)
            return
        self.memory_checkpoints[memory.step] = memory
        if self.config.checkpoint_dir is None:
            return  # nowhere durable: it lives in memory only (the outcome says so)
        task = asyncio.get_running_loop().create_task(self._persist(memory))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _persist(self: CoordinatorActor, memory: MemoryCheckpoint) -> None:
        """Keepers write their shards; the manifest goes last; older memory is released."""
        import ray

        root = self.config.checkpoint_dir
        assert root is not None
        try:
            records: list[ShardRecord] = []
            calls = {}
            for key, record in memory.shards.items():
                if record.tier == "disk":
                    records.append(record)
                    continue
                calls[key] = self._persist_one(root, memory.step, key, record.holders)
            for data in await asyncio.gather(*calls.values()):
                records.append(ShardRecord.from_dict(data))
            path = await asyncio.to_thread(
                commit,
                root,
                memory.step,
                list(memory.shards),
                records,
                memory.cycle,
                {"job_id": self.job_id, "tiers": ["memory", "disk"]},
            )
            memory.durable_path, memory.durable_at = os.path.dirname(path), time.time()
            durable = {"path": memory.durable_path, "at": memory.durable_at}
            for older in [s for s in self.memory_checkpoints if s < memory.step]:
                del self.memory_checkpoints[older]
            for keeper in self.keepers.values():
                keeper.release.remote(below_step=memory.step)
        except (CheckpointError, ray.exceptions.RayError, OSError, KeyError) as exc:
            memory.durable_error = f"{type(exc).__name__}: {exc}"
            durable = {"error": memory.durable_error}
            logger.error(
                "ray_graceful coordinator: durable copy of step %s failed: %s", memory.step, exc
            )
        outcome = self.outcomes.get(memory.cycle)
        if outcome is not None:
            outcome.durable = durable
            outcome.committed = memory.describe()
        self.durable_events.setdefault(memory.cycle, asyncio.Event()).set()

    async def _persist_one(
        self: CoordinatorActor, root: str, step: int, key: str, holders: tuple[str, ...]
    ) -> dict[str, Any]:
        """Ask the shard's holders in turn until one has written it."""
        errors = []
        for node in holders:
            keeper = self.keepers.get(node)
            if keeper is None:
                errors.append(f"no keeper on {node[:12]}")
                continue
            try:
                return await keeper.persist.remote(root, step, key)
            except Exception as exc:
                errors.append(f"keeper on {node[:12]}: {type(exc).__name__}: {exc}")
        raise CheckpointError(f"no keeper could write {key}: {'; '.join(errors)}")

    # --- queries ----------------------------------------------------------------------------

    async def memory_checkpoint(self: CoordinatorActor, shard_key: str) -> dict[str, Any] | None:
        """The newest memory checkpoint that holds ``shard_key``: its step, {node: keeper}."""
        for step in sorted(self.memory_checkpoints, reverse=True):
            memory = self.memory_checkpoints[step]
            record = memory.shards.get(shard_key)
            if record is not None and record.tier == "memory":
                return {
                    "step": step,
                    "holders": {
                        node: keeper_name(self.job_id, self.instance_id, node)
                        for node in record.holders
                    },
                }
        return None

    async def wait_durable(
        self: CoordinatorActor, cycle: int, timeout: float
    ) -> dict[str, Any] | None:
        """The outcome's ``durable`` once the background copy of ``cycle`` ended (or None)."""
        event = self.durable_events.setdefault(cycle, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return None
        outcome = self.outcomes.get(cycle)
        return outcome.durable if outcome is not None else None

    async def keeper_stats(self: CoordinatorActor) -> dict[str, Any]:
        """Every keeper's budget, use and shards (the demo and the CLI show them)."""
        out: dict[str, Any] = {}
        for node, keeper in self.keepers.items():
            try:
                out[node] = await asyncio.wait_for(keeper.stats.remote(), timeout=10)
            except Exception as exc:
                out[node] = {"error": repr(exc)}
        return out
