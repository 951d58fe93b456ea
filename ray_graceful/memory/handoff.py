"""The worker's side of the memory tier: hand a shard to keepers, and load one back.

A save is ``to_tree`` (tensors as numpy bytes, no copy on CPU), one ``ray.put`` (one copy, into
this node's object store) and a ``hold`` on each chosen keeper, in parallel; it counts as done
only when every keeper answered "held" - each has its own copy by then, so this process may
exit. What it held is exactly what the default saver writes to disk: ``{"step", "state"}``.

A restarted rank loads with ``load_shard``: the keeper on its own node if it holds the shard
(one copy, out of the keeper's object), else a peer keeper (one transfer, one copy), else the
committed checkpoint on disk - and the caller gets the same ``{"step", "state"}`` whichever it
was, in memory of its own: nothing it is handed aliases what a keeper holds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ..checkpoint import (
    ShardRecord,
    latest_committed,
    load_committed_shard,
    shard_file_name,
)
from ..dcp import chunk_summary, is_shard_files
from ..place import LoadedFrom, Place
from .tree import from_tree, to_tree, tree_bytes

logger = logging.getLogger(__name__)


class MemoryTierError(RuntimeError):
    """A hand-off did not complete; the message says which keeper refused and why."""


@dataclass(frozen=True)
class Snapshot:
    """A shard's ``{"step", "state"}`` copied out of the live state, to be handed on later.

    Inside Ray it is one ``ray.put`` into this node's object store - a single copy, into pages
    Ray keeps (a fresh 1 GB allocation per snapshot, faulted in under memory pressure, took
    seconds where the put took a fraction of one); outside Ray, a tree of copies.

    A survivor's snapshot is put in the background (``put``): its teardown reports the shard
    held at once, and the copy is made while the coordinator concludes and the group forms -
    the live state does not move until the rejoin returns, and the rejoin waits for the copy
    (``settle``) first.
    """

    step: int
    nbytes: int
    ref: Any = None  # the tree's ObjectRef (inside Ray)
    tree: Any = None  # the tree itself (outside Ray); the live views while ``put`` runs
    chunks: dict[str, Any] | None = None  # a dcp_saver's shard: its chunks (dcp.chunk_summary)
    put: Future[Any] | None = None  # the ObjectRef, while the put runs in the background

    def object_ref(self) -> Any:
        """The tree's ObjectRef (None outside Ray); a put still running is waited for, and its
        error raised."""
        return self.put.result() if self.put is not None else self.ref

    def value(self) -> Any:
        """The tree (``memory/tree.py``); from this node's object store without a copy. While
        a background put runs, the live state's own views: valid only until ``settle``."""
        import ray

        if self.put is not None and not self.put.done() and self.tree is not None:
            return self.tree
        ref = self.object_ref()
        return ray.get(ref) if ref is not None else self.tree

    def settle(self, timeout_s: float) -> str | None:
        """Wait for a background put; None once the copy is made, else why it is not."""
        if self.put is None:
            return None
        try:
            self.put.result(timeout=timeout_s)
        except FutureTimeout:
            return f"the snapshot's copy took over {timeout_s:.1f}s"
        except Exception as exc:  # ObjectStoreFullError, MemoryError...: said, never raised here
            return f"the snapshot's copy failed: {type(exc).__name__}: {exc}"[:300]
        object.__setattr__(self, "tree", None)  # the live views: the state moves on now
        return None


def take_snapshot(
    state: Any,
    step: int,
    max_bytes: int,
    background: bool = False,
    available: Callable[[], int | None] | None = None,
) -> Snapshot | str:
    """``state`` at ``step`` as a ``Snapshot``, or why not: over ``max_bytes``, or over the
    host memory free now (``available()``, default ``/proc/meminfo``'s ``MemAvailable``; None
    where it cannot be read) - a GPU model larger than the host's free RAM is saved instead.

    ``background``: inside Ray, the put runs on a thread of its own and the snapshot returns
    at once; the caller must not change ``state`` until ``settle`` said it is done."""
    import ray

    inside_ray = ray.is_initialized()
    # Inside Ray the put is the copy: the tree's leaves are views of the live tensors until then.
    tree = to_tree({"step": step, "state": state}, copy=not inside_ray)
    nbytes = tree_bytes(tree)
    if nbytes > max_bytes:
        return f"{nbytes} bytes do not fit memory_budget_mb={max_bytes >> 20} for a snapshot"
    free = (available or host_memory_available)()
    if free is not None and nbytes > free:
        return f"{nbytes} bytes do not fit the host's free memory ({free} bytes) for a snapshot"
    if inside_ray and background:
        put: Future[Any] = Future()

        def copy() -> None:
            try:
                put.set_result(ray.put(tree))
            except BaseException as exc:  # handed to whoever waits: settle() says it
                put.set_exception(exc)

        threading.Thread(target=copy, name="ray_graceful-snapshot", daemon=True).start()
        return Snapshot(step, nbytes, tree=tree, put=put)
    if inside_ray:
        return Snapshot(step, nbytes, ref=ray.put(tree))
    return Snapshot(step, nbytes, tree=tree)


