"""``python -m benchmarks keeper-memory``: a keeper's own memory over many evictions.

What one eviction asks of a keeper, ``--evictions`` times in a row, on a real keeper actor: a
saver's shard of ``--mb`` MB (a new step each time) is handed to it (``hold``: its own copy in
its node's object store), written to disk (``persist``: atomic, checksummed, as the durable
copy is), and the older step released - the keeper holds one step at any time. After each, the
keeper's anonymous memory (``/proc/<pid>/smaps_rollup``: its heap and allocator arenas, not the
object store's shared pages) is read. A keeper that holds one step should stay flat; it grew
by about one shard per eviction when each write ran on another of the actor's 32 threads, each
with its own allocator arena keeping what the write freed.

Nothing is simulated: a real keeper actor, Ray's object store, the disk.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any


def add_keeper_memory_parser(names: Any) -> Any:
    """``python -m benchmarks keeper-memory``'s options."""
    from ray_graceful.tools.arguments import positive_int

    parser = names.add_parser(
        "keeper-memory", help="a keeper's own memory over many hold/persist/release rounds"
    )
    parser.add_argument(
        "--evictions", type=positive_int, default=50, help="rounds, one step each (default 50)"
    )
    parser.add_argument("--mb", type=positive_int, default=32, help="MB per shard (default 32)")
    return parser


def anonymous_mb(pid: int) -> float:
    """Process ``pid``'s anonymous memory in MiB: its heap, not the object store's mapping."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_keeper_memory(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import ray
    import torch

    from ray_graceful.memory.keeper import start_keeper
    from ray_graceful.memory.tree import to_tree
    from ray_graceful.tools.bench.kit import local_cluster, markdown_table

    root = tempfile.mkdtemp(prefix="keeper-memory-")
    rounds: list[dict[str, float]] = []
    with local_cluster(head_cpus=2):
        node = ray.get_runtime_context().get_node_id()
        keeper = start_keeper("bench-keeper", "bench", "job", node, 1 << 40, "").handle
        pid = int(ray.get(keeper.stats.remote(), timeout=60)["pid"])
        base = anonymous_mb(pid)
        elements = (args.mb << 20) // 4
        for step in range(1, args.evictions + 1):
            started = time.monotonic()
            state = {"w": torch.from_numpy(np.random.default_rng(step).random(elements, "f4"))}
            ref = ray.put(to_tree({"step": step, "state": state}))
            kept = ray.get(keeper.hold.remote(step, step, "g/0", [ref], args.mb << 20), timeout=120)
            assert kept.accepted, kept.reason
            del ref
            ray.get(keeper.persist.remote(root, step, "g/0"), timeout=120)
            ray.get(keeper.release.remote(below_step=step), timeout=60)
            rounds.append(
                {"step": step, "anonymous_mb": anonymous_mb(pid), "s": time.monotonic() - started}
            )
            if step % 10 == 0:
                print(f"  eviction {step}: keeper {rounds[-1]['anonymous_mb']:.0f} MB", flush=True)
        ray.kill(keeper)
    grew = [r["anonymous_mb"] for r in rounds]
    tail = grew[len(grew) // 2 :]
    slope = (tail[-1] - tail[0]) / max(len(tail) - 1, 1)
    table = markdown_table(
        ["evictions", "MB per shard", "before MB", "after 1 MB", "after 10 MB", "last MB",
         "slope MB per eviction (second half)", "peak MB"],
        [[len(rounds), args.mb, base, grew[0], grew[min(9, len(grew) - 1)], grew[-1], slope,
          max(grew)]],
    )  # fmt: skip
    table += (
        f"\nthe keeper's anonymous memory (heap and allocator arenas; the object store's pages "
        f"are shared, not counted), pid {pid}, {os.cpu_count()} cores"
    )
    return {"results": rounds, "table": table}
