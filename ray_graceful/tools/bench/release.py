"""``ray-graceful bench release``: from an eviction to every rank released and every process
gone, against the same job without the plugin, on a private local cluster.

N ranks all-reduce on gloo (or NCCL); rank 0 runs on a node of its own. It is evicted
mid-collective by SIGTERM to its process, or its node is drained with a deadline. Measured:
the first rank and every rank released from its collective, every rank's process gone, the
coordinator's outcome, how each process left (Ray's intended exit, a forced one, a hard exit)
and what Ray recorded as crashes. In the same run, the baseline: the same job without the
plugin, whose survivors wait out the collective timeout (a lower bound of the real 600-1800 s).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from typing import Any

from ...config import GracefulConfig
from ...worker.mixin import GracefulWorkerMixin
from ...worker.process_groups import free_port
from .kit import (
    BenchRank,
    ExitWatch,
    gpu_count,
    local_cluster,
    markdown_table,
    percentile,
    rank_gpus,
    start_ranks,
)


class GracefulBenchRank(GracefulWorkerMixin, BenchRank):
    """The same rank with the plugin adopted."""

    def register_extra_groups(self) -> None:
        """The weight-sync groups: released with the default one (``graceful_add_group``)."""
        for i, group in enumerate(self.extra_groups):
            self.graceful_add_group(group, f"extra-{i}")


def _exit_paths(report_dir: str) -> collections.Counter[str]:
    """How the ranks left, by their reports' ``exit_path``: "ray_intended" is the healthy way,
    "ray_kill" Ray's forced intended exit (a task that could not return), "hard" an os._exit."""
    paths: collections.Counter[str] = collections.Counter()
    for base, _dirs, files in os.walk(report_dir):
        for name in files:
            if name.startswith("teardown-") and name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(base, name)) as f:
                    paths[str(json.load(f).get("exit_path"))] += 1
    return paths


def _count(runs: list[dict[str, Any]], exit_path: str) -> int:
    return sum(r["exit_paths"].get(exit_path, 0) for r in runs)


def _release_once(
    ray: Any,
    cluster: Any,
    n: int,
    graceful: bool,
    how: str,
    timeout_s: float,
    backend: str,
    imports: tuple[str, ...] = (),
    drain_poll_s: float = 1.0,
    node_agent: str = "off",
    groups: int = 1,
) -> dict[str, Any]:
    """One run: rank 0 on a fresh node (drained, or its process signalled), the rest on the head.

    Two moments per rank. *Released*: its training call returned - out of its collective, the
    time the rank itself took as it left (or its process's end, if that came first: a rank
    that died inside its collective). *Gone*: its process ended, as the kernel reports it.
    Without the plugin a released rank's process lingers until someone kills it, so the
    baseline has no "gone".
    """
    from ...coordinator import Coordinator
    from ...ray_adapter import drain_node

    work = tempfile.mkdtemp(prefix="release-")
    config = GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        drain_poll_interval_s=drain_poll_s,
        node_agent=node_agent,
    )
    coordinator = Coordinator.start(config) if graceful else None
    cls = GracefulBenchRank if graceful else BenchRank
    machine_gpus = gpu_count() if backend == "nccl" else 0
    gpus = rank_gpus(backend, n, machine_gpus)
    node = cluster.add_node(num_cpus=2, num_gpus=machine_gpus, resources={"bench_evicted": 1000})
    cluster.wait_for_nodes()
    ranks: list[Any] = []
    try:
        port = free_port()
        joining = time.monotonic()
        for i in range(n):
            where = {"bench_evicted": 1} if i == 0 else {"bench_head": 1}
            ranks.append(
                ray.remote(cls).options(num_cpus=0, num_gpus=gpus, resources=where).remote()
            )
        pids = start_ranks(
            ray,
            ranks,
            lambda i, r: r.join_group.remote(i, n, port, backend, timeout_s, imports, groups),
            f"num_gpus={gpus} (rank 0 on the node to be evicted, the others on the head)",
        )
        joined_s = time.monotonic() - joining
        if graceful:
            ray.get(
                [
                    r.graceful_setup.remote("bench", shard=str(i), config=config)
                    for i, r in enumerate(ranks)
                ],
                timeout=120,
            )
            if groups > 1:
                ray.get([r.register_extra_groups.remote() for r in ranks], timeout=120)
        training = {r.train.remote(10**9): i for i, r in enumerate(ranks)}
        time.sleep(1.0)
        watch = ExitWatch(pids)  # blocks in the kernel: no CPU taken from the leaving ranks
        t0 = time.time()
        if how == "sigterm":
            os.kill(pids[0], signal.SIGTERM)
        else:
            drain_node(node.node_id, t0 + 30.0, "bench: drain")
        released: dict[int, float] = {}
        end = t0 + timeout_s + 30
        try:
            while time.time() < end:
                if training:  # returns as soon as one call ends, or after 20 ms
                    ready, _ = ray.wait(list(training), num_returns=1, timeout=0.02)
                elif graceful and len(watch.gone) < n:
                    ready = []
                    watch.changed.wait(0.02)
                else:
                    break
                watch.changed.clear()
                for ref in ready:
                    i = training.pop(ref)
                    with contextlib.suppress(Exception):  # died inside it: released by its end
                        released[i] = ray.get(ref)["released_at"]
        finally:
            watch.close()
        gone = {i: watch.gone[pid] for i, pid in enumerate(pids) if pid in watch.gone}
        for i, at in gone.items():
            released[i] = min(released.get(i, at), at)
        outcome_s = None
        if coordinator is not None:
            outcome = coordinator.wait_outcome(timeout=30, cycle=0)
            if outcome is not None and outcome.notices:
                first = min(notice["received_at"] for notice in outcome.notices)
                outcome_s = first + outcome.timings["outcome"] - t0
        from ...ray_adapter import worker_exits
        from ...worker.report_file import read_reports

        # From the end of each rank's teardown (its report) to its process gone: the exit path
        # (Ray's intended exit, then what the interpreter does on its way out).
        ended = {r.pid: r.started_at + (r.finished_s or 0) for r in read_reports(config.report_dir)}
        linger = [gone[i] - ended[pid] for i, pid in enumerate(pids) if i in gone and pid in ended]
        time.sleep(1.0)  # the GCS records a worker's end a moment after the process is gone
        recorded = worker_exits(set(pids))
        return {
            "n": n,
            "graceful": graceful,
            "how": how,
            "joined_s": joined_s,
            "after_teardown_s": linger,
            "ray_recorded": recorded,
            "crashes": sum(kind == "SYSTEM_ERROR" for kind in recorded.values()),
            "exit_paths": dict(_exit_paths(os.path.join(work, "reports"))),
            "first_released_s": min(released.values()) - t0 if released else None,
            "all_released_s": max(released.values()) - t0 if len(released) == n else None,
            "all_gone_s": max(gone.values()) - t0 if graceful and len(gone) == n else None,
            "stuck": n - len(released),
            "outcome_s": outcome_s,
        }
    finally:
        for r in ranks:
            with contextlib.suppress(Exception):
                ray.kill(r)
        if coordinator is not None:
            coordinator.shutdown()
        cluster.remove_node(node)


