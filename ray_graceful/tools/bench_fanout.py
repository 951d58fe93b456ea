"""``ray-graceful bench fanout``: a real coordinator and N simulated ranks, the fan-out timed.

N processes are registered like real ranks (one ``Register`` each, one rank per process, on 8
simulated nodes) and hold their long polls open from a few poller actors, as N real control
threads would. Then one notice for every node: the time from the notice to the moment every
rank holds its order is what a real eviction costs before any rank can act. Also measured: the
coordinator's resident memory with N polls pending, and its idle poll rate (each rank renews
its poll every ``health_interval_s``). Each repetition is a full cycle: orders, a report from
every rank, the outcome, and everyone registered again for the next cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from ..config import GracefulConfig
from ..protocol import Ack, PollState, RankSpec, Register

POLLERS = 4
NODES = 8


class Poller:
    """Holds the long polls of many simulated ranks, as their control threads would."""

    def __init__(self, handle: Any, process_ids: list[str], wait_s: float) -> None:
        self.handle, self.ids, self.wait_s = handle, process_ids, wait_s

    async def hold(self, cycle: int) -> list[float]:
        """Poll for every rank until it has its order; the time each order arrived."""

        async def one(process_id: str) -> float:
            while True:
                answer = await self.handle.poll.remote(process_id, cycle, PollState(), self.wait_s)
                if answer.kind == "order":
                    arrived = time.time()
                    await self.handle.ack.remote(Ack(process_id, cycle, answer.order.order_id))
                    return arrived
                if answer.kind != "idle":
                    raise RuntimeError(f"{process_id}: {answer.kind} {answer.reason}")

        return list(await asyncio.gather(*(one(p) for p in self.ids)))

    async def report(self, cycle: int) -> int:
        from ..worker.report import TeardownReport

        now = time.time()
        replies = await asyncio.gather(
            *(
                self.handle.report_teardown.remote(
                    p, TeardownReport(0, "bench", "", "", [], "bench", cycle, now, now)
                )
                for p in self.ids
            )
        )
        return sum(r.accepted for r in replies)


def _register(handle: Any, n: int, job_id: str) -> None:
    import ray

    refs = [
        handle.register.remote(
            Register(
                f"p{i}",
                f"node-{i % NODES}",
                i,
                "bench",
                job_id,
                (RankSpec("g", i, n, str(i), True),),
            )
        )
        for i in range(n)
    ]
    for start in range(0, n, 2048):
        replies = ray.get(refs[start : start + 2048], timeout=600)
        refused = [r.reason for r in replies if not r.accepted]
        if refused:
            raise RuntimeError(f"registration refused: {refused[0]}")


def _wait_pending(coordinator: Any, n: int, timeout: float) -> float:
    """Until every rank's poll is held open at the coordinator; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if coordinator.stats(timeout=120)["pending_polls"] >= n:
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"only some of {n} polls were pending after {timeout}s")


def _fanout_once(ray: Any, coordinator: Any, pollers: list[Any], n: int, cycle: int) -> dict:
    import psutil

    job_id = ray.get_runtime_context().get_job_id()
    _register(coordinator.handle, n, job_id)
    held = [p.hold.remote(cycle) for p in pollers]
    _wait_pending(coordinator, n, timeout=600)
    stats = coordinator.stats(timeout=120)
    rss = psutil.Process(stats["pid"]).memory_info().rss
    polls_before, idle_start = stats["polls_served"], time.monotonic()
    time.sleep(3.0)  # idle: how often do N ranks renew their polls?
    idle = coordinator.stats(timeout=120)
    idle_rate = (idle["polls_served"] - polls_before) / (time.monotonic() - idle_start)
    t0 = time.time()
    for node in range(NODES):
        reply = coordinator.notify(
            node_id=f"node-{node}", reason="bench", deadline=t0 + 120, source="cli", timeout=120
        )
        if not reply.accepted:
            raise RuntimeError(f"notice refused: {reply.reason}")
    arrivals = [t for times in ray.get(held, timeout=600) for t in times]
    latest = max(arrivals) - t0
    reported = sum(ray.get([p.report.remote(cycle) for p in pollers], timeout=600))
    outcome = coordinator.wait_outcome(timeout=300, cycle=cycle)
    return {
        "all_ordered_s": latest,
        "median_rank_s": sorted(a - t0 for a in arrivals)[len(arrivals) // 2],
        "rss_mb": rss / 2**20,
        "idle_polls_per_s": idle_rate,
        "reported": reported,
        "result": outcome.result if outcome else None,
    }


def bench_fanout(args: argparse.Namespace) -> dict[str, Any]:
    from ..coordinator import Coordinator
    from .bench import _pct, _table, local_cluster

    rows, results = [], []
    with local_cluster(head_cpus=4) as _cluster:
        import ray

        for n in args.sizes:
            config = GracefulConfig(
                coordinator_name=f"fanout-{n}-{os.getpid()}",
                report_dir=os.path.join(os.path.abspath("bench-output"), "fanout-reports"),
                health_interval_s=args.health_interval,
                notice_gather_s=0.0,
                teardown_timeout_s=60.0,
            )
            coordinator = Coordinator.start(config)
            per = -(-n // POLLERS)
            ids = [f"p{i}" for i in range(n)]
            poller = ray.remote(Poller).options(num_cpus=0, max_concurrency=1)
            pollers = [
                poller.remote(
                    coordinator.handle, ids[k * per : (k + 1) * per], args.health_interval
                )
                for k in range(POLLERS)
            ]
            runs = []
            try:
                for rep in range(args.reps):
                    runs.append(_fanout_once(ray, coordinator, pollers, n, cycle=rep))
                    print(f"  n={n} rep {rep}: {runs[-1]}", flush=True)
            finally:
                for p in pollers:
                    ray.kill(p)
                coordinator.shutdown()
            ordered = [r["all_ordered_s"] for r in runs]
            results.append({"n": n, "runs": runs})
            rows.append(
                [
                    n,
                    _pct(ordered, 0.5),
                    _pct(ordered, 0.9),
                    _pct([r["median_rank_s"] for r in runs], 0.5),
                    max(r["rss_mb"] for r in runs),
                    _pct([r["idle_polls_per_s"] for r in runs], 0.5),
                ]
            )
    table = _table(
        [
            "ranks",
            "all ordered p50 s",
            "p90 s",
            "median rank s",
            "coordinator RSS MB",
            "idle polls/s",
        ],
        rows,
    )
    return {"results": results, "table": table}