def host_memory_available() -> int | None:
    """Bytes of host memory free for new pages now (``MemAvailable``); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return None
    return None


def hand_off(
    state: Any,
    step: int,
    shard_key: str,
    keepers: tuple[str, ...],
    namespace: str,
    cycle: int,
    timeout_s: float,
    group: str = "",
    rank: int = -1,
) -> ShardRecord:
    """Give ``{"step": step, "state": state}`` to every keeper named; the record says where."""
    import ray

    started = time.monotonic()
    # DCP: what the coordinator checks coverage with at commit (and a restarted one, from the
    # keepers: each keeps it beside the shard)
    chunks = chunk_summary(state) if is_shard_files(state) else None
    tree = to_tree({"step": step, "state": state})
    snapshot = Snapshot(step, tree_bytes(tree), ref=ray.put(tree), chunks=chunks)
    record = hand_off_snapshot(
        snapshot, shard_key, keepers, namespace, cycle, timeout_s, group, rank
    )
    return dataclasses.replace(record, seconds=time.monotonic() - started)  # the put included


def hand_off_snapshot(
    snapshot: Snapshot,
    shard_key: str,
    keepers: tuple[str, ...],
    namespace: str,
    cycle: int,
    timeout_s: float,
    group: str = "",
    rank: int = -1,
) -> ShardRecord:
    """Every keeper named takes its copy of ``snapshot``; the record says where (a held
    shard's late copy, and the last part of every ``hand_off``)."""
    import ray

    started = time.monotonic()
    ref = snapshot.object_ref()
    ref = ref if ref is not None else ray.put(snapshot.tree)
    step, nbytes, chunks = snapshot.step, snapshot.nbytes, snapshot.chunks
    handles = [ray.get_actor(name, namespace=namespace) for name in keepers]
    calls = [
        h.hold.remote(cycle, step, shard_key, [ref], nbytes, group, rank, timeout_s, chunks)
        for h in handles
    ]
    replies: list[Any] = ray.get(calls, timeout=timeout_s)
    refused = [r.reason for r in replies if not r.accepted]
    if refused:
        raise MemoryTierError("; ".join(refused))
    return ShardRecord(
        shard=shard_key,
        step=step,
        file=shard_file_name(shard_key),
        bytes=nbytes,
        crc32=0,  # computed when a keeper persists it; Ray moved it whole or not at all
        group=group,
        rank=rank,
        seconds=time.monotonic() - started,
        tier=Place.MEMORY,
        holders=tuple(r.node_id for r in replies),
        dcp_chunks=chunks,
    )


@dataclass
class LoadedShard:
    """What ``load_shard`` found: the saved ``{"step", "state"}`` and where it came from."""

    step: int
    value: Any
    tier: LoadedFrom
    source: str

    @property
    def state(self) -> Any:
        return self.value["state"] if isinstance(self.value, dict) else self.value


def load_shard(
    shard_key: str,
    coordinator: Any | None,
    checkpoint_dir: str | None,
    namespace: str,
    timeout_s: float = 60.0,
    step: int | None = None,
) -> LoadedShard | None:
    """The newest committed copy of ``shard_key``: memory (own node, then a peer), else disk.

    ``coordinator`` is the job's coordinator handle (None: disk only). A keeper that is gone or
    answers nothing is skipped with a log line; the disk copy is the last resort - at the same
    step. ``MemoryTierError`` if every holder failed and disk has only an older step: the rest
    of the group would load the newer one.

    ``step``: a warm restart's member loading that step, which its group may hold without it
    being committed yet (``coordinator/held.py``): a keeper's copy of it counts too.
    """
    import ray

    memory = None
    if coordinator is not None:
        try:
            asked = coordinator.memory_checkpoint.remote(shard_key, step)
            memory = ray.get(asked, timeout=timeout_s)
        except Exception as exc:
            logger.warning("ray_graceful: could not ask for the memory checkpoint: %r", exc)
    # Read after the coordinator answered: it waits for a held step still settling, which may
    # land on disk (written through by keepers whose nodes are leaving) while it waits.
    # Manifests and sizes only: verifying every shard here would read the whole checkpoint
    # in every rank; the shard loaded from disk is verified when it is loaded.
    on_disk = latest_committed(checkpoint_dir, verify_checksums=False) if checkpoint_dir else None
    if memory is not None and (on_disk is None or memory["step"] >= on_disk.step):
        here = ray.get_runtime_context().get_node_id()
        holders = sorted(memory["holders"].items(), key=lambda item: item[0] != here)
        for node, name in holders:
            try:
                keeper = ray.get_actor(name, namespace=namespace)
                ref_in_list: list[Any] | None = ray.get(
                    keeper.fetch.remote(memory["step"], shard_key), timeout=timeout_s
                )
                if ref_in_list is None:
                    continue
                # copied out: the keeper's object is mapped writable here, and an optimizer's
                # load_state_dict keeps what it is given - its steps would land in the held step
                value = from_tree(ray.get(ref_in_list[0], timeout=timeout_s), copy=True)
            except Exception as exc:
                logger.warning(
                    "ray_graceful: keeper on %s did not give %s: %r", node, shard_key, exc
                )
                continue
            tier = LoadedFrom.MEMORY_LOCAL if node == here else LoadedFrom.MEMORY_PEER
            return LoadedShard(memory["step"], value, tier, f"keeper on node {node[:12]}")
        if on_disk is None or on_disk.step < memory["step"]:
            # The coordinator had just found every holder alive: loading an older step here
            # while the group's other ranks load step memory["step"] would tear the restart.
            raise MemoryTierError(
                f"no keeper gave {shard_key} of step {memory['step']} (holders: "
                f"{', '.join(n[:12] for n in memory['holders'])}) and the newest durable "
                f"checkpoint is {'none' if on_disk is None else f'step {on_disk.step}'}; "
                "restart the group: the coordinator then offers only what is still whole"
            )
    if on_disk is not None and shard_key in on_disk.shards:
        path = on_disk.shard_path(shard_key)
        return LoadedShard(
            on_disk.step, load_committed_shard(on_disk, shard_key), LoadedFrom.DISK, path
        )
    return None
