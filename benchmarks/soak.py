"""``python -m benchmarks soak``: eviction cycles back to back on one cluster, one coordinator.

Every cycle starts its group again: 4 gloo ranks (shards 0, 1, 0, 1: two replicas of each) of
real actor processes on a private local cluster, training by all-reduces under the plugin, with
one coordinator for the whole run. Then one eviction from the mix, in turn:

- ``sigterm``: rank 1's process gets SIGTERM;
- ``drain``: rank 0 runs on a node of its own, which Ray drains with a deadline;
- ``faulty``: rank 0 runs on a node of its own, whose health probe turns FAULTY (the scripted
  probe: the only simulated part - the verdict, not the path it takes);
- ``sigkill``: rank 1's process is SIGKILLed (a lost rank, found by the coordinator);
- ``hanging-save``: rank 0's save never returns (its state dict blocks), rank 1 gets SIGTERM;
- ``coordinator-kill``: the coordinator's process is SIGKILLed; Ray restarts it, the ranks
  register again, then rank 1 gets SIGTERM.

Per cycle it records what a user would check: ranks still alive past the deadline (hangs), a
committed checkpoint that does not verify or lacks a shard (torn), ranks whose end Ray recorded
as a crash (SYSTEM_ERROR, the SIGKILLed rank excepted), the outcome; and what a long job would
feel: the coordinator's and the keepers' resident memory, the coordinator's threads and file
descriptors, and the live actors in the cluster. The report gives each resource's slope per
cycle (least squares over the cycles after the first ``--warmup``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import tempfile
import time
from typing import Any

from ray_graceful.tools.bench.kit import BenchRank, process_alive, recorded_crashes, resident_mb
from ray_graceful.worker.mixin import GracefulWorkerMixin

KINDS = ("sigterm", "drain", "faulty", "sigkill", "hanging-save", "coordinator-kill")
SHARDS = ("0", "1", "0", "1")
RESOURCES = ("coordinator_rss_mb", "keepers_rss_mb", "threads", "fds", "live_actors")
# keepers_rss_mb: the keeper on the coordinator's node, the one that lives through every cycle.


class SoakRank(GracefulWorkerMixin, BenchRank):
    """A rank whose state is 256 KiB of its shard's weights; its save may hang on purpose."""

    def setup(self, rank: int, world: int, port: int, config: Any, hang_save: bool) -> int:
        import torch

        shard = SHARDS[rank]
        self.weights = torch.full((1 << 16,), float(shard))
        self.hang_save = hang_save
        pid = self.join_group(rank, world, port, timeout_s=60.0)
        self.graceful_setup("soak", shard=shard, config=config, state_dict=self._state)
        return pid

    def _state(self) -> dict[str, Any]:
        if self.hang_save:
            time.sleep(3600)  # a save stuck on a filesystem that stopped answering
        return {"weights": self.weights, "step": self.step}


def add_soak_parser(names: Any) -> Any:
    """``python -m benchmarks soak``'s options."""
    from ray_graceful.tools.arguments import comma_choices, positive_int, positive_seconds

    soak = names.add_parser("soak", help="eviction cycles back to back; hangs, torn, resources")
    soak.add_argument("--cycles", type=positive_int, default=50, help="cycles (default 50)")
    soak.add_argument(
        "--kinds",
        type=comma_choices(*KINDS),
        default=",".join(KINDS),
        help="the evictions, taken in turn (default: all six)",
    )
    soak.add_argument(
        "--deadline", type=positive_seconds, default=10.0, help="teardown deadline (default 10)"
    )
    soak.add_argument(
        "--memory-replicas",
        type=int,
        choices=(0, 1),
        default=1,
        help="1 (default): checkpoints go to the memory tier (a keeper per node) and on to "
        "disk; 0: straight to disk",
    )
    soak.add_argument(
        "--warmup", type=positive_int, default=6, help="cycles left out of the slopes"
    )
    soak.add_argument(
        "--warm",
        action="store_true",
        help="warm restarts instead: one group for the whole run, a rank SIGTERMed each cycle, "
        "the survivors and a spare re-formed in place (soak_warm.py; --kinds does not apply)",
    )
    soak.add_argument(
        "--train",
        action="store_true",
        help="Ray Train's warm path instead: one TorchTrainer for the whole run, a worker "
        "SIGTERMed each cycle, Train's new worker joins the survivors (soak_train.py; "
        "--memory-replicas and --deadline apply)",
    )
    soak.add_argument(
        "--held",
        action="store_true",
        help="with --warm: the SIGTERMed rank and the spares on a node of their own, so the "
        "survivors hold the step and the spare receives its shard from a survivor (the held "
        "path); without it, every process on one node and each cycle saves first",
    )
    return soak


def bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_graceful.config import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from ray_graceful.tools.bench.kit import local_cluster

    kinds = args.kinds.split(",")
    work = tempfile.mkdtemp(prefix="soak-")
    faults = os.path.join(work, "faults.json")
    config = GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        checkpoint_dir=os.path.join(work, "ckpt"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        expected_save_s=1.0,
        save_budget_s=args.deadline / 2,
        teardown_timeout_s=args.deadline,
        exit_grace_s=1.0,
        health_probe="scripted",
        health_script_path=faults,
        memory_replicas=args.memory_replicas,
        coordinator_max_restarts=100,
    )
    cycles: list[dict[str, Any]] = []
    with local_cluster(head_cpus=4) as (cluster, _nodes):
        coordinator = Coordinator.start(config)
        try:
            for number in range(args.cycles):
                kind = kinds[number % len(kinds)]
                cycle = _one_cycle(ray, cluster, coordinator, config, kind, args.deadline, faults)
                cycle.update(_resources(ray, coordinator), number=number)
                cycles.append(cycle)
                print(f"  cycle {number} {kind}: {_line(cycle)}", flush=True)
        finally:
            coordinator.shutdown()
    return {"results": cycles, "table": _report(cycles, kinds, args)}


def _one_cycle(
    ray: Any,
    cluster: Any,
    coordinator: Any,
    config: Any,
    kind: str,
    deadline_s: float,
    faults: str,
) -> dict[str, Any]:
    from ray_graceful.checkpoint import latest_committed
    from ray_graceful.health.scripted import write_faults
    from ray_graceful.ray_adapter import drain_node
    from ray_graceful.worker.process_groups import free_port

    node = None
    if kind in ("drain", "faulty"):
        node = cluster.add_node(num_cpus=2, resources={"soak_evicted": 1000})
        cluster.wait_for_nodes()
    actor = ray.remote(SoakRank)
    ranks = [
        actor.options(
            num_cpus=0, resources={"soak_evicted" if node and i == 0 else "bench_head": 1}
        ).remote()
        for i in range(len(SHARDS))
    ]
    killed: set[int] = set()
    try:
        port = free_port()
        setups = [
            r.setup.remote(i, len(ranks), port, config, kind == "hanging-save" and i == 0)
            for i, r in enumerate(ranks)
        ]
        pids = ray.get(setups, timeout=180)
        for r in ranks:
            r.train.remote(10**9, 1 << 14, 0.01)
        number = wait_training(coordinator, len(ranks))
        latest = latest_committed(config.checkpoint_dir)
        before = latest.step if latest else None
        t0 = time.time()
        if kind == "drain":
            drain_node(node.node_id, t0 + deadline_s, "soak: drain")
        elif kind == "faulty":
            fault = {"node": node.node_id, "verdict": "FAULTY", "code": "soak", "detail": "soak"}
            write_faults(faults, [fault])
        elif kind == "sigkill":
            os.kill(pids[1], signal.SIGKILL)
            killed.add(pids[1])
        else:
            if kind == "coordinator-kill":
                dead = int(coordinator.stats()["pid"])
                os.kill(dead, signal.SIGKILL)
                wait_training(coordinator, len(ranks), not_pid=dead)
            os.kill(pids[1], signal.SIGTERM)
        out_by = t0 + deadline_s + 5.0
        while any(process_alive(p) for p in pids) and time.time() < out_by:
            time.sleep(0.02)
        all_out_s = time.time() - t0
        hangs = sum(process_alive(p) for p in pids)
        outcome = coordinator.wait_outcome(timeout=deadline_s + 30, cycle=number)
        result = "no outcome" if outcome is None else str(outcome.result)
        return {
            "kind": kind,
            "cycle": number,
            "all_out_s": all_out_s,
            "hangs": hangs,
            "result": result,
            "reason": None if outcome is None else outcome.reason,
            "torn": torn_commits(coordinator, config.checkpoint_dir, number, outcome, before),
            "crashes": recorded_crashes(set(pids) - killed),
        }
    finally:
        for r in ranks:
            with contextlib.suppress(Exception):
                ray.kill(r)
        if node is not None:
            write_faults(faults, [])
            cluster.remove_node(node)


