"""``python -m benchmarks save --tier memory``: the memory tier against the disk, same run.

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

from ray_graceful.tools.bench.kit import BenchRank
from ray_graceful.worker.mixin import GracefulWorkerMixin

NAMESPACE = "ray_graceful_bench"


def bench_save_memory(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_graceful.checkpoint import load_state_dict, save_state_dict, write_shard
    from ray_graceful.memory.handoff import hand_off
    from ray_graceful.memory.keeper import Keeper, keeper_name
    from ray_graceful.memory.tree import from_tree
    from ray_graceful.tools.bench.kit import markdown_table

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
                    ref_in_list = ray.get(keepers[where].fetch.remote(rep, "bench/0"))
                    value = from_tree(ray.get(ref_in_list[0]))
                    assert value["state"]["layer0"].shape == state["layer0"].shape
                    load[f"memory {where}"].append(time.perf_counter() - start)
                    del value, ref_in_list
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
    table = markdown_table(
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


# --- the restart: memory tier against disk -----------------------------------------------------

STATE_TENSORS = 16


class RestartWorker(GracefulWorkerMixin, BenchRank):
    """A hand-built rank whose whole state is ``mb`` MB of tensors."""

    def __init__(self) -> None:
        import torch.distributed  # noqa: F401 (what every rank imports before its work)

        from ray_graceful.worker import restore  # noqa: F401

        self.constructed_at = time.time()  # the process is up, its imports done
        self.state: dict[str, Any] = {}

    def fill(self, mb: int) -> int:
        import torch

        per = mb * (1 << 20) // 4 // STATE_TENSORS
        self.state = {f"layer{i}": torch.randn(per) for i in range(STATE_TENSORS)}
        return sum(t.numel() * 4 for t in self.state.values())

    def start(
        self,
        rank: int,
        world: int,
        port: int,
        config: Any,
        resume: str | None = None,
    ) -> dict[str, Any]:
        """Join the group, load (``resume``: "memory" - the one call a user makes, memory
        first - or "disk", the committed checkpoint only), set up, take one training step."""

        import torch
        import torch.distributed as dist

        from ray_graceful.memory.handoff import load_shard
        from ray_graceful.protocol import shard_key
        from ray_graceful.worker.restore import load_latest

        called_at = time.time()
        self.join_group(rank, world, port)
        joined_at = time.time()
        tier, step = "-", 0
        if resume == "memory":
            loaded = load_latest("bench", rank, config)
        elif resume == "disk":
            loaded = load_shard(
                shard_key("bench", str(rank)), None, config.checkpoint_dir, NAMESPACE
            )
        else:
            loaded = None
        if loaded is not None:
            self.state = {k: torch.as_tensor(v) for k, v in loaded.state.items()}
            tier, step = loaded.tier, loaded.step
        loaded_at = time.time()
        if resume is None:  # the group that will be evicted; a restarted group is killed
            self.graceful_setup(  # after its first step, which its coordinator would
                "bench", shard=str(rank), config=config, state_dict=lambda: self.state
            )  # take for a lost rank: registration (one actor call) is left out of both tiers
        total = torch.stack([t.sum() for t in self.state.values()]).sum().reshape(1)
        dist.all_reduce(total)  # the first training step: every rank's state in use
        return {
            "constructed_at": self.constructed_at,
            "called_at": called_at,
            "joined_at": joined_at,
            "loaded_at": loaded_at,
            "stepped_at": time.time(),
            "tier": tier,
            "step": step,
        }


def bench_restart_memory(args: argparse.Namespace) -> dict[str, Any]:
    """A group's node is evicted; new groups restart from the memory tier and from disk.

    Per repetition: a group of ``--ranks`` ranks on node B, each with a shard of ``mb`` MB,
    training; node B gets an eviction notice; the savers hand their shards to the keeper on the
    head (the one surviving keeper), the checkpoint commits in memory and its durable copy
    lands on disk. Then three new groups start from that one checkpoint: on the head, loading
    the way a user's code does (``load_latest``: the keeper on its own node); on node A, the
    same call (a peer keeper: one transfer per shard); on node A from disk (the page cache
    dropped first, as on a node that never read the file). Measured from the moment the driver
    creates the new actors to every rank having taken its first step, with its parts.
    """
    import ray

    from ray_graceful.config import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from ray_graceful.tools.bench.kit import local_cluster, markdown_table

    largest = max(args.sizes) << 20
    store = int(largest * args.ranks * 2.5) + (256 << 20)
    rows, results = [], []
    with local_cluster(extra_nodes=2, head_cpus=2, object_store_bytes=store) as (_cluster, nodes):
        node_a, node_b = nodes
        head = ray.get_runtime_context().get_node_id()
        here = next(n for n in ray.nodes() if n["NodeID"] == head)  # the keepers' node
        ways = (
            ("memory, holders' node", "memory", here["NodeID"]),
            ("memory, another node", "memory", node_a.node_id),
            ("disk", "disk", node_a.node_id),
        )
        for mb in args.sizes:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _h, _n in ways}
            for rep in range(args.reps):
                work = tempfile.mkdtemp(prefix="restart-")
                config = GracefulConfig(
                    checkpoint_dir=os.path.join(work, "ckpt"),
                    report_dir=os.path.join(work, "reports"),
                    coordinator_namespace=NAMESPACE,
                    coordinator_name=f"bench-restart-{mb}-{rep}",
                    memory_replicas=1,
                    memory_budget_mb=(largest >> 20) * args.ranks * 2,
                    expected_save_s=1.0,
                )
                # On the driver's node, as a job runs it: never on the node the bench evicts.
                coordinator = Coordinator.start(config, node_id=head)
                try:
                    step = _evict(ray, coordinator, config, node_b.node_id, args.ranks, mb)
                    order = ways if rep % 2 == 0 else ways[::-1]
                    for label, how, node in order:
                        created = time.time()
                        group = _group(ray, node, args.ranks)
                        marks = _start(ray, group, config, how)
                        for rank in group:
                            ray.kill(rank)
                        if {m["step"] for m in marks} != {step}:
                            raise RuntimeError(f"restart {label} loaded {marks}, not step {step}")
                        done = max(m["stepped_at"] for m in marks)
                        runs[label].append(
                            {
                                "restart_s": done - created,
                                "after_up_s": done - max(m["constructed_at"] for m in marks),
                                "join_s": max(m["joined_at"] - m["called_at"] for m in marks),
                                "load_s": max(m["loaded_at"] - m["joined_at"] for m in marks),
                                "tiers": sorted({m["tier"] for m in marks}),
                            }
                        )
                finally:
                    coordinator.shutdown()
            results.append({"mb": mb, "runs": runs})
            disk = {
                k: statistics.median(r[k] for r in runs["disk"])
                for k in runs["disk"][0]
                if k != "tiers"
            }
            for label, _how, _node in ways:
                med = {k: statistics.median(r[k] for r in runs[label]) for k in disk}
                rows.append(
                    [
                        mb,
                        label,
                        "/".join(sorted({t for r in runs[label] for t in r["tiers"]})),
                        med["restart_s"],
                        f"{disk['restart_s'] / med['restart_s']:.2f}x",
                        med["after_up_s"],
                        f"{disk['after_up_s'] / med['after_up_s']:.2f}x",
                        med["join_s"],
                        med["load_s"],
                        f"{disk['load_s'] / med['load_s']:.1f}x",
                    ]
                )
    table = markdown_table(
        [
            "MB per shard",
            "restart from",
            "loaded as",
            "restart s",
            "vs disk",
            "after processes up s",
            "vs disk",
            "join s",
            "load s",
            "vs disk",
        ],
        rows,
    )
    table += (
        f"\nmedians of {args.reps}; {args.ranks} ranks, one shard each, evicted from node B; "
        "the keepers that hold the checkpoint run on the head. restart = the driver creates the "
        "new actors -> every rank joined the process group, loaded its shard and took its first "
        "step; 'after processes up' leaves out the worker process start and imports (what "
        "pre-started spares skip); join = init_process_group; load = load_latest (memory) or "
        "the committed checkpoint (disk), read after dropping it from the page cache"
    )
    return {"results": results, "table": table}


def _evict(ray: Any, coordinator: Any, config: Any, node_id: str, ranks: int, mb: int) -> int:
    """A group on ``node_id`` trains; the node gets a notice; the step committed in memory,
    once its durable copy landed and left the page cache."""
    group = _group(ray, node_id, ranks)
    ray.get([r.fill.remote(mb) for r in group], timeout=300)
    _start(ray, group, config, None)
    running = [r.train.remote(10**6, 1, 0.05) for r in group]
    time.sleep(1.0)
    coordinator.notify(node_id=node_id, reason="bench: node evicted", deadline=time.time() + 60)
    ray.wait(running, num_returns=len(running), timeout=120)  # they exit 0
    outcome = coordinator.wait_outcome(timeout=120, cycle=0)
    if outcome is None or outcome.committed.get("tier") != "memory":
        saves = outcome and [
            s["detail"] for r in outcome.reports for s in r["phases"] if s["name"] == "save"
        ]
        raise RuntimeError(f"no memory commit: {outcome and outcome.summary()}; saves: {saves}")
    durable = coordinator.wait_durable(0, timeout=300)
    if not durable or "path" not in durable:
        raise RuntimeError(f"no durable copy: {durable}")
    for name in os.listdir(durable["path"]):
        _drop_page_cache(os.path.join(durable["path"], name))
    return int(outcome.committed["step"])


def _group(ray: Any, node_id: str, ranks: int) -> list[Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(RestartWorker)
    return [
        actor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote()
        for _ in range(ranks)
    ]


def _start(ray: Any, group: list[Any], config: Any, resume: str | None) -> list[dict[str, Any]]:
    from ray_graceful.worker.process_groups import free_port

    port = free_port()
    return ray.get(
        [r.start.remote(i, len(group), port, config, resume) for i, r in enumerate(group)],
        timeout=600,
    )
