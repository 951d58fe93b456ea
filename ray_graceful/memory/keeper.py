"""The keeper: one actor per node that holds emergency-checkpoint shards in memory.

Why an actor of its own: a Ray object lives on the node that created it and dies with its
owner. A saver's ``ray.put`` is owned by the saver, whose process is about to exit. So the
keeper takes the shard (``hold``: a ``ray.get`` - zero-copy on its own node, a transfer from
another) and puts it again, as its own object in its own node's object store: from then on the
shard lives as long as the keeper, whatever happens to the saver and its node. The saver is told
"held" only then.

The coordinator starts one keeper per node that runs ranks (pinned to that node) and decides
which keepers hold which shard (``placement.py``). A keeper is detached from the coordinator's
process, so that what it holds outlives a coordinator crash: Ray restarts the coordinator (same
actor, same id), which finds its keepers again by name (``find_keepers``) and reads back what
they hold. It is not detached from the job: it leaves once its coordinator is gone for good
(``leave_with.py``: DEAD in the GCS - the job ended, ``shutdown``, restarts used up).

A keeper refuses what does not fit its budget - the saver then saves to disk and says so -
writes what it holds to ``checkpoint_dir`` when told (``persist``: atomic, checksummed, exactly
as a rank's own save - and only if the bytes are still those it was handed: the CRC of the tree
taken when it was held is checked once the shard is written), hands shards to a restarted
rank (``fetch``), and forgets a step once a newer one is committed (``release``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import CheckpointError, ShardRecord, save_state_dict, write_shard
from ..config import GracefulConfig
from ..dcp import is_shard_files, write_shard_files
from ..leave_with import leave_with_coordinator
from .tree import from_tree, tree_bytes, tree_checksum

logger = logging.getLogger(__name__)

KEEPER_PREFIX = "ray_graceful_keeper"


def keeper_name(job_id: str, coordinator_id: str, node_id: str) -> str:
    """The keeper of ``node_id`` started by coordinator ``coordinator_id`` of job ``job_id``.

    Named, so savers and restarted ranks reach it by the name their order (or the coordinator)
    gives them, and a restarted coordinator finds it again. The coordinator's id is its Ray
    actor id, which a restart keeps and a second coordinator of the same job (``trainer.fit()``
    twice) does not share: a leaving keeper of the first is never taken for the second's.
    """
    return f"{KEEPER_PREFIX}-{job_id}-{coordinator_id}-{node_id}"


@dataclass(frozen=True)
class ShardKept:
    """A keeper's answer to ``hold``: the shard is held on ``node_id`` (``again``: it already
    was, a second delivery or a backup after its saver), or refused with the ``reason``."""

    accepted: bool
    node_id: str
    nbytes: int = 0
    again: bool = False
    reason: str = ""


@dataclass
class Held:
    """One shard a keeper holds: its own object in its node's store, and what it is."""

    shard_key: str
    step: int
    nbytes: int
    ref: Any  # the keeper's own ObjectRef
    held_at: float
    cycles: set[int] = field(default_factory=set)  # every cycle that handed it over
    group: str = ""
    rank: int = -1
    dcp_chunks: dict[str, Any] | None = None  # a dcp_saver's shard: its chunks (dcp.py)
    checksum: Future[int] | None = None  # tree_checksum of what was handed, taken after "held"


class HeldCopyChanged(CheckpointError):
    """A held shard's bytes are no longer the ones handed to the keeper: never made durable."""


