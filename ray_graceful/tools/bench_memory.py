"""``ray-graceful bench save --tier memory``: the memory tier against the disk, same run.

A cluster of two nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, two object
stores), a keeper on each. For each size, a state dict of 16 float32 tensors is saved by the
driver (on the first node) five ways: handed to the keeper on its own node (*memory, local*),
to the keeper on the other node (*memory, peer*: a transfer between the object stores, over
loopback here, a NIC in a real cluster), the durable disk save of today (*disk*: ``write_shard``,
``torch.save`` + fsync + CRC + rename), and a plain ``torch.save`` to a path (not durable).
"Saved" for the memory tier means what the teardown waits for: the keeper answered that it
holds its own copy, so the saver may exit. Then the restart's read: each copy loaded back
(*local*: a zero-copy ``ray.get`` in the keeper's store; *peer*: a transfer; *disk*:
``torch.load``), until the tensors are usable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

NAMESPACE = "ray_graceful_bench"


def bench_save_memory(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..checkpoint import load_state_dict, save_state_dict, write_shard
    from ..memory.handoff import hand_off
    from ..memory.keeper import Keeper, keeper_name
    from ..memory.tree import from_tree
    from .bench import _table

    largest = max(args.sizes) << 20
    store = int(largest * 3.5) + (256 << 20)  # saver's put + keeper's copy, with headroom
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rg-bench-"))
    if args.preallocate:  # Ray's own switch: the raylet maps its store with MAP_POPULATE
        os.environ["RAY_preallocate_plasma_memory"] = "1"  # noqa: SIM112 (Ray spells it so)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": store, "include_dashboard": False},
    )
    peer_node = cluster.add_node(num_cpus=1, object_store_memory=store)
    ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
    directory = args.dir or tempfile.mkdtemp(prefix="save-")
    os.makedirs(directory, exist_ok=True)
    try:
        here = ray.get_runtime_context().get_node_id()
        keepers = {}
        for where, node in (("local", here), ("peer", peer_node.node_id)):
            name = keeper_name("bench", "bench", node)
            keepers[where] = (
                ray.remote(Keeper)
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    num_cpus=0,
                    max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote("bench", node, store)
            )
            ray.get(keepers[where].ping.remote(), timeout=120)
        names = {
            w: keeper_name("bench", "bench", n)
            for w, n in (("local", here), ("peer", peer_node.node_id))
        }
        rows, results = [], []
        for mb in args.sizes:
            state = {f"layer{i}": torch.randn(mb * (1 << 20) // 4 // 16) for i in range(16)}
            nbytes = sum(t.numel() * 4 for t in state.values())
            save = {k: [] for k in ("memory local", "memory peer", "disk", "torch.save")}
            load = {k: [] for k in ("memory local", "memory peer", "disk")}
            for rep in range(args.reps):
                for where in ("local", "peer"):
                    start = time.perf_counter()
                    hand_off(state, rep, "bench/0", (names[where],), NAMESPACE, rep, 600.0)
                    save[f"memory {where}"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    boxed = ray.get(keepers[where].fetch.remote(rep, "bench/0"))
                    value = from_tree(ray.get(boxed[0]))
                    assert value["state"]["layer0"].shape == state["layer0"].shape
                    load[f"memory {where}"].append(time.perf_counter() - start)
                    del value, boxed
                    ray.get(keepers[where].release.remote(below_step=rep + 1))

                start = time.perf_counter()
                record = write_shard(
                    directory,
                    rep,
                    "bench/0",
                    lambda p, step, state=state: save_state_dict({"step": step, "state": state}, p),
                )
                save["disk"].append(time.perf_counter() - start)
                shard = os.path.join(directory, f"step-{rep:08d}", record.file)
                _drop_page_cache(shard)
                start = time.perf_counter()
                loaded = load_state_dict(shard)
                load["disk"].append(time.perf_counter() - start)
                del loaded
                os.remove(shard)

                path = os.path.join(directory, f"plain-{rep}.pt")
                start = time.perf_counter()
                torch.save(state, path)
                save["torch.save"].append(time.perf_counter() - start)
                os.remove(path)
            med = {k: statistics.median(v) for k, v in save.items()}
            med_load = {k: statistics.median(v) for k, v in load.items()}
            results.append({"mb": mb, "bytes": nbytes, "save_seconds": save, "load_seconds": load})
            rows.append(
                [
                    mb,
                    f"{med['memory local']:.3f} ({save['memory local'][0]:.3f})",
                    f"{med['memory peer']:.3f}",
                    f"{med['disk']:.3f}",
                    f"{med['torch.save']:.3f}",
                    f"{med['disk'] / med['memory local']:.1f}x",
                    f"{med['disk'] / med['memory peer']:.1f}x",
                    f"{med_load['memory local']:.3f}",
                    f"{med_load['memory peer']:.3f}",
                    f"{med_load['disk']:.3f}",
                ]
            )
            state.clear()
    finally:
        ray.shutdown()
        cluster.shutdown()
    table = _table(
        [
            "MB",
            "save: mem local s (first)",
            "mem peer s",
            "disk s",
            "torch.save s",
            "disk/local",
            "disk/peer",
            "load: mem local s",
            "mem peer s",
            "disk s",
        ],
        rows,
    )
    store_state = "pre-populated" if args.preallocate else "not yet touched"
    table += (
        f"\nmedians of {args.reps} (first: the first hand-off of that size, into a store "
        f"{store_state}); disk = write_shard in {directory} (torch.save, fsync, CRC32, rename, "
        "directory fsync); disk load after dropping the file from the page cache"
    )
    return {"results": results, "table": table}


def _drop_page_cache(path: str) -> None:
    """Make the disk load read the disk, as a restart on another node would, where we can."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