def bench_release(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    results: list[dict[str, Any]] = []
    sizes = list(args.sizes)
    hows = [  # each eviction, without and with node agents ("sigterm+agent")
        how if agent == "off" else f"{how}+agent"
        for agent in args.node_agent.split(",")
        for how in args.how.split(",")
    ]
    imports = tuple(m for m in (args.imports or "").split(",") if m)
    poll_cost = None
    starting = time.monotonic()
    gpus = gpu_count() if args.backend == "nccl" else 0
    with local_cluster(head_cpus=max(4, *sizes), num_gpus=gpus) as (cluster, _nodes):
        # Progress before the first repetition: where a run stalls (a GPU machine's first NCCL
        # run printed nothing for minutes) shows which stage it stalled in.
        print(f"  local cluster up in {time.monotonic() - starting:.1f}s", flush=True)
        if "drain" in hows:
            poll_cost = _drain_poll_cost(cluster, args.drain_poll)
            print(f"  drain poll cost: {poll_cost}", flush=True)
        for how in hows:
            for n in sizes:
                for rep in range(args.reps):
                    r = _release_once(
                        ray,
                        cluster,
                        n,
                        True,
                        how.removesuffix("+agent"),
                        args.timeout,
                        args.backend,
                        imports,
                        args.drain_poll,
                        "on" if how.endswith("+agent") else "off",
                        args.groups,
                    )
                    r["how"] = how
                    results.append({**r, "rep": rep})
                    print(
                        f"  {how} N={n} rep {rep}: joined in {r['joined_s']:.1f}s, "
                        f"all released {r['all_released_s']}s, all gone {r['all_gone_s']}s, "
                        f"exits {r['exit_paths']}, {r['crashes']} recorded as crashes",
                        flush=True,
                    )
                if args.baseline and not how.endswith("+agent"):
                    b = _release_once(
                        ray,
                        cluster,
                        n,
                        False,
                        how,
                        args.timeout,
                        args.backend,
                        imports,
                        groups=args.groups,
                    )
                    results.append({**b, "rep": 0})
                    print(
                        f"  baseline {how} N={n}: all released {b['all_released_s']}s, "
                        f"{b['stuck']} stuck",
                        flush=True,
                    )
    rows = []
    for how in hows:
        for n in sizes:
            runs = [r for r in results if (r["n"], r["how"], r["graceful"]) == (n, how, True)]
            alls = [r["all_released_s"] for r in runs if r["all_released_s"] is not None]
            firsts = [r["first_released_s"] for r in runs if r["first_released_s"] is not None]
            gones = [r["all_gone_s"] for r in runs if r["all_gone_s"] is not None]
            outcomes = [r["outcome_s"] for r in runs if r["outcome_s"] is not None]
            lingers = [x for r in runs for x in r["after_teardown_s"]]
            plain = how.removesuffix("+agent")
            base = [r for r in results if (r["n"], r["how"], r["graceful"]) == (n, plain, False)]
            waited = args.timeout + 30
            if not base:
                base_text, speedup = "-", "-"
            elif base[0]["all_released_s"] is not None:
                base_text = f"{base[0]['all_released_s']:.2f}"
                speedup = (
                    f"{base[0]['all_released_s'] / statistics.median(alls):.0f}x" if alls else "-"
                )
            else:
                base_text = f"never ({base[0]['stuck']}/{n} stuck after {waited:.0f}s)"
                speedup = f">{waited / statistics.median(alls):.0f}x" if alls else "-"
            rows.append(
                [
                    how,
                    n,
                    len(runs),
                    percentile(firsts, 0.5),
                    percentile(alls, 0.5),
                    percentile(alls, 0.9),
                    percentile(alls, 0.99),
                    max(alls) if alls else float("nan"),
                    percentile(gones, 0.5),
                    percentile(gones, 0.99),
                    percentile(outcomes, 0.5),
                    percentile(lingers, 0.5),
                    max(lingers) if lingers else float("nan"),
                    f"{_count(runs, 'ray_kill')} / {_count(runs, 'hard')} of {n * len(runs)}",
                    f"{sum(r['crashes'] for r in runs)}/{n * len(runs)}",
                    base_text,
                    speedup,
                ]
            )
    table = markdown_table(
        [
            "eviction",
            "N",
            "reps",
            "first released p50 s",
            "all released p50 s",
            "p90 s",
            "p99 s",
            "max s",
            "all gone p50 s",
            "p99 s",
            "outcome p50 s",
            "gone after teardown p50 s",
            "max s",
            "Ray-killed / hard exits",
            "Ray: crashes",
            "baseline: all released s",
            "vs baseline",
        ],
        rows,
    )
    table += (
        "\nreleased: a rank's training call returned (out of its collective); gone: its "
        "process ended (pidfd)"
        f"\nbaseline: the same job without the plugin, collective timeout "
        f"{args.timeout:.0f}s (the real default is 600 s for NCCL, 1800 s for gloo)"
    )
    if poll_cost is not None:
        table += (
            f"\ndrain poll every {args.drain_poll}s: one poll {poll_cost['call_ms_p50']:.2f} ms "
            f"p50 ({poll_cost['call_ms_p99']:.2f} ms p99) from the coordinator's side; the "
            f"GCS spends {poll_cost['gcs_cpu_ms_per_call']:.3f} ms CPU per poll, "
            f"{poll_cost['gcs_cpu_share_pct']:.3f} % of one core at this interval"
        )
    return {"results": results, "table": table, "drain_poll_cost": poll_cost}


def _drain_poll_cost(cluster: Any, interval_s: float, calls: int = 2000) -> dict[str, float]:
    """What polling Ray's drain state costs: per call, and on the GCS's CPU.

    ``calls`` polls back to back (the call the coordinator's watcher makes), and the GCS
    process's CPU time over them minus its CPU time over an idle stretch of the same length.
    """
    from ...ray_adapter import draining_nodes

    gcs = cluster.head_node.all_processes["gcs_server"][0].process.pid

    def cpu_s() -> float:
        with open(f"/proc/{gcs}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    draining_nodes()  # connect first
    durations = []
    cpu0, t0 = cpu_s(), time.perf_counter()
    for _ in range(calls):
        start = time.perf_counter()
        draining_nodes()
        durations.append(time.perf_counter() - start)
    busy_cpu, wall = cpu_s() - cpu0, time.perf_counter() - t0
    cpu1 = cpu_s()
    time.sleep(wall)
    idle_cpu = cpu_s() - cpu1
    per_call_ms = max(busy_cpu - idle_cpu, 0.0) * 1000 / calls
    return {
        "calls": calls,
        "call_ms_p50": percentile(durations, 0.5) * 1000,
        "call_ms_p99": percentile(durations, 0.99) * 1000,
        "gcs_cpu_ms_per_call": per_call_ms,
        "gcs_cpu_share_pct": per_call_ms / 1000 / interval_s * 100,
    }
