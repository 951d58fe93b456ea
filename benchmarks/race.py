"""``python -m benchmarks recovery --peers``: the same Ray Train job, the same events, four ways.

A ``TorchTrainer`` (2 CPU workers, gloo DDP, a periodic checkpoint every ``--every`` steps) on
a cluster with spare worker slots. After ``--evict-after`` steps one event happens to the node
of world rank 1 (rank 0, Ray Train's sole checkpoint writer, is left where Ray's own handling
works best):

- ``drain``:   Ray drains the node with a ``--deadline`` s deadline; removed at the deadline;
- ``sigterm``: its worker process gets SIGTERM and nothing is drained (a Kubernetes eviction
               without Ray's drain); the node goes once that process is gone;
- ``stuck``:   rank 1 hangs before its next step (its peer blocks in the all-reduce), then the
               drain comes;
- ``faulty``:  rank 0's node turns FAULTY (scripted NVML verdict, XID 79) as rank 1's node is
               drained; both nodes are removed at the deadline.

Ways: ``none`` (periodic checkpoints only); ``ray-documented`` (Ray Train 2.60's pattern: a
just-in-time checkpoint when ``ray.train.get_preemption_info()`` reports the drain, keep
training); ``ray-best`` (the same checkpoint, then raise: Train restarts from it at once);
``graceful`` (ray_graceful's callback). All run with ``FailureConfig(max_failures=3)``.

Measured per cell: steps lost (executed twice), seconds from the event to the first step of the
restarted attempt, the step it resumed at, and how Ray recorded each first-attempt worker's end.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from typing import Any

WAYS = ("none", "ray-documented", "ray-best", "graceful", "graceful-warm")
SCENARIOS = ("drain", "sigterm", "stuck", "faulty")
RUN_TIMEOUT_S = 300.0


def _read(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def race_once(way: str, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one way through one scenario."""
    from ray_graceful.health.scripted import write_faults
    from ray_graceful.ray_adapter import drain_node, worker_exits
    from ray_graceful.tools.bench.kit import local_cluster, process_alive
    from ray_graceful.train import GracefulTrainCallback

    from .train_job import callback_config, torch_trainer

    # Two worker nodes, and as many free ones as the run asks for (spare capacity already in
    # the cluster); none: a fresh node is started on demand once the event came.
    free = args.free_nodes
    with local_cluster(extra_nodes=2 + free, head_cpus=2, node_resources={"bench_slot": 1}) as (
        cluster,
        nodes,
    ):
        work = tempfile.mkdtemp(prefix=f"race-{way}-{scenario}-")
        progress, attempts = os.path.join(work, "progress"), os.path.join(work, "attempts")
        faults = os.path.join(work, "faults.json")
        callbacks = []
        if way.startswith("graceful"):
            warm = {"checkpoint_dir": os.path.join(work, "ckpt")} if way == "graceful-warm" else {}
            callbacks.append(
                GracefulTrainCallback(
                    callback_config(
                        work, health_probe="scripted", health_script_path=faults, **warm
                    )
                )
            )
        loop = {
            "total": args.total,
            "step_s": args.step_s,
            "every": args.every,
            "progress": progress,
            "attempt_file": attempts,
            "handling": way,
            "final": os.path.join(work, "final"),
        }
        if scenario == "stuck":
            loop.update(stall_rank=1, stall_at=args.evict_after + 1)
        trainer = torch_trainer(loop, callbacks, work, warm=way == "graceful-warm")
        box: dict[str, Any] = {}
        started = time.time()
        thread = threading.Thread(
            target=lambda: box.setdefault("result", trainer.fit()), daemon=True
        )
        thread.start()
        while len(_read(progress)) < 2 * args.evict_after and thread.is_alive():
            time.sleep(0.05)
        if scenario == "stuck":
            time.sleep(1.0)  # rank 1 is hanging, rank 0 is blocked in the all-reduce
        first = {int(r[0]): r for r in _read(attempts)[:2]}
        pids = {rank: int(row[4]) for rank, row in first.items()}
        node_of = {rank: row[5] for rank, row in first.items()}
        by_id = {n.node_id: n for n in nodes}
        at_event = max((int(row[1]) for row in _read(progress) if row[0] == "0"), default=0)
        victim = by_id[node_of[1]]
        t0 = time.time()
        doomed = [victim]
        if scenario == "sigterm":
            os.kill(pids[1], signal.SIGTERM)
            while process_alive(pids[1]) and time.time() < t0 + args.deadline:
                time.sleep(0.01)
        else:
            if scenario == "faulty":
                doomed.append(by_id[node_of[0]])
                write_faults(
                    faults,
                    [
                        {
                            "node": node_of[0],
                            "verdict": "FAULTY",
                            "code": "xid_79",
                            "detail": "GPU has fallen off the bus (scripted)",
                        }
                    ],
                )
            drain_node(victim.node_id, t0 + args.deadline, "bench: spot reclaim")
            while time.time() < t0 + args.deadline and thread.is_alive():
                time.sleep(0.05)
        for node in doomed:
            cluster.remove_node(node)
        if not free:  # capacity on demand: the new node starts once the old one is gone
            cluster.add_node(num_cpus=2, resources={"bench_slot": 1})
        thread.join(RUN_TIMEOUT_S)
        hung = thread.is_alive()
        endings = worker_exits(set(pids.values()))
        starts = _read(attempts)
        executed = [(int(row[0]), int(row[1]), float(row[2])) for row in _read(progress)]
        restart = min((float(row[3]) for row in starts[2:]), default=None)
        again = min((t for _r, _s, t in executed if restart and t > restart), default=None)
        rank0 = [s for r, s, _t in executed if r == 0]
        result = box.get("result")
        return {
            "way": way,
            "scenario": scenario,
            "event_at_step": at_event,
            "resumed_at_step": int(starts[2][2]) if len(starts) > 2 else None,
            "steps_lost": len(rank0) - len(set(rank0)),
            "training_again_s": (again - t0) if again else None,
            "endings": {
                f"rank {rank}": endings.get(pid, "alive or not recorded")
                for rank, pid in sorted(pids.items())
            },
            "hung": hung,
            # rank 0's node stays: did its process (and training function) go on?
            "rank0_kept": not any(row[0] == "0" for row in starts[2:]),
            # from the event: the new attempt's training function began, it had joined (the
            # warm path: setup returned), its first step was done
            "phases_s": {
                "began": float(starts[2][6]) - t0
                if len(starts) > 2 and len(starts[2]) > 6
                else None,
                "joined": float(starts[2][3]) - t0 if len(starts) > 2 else None,
                "first_step": (again - t0) if again else None,
            },
            "error": str(result.error)[:200] if result is not None and result.error else None,
            "wall_s": time.time() - started,
        }