def wait_training(coordinator: Any, n: int, not_pid: int | None = None) -> int:
    """Wait until the coordinator has all ``n`` processes registered and each has told it a
    step boundary past the first two (``not_pid``: its restarted process, after a kill); the
    cycle an eviction now opens."""
    give_up = time.time() + 60
    while time.time() < give_up:
        with contextlib.suppress(Exception):
            stats = coordinator.stats(timeout=5)
            ranks = coordinator.status(timeout=5).get("ranks") or []
            steps = [r["last_step"] if r["last_step"] is not None else -1 for r in ranks]
            if stats["pid"] != not_pid and len(steps) >= n and min(steps) >= 2:
                return int(stats["cycle"])
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator never saw the {n} ranks training")


def torn_commits(coordinator: Any, root: str, cycle: int, outcome: Any, before: int | None) -> int:
    """1 if this cycle left a torn checkpoint (must stay 0): its committed step does not
    verify on disk with both shards (a memory-tier commit: once its durable copy landed), or
    a cycle that did not commit changed what the job resumes from."""
    from ray_graceful.checkpoint import latest_committed

    if outcome is not None and outcome.result in ("committed", "held"):
        if outcome.committed.get("tier") in ("memory", "held"):  # durable behind the training
            coordinator.wait_durable(cycle, timeout=60)
        latest = latest_committed(root, verify_checksums=True)
        step = int(outcome.committed["step"])
        whole = latest is not None and sorted(latest.shards) == ["soak/0", "soak/1"]
        return int(not (whole and latest is not None and latest.step >= step))
    latest = latest_committed(root, verify_checksums=True)
    return int((latest.step if latest else None) != before)


def _resources(ray: Any, coordinator: Any) -> dict[str, Any]:
    from ray_graceful.ray_adapter import live_actors

    stats = coordinator.stats()
    pid = int(stats["pid"])
    # The keeper on the coordinator's node lives through every cycle; the others come and go
    # with the nodes the soak adds and drains.
    home = coordinator.keeper_stats().get(stats["node_id"], {})
    return {
        "coordinator_rss_mb": resident_mb(pid),
        "keepers_rss_mb": resident_mb(home["pid"]) if "pid" in home else 0.0,
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "live_actors": live_actors(),
    }


def resources_table(cycles: list[dict[str, Any]], names: tuple[str, ...], warmup: int) -> str:
    """Each resource after the first cycle, after the last, and its slope per cycle once the
    first ``warmup`` cycles are left out (what a leak shows as)."""
    from ray_graceful.tools.bench.kit import markdown_table

    steady = cycles[warmup:] or cycles
    rows = [
        [
            name,
            cycles[0][name] if cycles else float("nan"),
            cycles[-1][name] if cycles else float("nan"),
            slope([float(c[name]) for c in steady]),
        ]
        for name in names
    ]
    return markdown_table(["resource", "after cycle 1", "last", "slope per cycle"], rows)


def slope(values: list[float]) -> float:
    """Least-squares change per cycle."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def _line(c: dict[str, Any]) -> str:
    return (
        f"{c['result']}, out in {c['all_out_s']:.2f}s, hangs {c['hangs']}, torn {c['torn']}, "
        f"crashes {c['crashes']}, coordinator {c['coordinator_rss_mb']:.0f} MB, "
        f"{c['threads']} threads, {c['fds']} fds, {c['live_actors']} actors"
    )


def _report(cycles: list[dict[str, Any]], kinds: list[str], args: argparse.Namespace) -> str:
    from ray_graceful.tools.bench.kit import markdown_table, percentile

    rows = []
    for kind in kinds:
        mine = [c for c in cycles if c["kind"] == kind]
        results = sorted({c["result"] for c in mine})
        counts = ", ".join(f"{sum(c['result'] == r for c in mine)} {r}" for r in results)
        outs = [c["all_out_s"] for c in mine]
        rows.append(
            [
                kind,
                len(mine),
                sum(c["hangs"] for c in mine),
                sum(c["torn"] for c in mine),
                sum(c["crashes"] for c in mine),
                counts,
                percentile(outs, 0.5),
                max(outs, default=float("nan")),
            ]
        )
    header = ["eviction", "cycles", "hangs", "torn", "Ray: crashes", "outcomes"]
    text = markdown_table([*header, "all out p50 s", "max s"], rows)
    text += "\n\n" + resources_table(cycles, RESOURCES, args.warmup)
    text += (
        f"\n{len(cycles)} cycles, {len(SHARDS)} ranks each, deadline {args.deadline:.0f}s, "
        f"memory_replicas={args.memory_replicas}; slopes over cycles {args.warmup + 1}.."
        f"{len(cycles)}"
    )
    return text