class Keeper:
    """The keeper's implementation (a threaded actor: holds, fetches and persists overlap)."""

    def __init__(
        self, job_id: str, node_id: str, budget_bytes: int, coordinator_id: str = ""
    ) -> None:
        self.job_id = job_id
        self.node_id = node_id
        self.budget_bytes = budget_bytes
        self.held: dict[tuple[int, str], Held] = {}
        self.reserved = 0  # bytes promised to holds still transferring
        self.lock = threading.Lock()
        # The held copy's checksum, taken behind the "held" answer (2 GB/s: 0.25 s at 512 MB,
        # kept off the saver's path); persist waits for it.
        self.checksums = ThreadPoolExecutor(1, thread_name_prefix="ray_graceful-keeper-crc")
        import ray

        self.name = ray.get_runtime_context().get_actor_name() or ""  # in stats: shutdown() uses it
        if coordinator_id:
            leave_with_coordinator(coordinator_id, "keeper")

    def leave(self) -> None:
        """End this keeper (its coordinator is gone for good): an intended exit."""
        import ray

        ray.actor.exit_actor()

    def used(self) -> int:
        return sum(h.nbytes for h in self.held.values())

    def hold(
        self,
        cycle: int,
        step: int,
        shard_key: str,
        ref_in_list: list[Any],
        nbytes: int,
        group: str = "",
        rank: int = -1,
        timeout_s: float = 60.0,
        dcp_chunks: dict[str, Any] | None = None,
    ) -> ShardKept:
        """Take a copy of the shard in ``ref_in_list`` (a list, so Ray does not resolve it).

        If the saver dies mid-transfer the ``ray.get`` fails, nothing is held, and the error
        goes back to nobody: a shard is held whole or not at all.
        """
        import ray

        with self.lock:
            existing = self.held.get((step, shard_key))
            if existing is not None:  # a second delivery, a backup after its saver, a later cycle
                existing.cycles.add(cycle)  # relies on it too: released only when none does
                return ShardKept(True, self.node_id, existing.nbytes, again=True)
            if self.used() + self.reserved + nbytes > self.budget_bytes:
                return ShardKept(
                    False,
                    self.node_id,
                    reason=f"keeper on node {self.node_id[:12]} is over its budget: holds "
                    f"{self.used() >> 20} MiB of {self.budget_bytes >> 20} MiB "
                    f"(memory_budget_mb), this shard needs {nbytes >> 20} MiB",
                )
            self.reserved += nbytes
        try:
            value = ray.get(ref_in_list[0], timeout=timeout_s)
            measured = tree_bytes(value)  # what it holds, not what the sender said
            with self.lock:
                over = self.used() + self.reserved - nbytes + measured > self.budget_bytes
            if over:
                return ShardKept(
                    False,
                    self.node_id,
                    reason=f"keeper on node {self.node_id[:12]} is over its budget: the shard "
                    f"holds {measured >> 20} MiB (announced as {nbytes >> 20} MiB); it holds "
                    f"{self.used() >> 20} MiB of {self.budget_bytes >> 20} MiB (memory_budget_mb)",
                )
            own = ray.put(value)  # owned by the keeper: outlives the saver and its node
            del value
        finally:
            with self.lock:
                self.reserved -= nbytes
        checksum = self.checksums.submit(lambda: tree_checksum(ray.get(own)))
        with self.lock:
            self.held[(step, shard_key)] = Held(
                shard_key, step, measured, own, time.time(), {cycle}, group, rank, dcp_chunks,
                checksum,
            )  # fmt: skip
        return ShardKept(True, self.node_id, measured)

    def fetch(self, step: int, shard_key: str) -> list[Any] | None:
        """The shard's ObjectRef inside a list, so Ray passes it on unresolved.

        A ``ray.get`` of it on this node copies nothing.
        """
        held = self.held.get((step, shard_key))
        return None if held is None else [held.ref]

    def persist(self, root: str, step: int, shard_key: str) -> dict[str, Any]:
        """Write a held shard to ``root`` as a rank's own save would (atomic, checksummed).

        The bytes are read in place (no copy) and proven, once written, to be the ones held -
        a change before or during the write shows there: ``HeldCopyChanged``, and nothing is
        renamed into place."""
        import ray

        held = self.held.get((step, shard_key))
        if held is None:
            raise KeyError(f"keeper on node {self.node_id[:12]} holds no {shard_key} at {step}")
        tree = ray.get(held.ref)
        expected = held.checksum.result() if held.checksum is not None else tree_checksum(tree)
        state = from_tree(tree, copy=False)

        def write(path: str) -> tuple[int, int] | None:
            if is_shard_files(state["state"]):  # a dcp_saver's files: the directory it writes
                write_shard_files(state["state"], path)
                return None
            return save_state_dict(state, path)

        def save(path: str, _step: int) -> tuple[int, int] | None:
            written = write(path)
            now = tree_checksum(tree)
            if now != expected:
                raise HeldCopyChanged(
                    f"keeper on node {self.node_id[:12]}: shard {shard_key} of step {step} "
                    f"changed since it was held (CRC32 {now:#010x} after the write, "
                    f"{expected:#010x} when held); not written - a committed step never holds "
                    "other bytes"
                )
            return written

        record: ShardRecord = write_shard(
            root,
            step,
            shard_key,
            save,
            group=held.group,
            rank=held.rank,
        )
        return record.to_dict()

    def release(self, below_step: int | None = None, cycle: int | None = None) -> int:
        """Forget every shard of a step below ``below_step``, and what only ``cycle`` relied
        on (a cycle that did not commit); bytes freed. A shard a later cycle handed over again
        at the same step (the group evicted again before it trained) stays for that cycle."""
        with self.lock:
            gone = []
            for key, h in self.held.items():
                if cycle is not None:
                    h.cycles.discard(cycle)
                if (below_step is not None and h.step < below_step) or not h.cycles:
                    gone.append(key)
            freed = sum(self.held.pop(key).nbytes for key in gone)
        return freed

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used(),
            "reserved_bytes": self.reserved,  # promised to holds still transferring
            "shards": sorted(
                (
                    {
                        "step": h.step,
                        "shard": h.shard_key,
                        "bytes": h.nbytes,
                        "cycle": max(h.cycles),  # the newest cycle that relies on it
                        "cycles": sorted(h.cycles),
                        "group": h.group,
                        "rank": h.rank,
                        **({"dcp_chunks": h.dcp_chunks} if h.dcp_chunks is not None else {}),
                    }
                    for h in self.held.values()
                ),
                key=lambda d: (d["step"], d["shard"]),
            ),
        }

    def ping(self) -> str:
        return "ok"


