"""``python -m benchmarks recovery``: a Ray Train run preempted mid-way - the node drained
with a deadline and removed at it - with the callback and without: time to resumed training
and steps lost. ``--peers`` runs the race against Ray Train's own handling (``race.py``),
``--tier memory`` the memory tier's restart against disk (``memory.py``)."""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Any

from ray_graceful.tools.bench.kit import local_cluster, markdown_table

from .train_job import callback_config, torch_trainer


def _recovery_once(
    graceful: bool, total: int, every: int, step_s: float, evict_after: int, deadline_s: float
) -> dict[str, Any]:
    """One Ray Train run; its node is drained with a deadline and removed at the deadline."""

    from ray_graceful.ray_adapter import available_resources_per_node, drain_node
    from ray_graceful.train import GracefulTrainCallback

    with local_cluster(extra_nodes=3, head_cpus=2, node_resources={"bench_slot": 1}) as (
        cluster,
        nodes,
    ):
        work = tempfile.mkdtemp(prefix="recovery-")
        progress, attempts = os.path.join(work, "progress"), os.path.join(work, "attempts")
        callbacks = []
        if graceful:
            callbacks.append(GracefulTrainCallback(callback_config(work)))
        trainer = torch_trainer(
            {
                "total": total,
                "step_s": step_s,
                "every": every,
                "progress": progress,
                "attempt_file": attempts,
                "graceful": graceful,
            },
            callbacks,
            work,
        )
        box: dict[str, Any] = {}
        started = time.time()
        thread = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
        thread.start()

        def executed() -> list[tuple[int, int, float]]:
            try:
                with open(progress) as f:
                    return [(int(r), int(s), float(t)) for r, s, t in map(str.split, f)]
            except FileNotFoundError:
                return []

        while len(executed()) < 2 * evict_after and thread.is_alive():
            time.sleep(0.05)
        at_eviction = max(s for _r, s, _t in executed())
        busy = [
            n
            for n in nodes
            if available_resources_per_node().get(n.node_id, {}).get("bench_slot", 0) == 0
        ]
        t0 = time.time()
        drain_node(busy[0].node_id, t0 + deadline_s, "bench: spot reclaim")
        # The reclaim itself, at the deadline, unless the run already moved off the node.
        while time.time() < t0 + deadline_s and thread.is_alive():
            time.sleep(0.05)
        cluster.remove_node(busy[0])
        thread.join()
        with open(attempts) as f:
            starts = [(int(r), int(s), float(t)) for r, _, s, t, *_pid in map(str.split, f)]
        restart = min((t for _r, _s, t in starts[2:]), default=None)
        resumed_at = starts[2][1] if len(starts) > 2 else None
        # Training is going again at the first step the restarted attempt finished.
        going_again = min((t for _r, _s, t in executed() if restart and t > restart), default=None)
        rank0 = [s for r, s, _t in executed() if r == 0]
        return {
            "graceful": graceful,
            "evicted_at_step": at_eviction,
            "resumed_at_step": resumed_at,
            # A step executed twice is a step lost: the work between the checkpoint the run
            # resumed from and the eviction was done again.
            "steps_lost": len(rank0) - len(set(rank0)),
            "steps_executed_rank0": len(rank0),
            "training_again_s": (going_again - t0) if going_again else None,
            "wall_s": time.time() - started,
            "error": str(box["result"].error) if box["result"].error else None,
        }


def bench_recovery(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "peers", False):
        from .race import bench_race

        return bench_race(args)
    if getattr(args, "tier", None) == "memory":
        from .memory import bench_restart_memory

        return bench_restart_memory(args)
    rows, results = [], []
    for graceful in (True, False):
        r = _recovery_once(
            graceful, args.total, args.every, args.step_s, args.evict_after, args.deadline
        )
        results.append(r)
        print(f"  recovery graceful={graceful}: {r}", flush=True)
        rows.append(
            [
                "with ray_graceful" if graceful else "without",
                r["evicted_at_step"],
                r["resumed_at_step"],
                r["steps_lost"],
                r["training_again_s"],
                r["wall_s"],
            ]
        )
    table = markdown_table(
        [
            "run",
            "drained at step",
            "resumed at step",
            "steps lost",
            "training again s after drain",
            "run wall s",
        ],
        rows,
    )
    table += (
        f"\n{args.total} steps of {args.step_s}s, periodic checkpoint every {args.every}; "
        f"the node is drained with a {args.deadline:.0f}s deadline and removed at it"
    )
    return {"results": results, "table": table}