def _phases(phases: dict[str, float | None]) -> str:
    began, joined = phases.get("began"), phases.get("joined")
    if joined is None:
        return "-"
    return (f"{began:.1f} / " if began is not None else "- / ") + f"{joined:.1f}"


def bench_race(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.tools.bench.kit import markdown_table

    scenarios = [s for s in args.scenarios.split(",") if s]
    ways = [w for w in args.ways.split(",") if w]
    for name, allowed, given in (("scenario", SCENARIOS, scenarios), ("way", WAYS, ways)):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise SystemExit(f"unknown {name}(s) {unknown}; allowed: {', '.join(allowed)}")
    rows, results = [], []
    for scenario in scenarios:
        for way in ways:
            r = race_once(way, scenario, args)
            results.append(r)
            print(f"  race {scenario} / {way}: {r}", flush=True)
            again = r["training_again_s"]
            rows.append(
                [
                    scenario,
                    way,
                    r["event_at_step"],
                    r["resumed_at_step"] if r["resumed_at_step"] is not None else "-",
                    r["steps_lost"],
                    f"{again:.1f}" if again is not None else "never",
                    _phases(r["phases_s"]),
                    ", ".join(sorted(set(r["endings"].values()))),
                    "yes" if r["rank0_kept"] else "no",
                    "HUNG" if r["hung"] else (r["error"] or "ok")[:40],
                ]
            )
    table = markdown_table(
        [
            "scenario",
            "way",
            "event at step",
            "resumed at",
            "steps lost",
            "training again s",
            "began / joined s",
            "first attempt's workers ended",
            "rank 0 kept its process",
            "run",
        ],
        rows,
    )
    table += (
        f"\n{args.total} steps of {args.step_s}s, periodic checkpoint every {args.every}; event "
        f"after step {args.evict_after}; drain deadline {args.deadline:.0f}s; "
        + (
            f"{args.free_nodes} free node(s) in the cluster"
            if args.free_nodes
            else "a fresh node started on demand when the old one is gone"
        )
    )
    return {"results": results, "table": table}