class RemoteKeeper:
    """A keeper as the coordinator's memory tier sees it: awaitable calls on its actor.

    The tier (``coordinator/memory.py``) is written against this shape only, so its unit tests
    give it fake keepers; this one is the real actor, started by ``start_keeper``.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def hold(self, *args: Any) -> ShardKept:
        return await self.handle.hold.remote(*args)

    async def fetch(self, step: int, shard_key: str) -> list[Any] | None:
        return await self.handle.fetch.remote(step, shard_key)

    async def persist(self, root: str, step: int, shard_key: str) -> dict[str, Any]:
        return await self.handle.persist.remote(root, step, shard_key)

    def release(self, below_step: int | None = None, cycle: int | None = None) -> None:
        self.handle.release.remote(below_step=below_step, cycle=cycle)  # no wait: best effort

    async def ping(self) -> str:
        return await self.handle.ping.remote()

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()


KEEPER_CONCURRENCY = 32


def start_keeper(
    name: str, namespace: str, job_id: str, node_id: str, budget: int, coordinator_id: str
) -> RemoteKeeper:
    """Start the keeper ``name`` pinned to ``node_id`` (no wait: it is up long before any
    eviction), or reach it if it runs already (a restarted coordinator's). Detached, so a
    coordinator crash leaves it holding; it leaves when the coordinator is gone for good."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    handle = (
        ray.remote(Keeper)
        .options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=KEEPER_CONCURRENCY,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(job_id, node_id, budget, coordinator_id)
    )
    return RemoteKeeper(handle)


def keepers_for(
    config: GracefulConfig, job_id: str, coordinator_id: str
) -> Callable[[str, str], RemoteKeeper]:
    """The coordinator's keeper factory: ``(name, node_id) -> RemoteKeeper`` for this job."""
    namespace, budget = config.coordinator_namespace, config.memory_budget_mb << 20
    return lambda name, node_id: start_keeper(
        name, namespace, job_id, node_id, budget, coordinator_id
    )


def find_keepers(namespace: str, job_id: str, coordinator_id: str) -> dict[str, RemoteKeeper]:
    """The keepers a coordinator of this id started and that still run, by node: what a
    restarted coordinator adopts (their names say whose they are and where)."""
    import ray

    prefix = keeper_name(job_id, coordinator_id, "")
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace or not entry["name"].startswith(prefix):
            continue
        try:
            handle = ray.get_actor(entry["name"], namespace=namespace)
        except ValueError:  # left between the listing and now
            continue
        found[entry["name"][len(prefix) :]] = RemoteKeeper(handle)
    return found
