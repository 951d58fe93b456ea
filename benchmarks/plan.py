"""``python -m benchmarks plan``: planning time for 1,000 / 10,000 / 100,000 ranks with mixed
health and deadlines - the planner alone, no Ray."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ray_graceful.config import GracefulConfig
from ray_graceful.tools.bench.kit import markdown_table, percentile


def bench_plan(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from ray_graceful.health import VERDICTS
    from ray_graceful.notices import EvictionNotice
    from ray_graceful.plan import RankInfo, plan_termination

    rng = random.Random(0)
    config = GracefulConfig(checkpoint_dir="/bench")
    rows, results = [], []
    for n in args.sizes:
        ranks = [RankInfo("g", i, f"node{i // 8}", str(i % 256)) for i in range(n)]
        health = {("g", i): rng.choice(VERDICTS) for i in range(0, n, 5)}
        now = time.time()
        notices = [
            EvictionNotice(
                "drain", "bench", 0, now + rng.uniform(5, 60), node_id=f"node{j}", received_at=now
            )
            for j in range(0, n // 8, 7)
        ]
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            plan = plan_termination(ranks, notices, health, config, now)
            times.append(time.perf_counter() - start)
        results.append(
            {"n": n, "seconds": times, "savers": len(plan.savers), "abandoned": plan.abandoned}
        )
        rows.append(
            [
                n,
                len(notices),
                len(health),
                percentile(times, 0.5) * 1000,
                min(times) * 1000,
                max(times) * 1000,
                len(plan.savers),
            ]
        )
    table = markdown_table(
        ["ranks", "drained nodes", "health verdicts", "p50 ms", "min ms", "max ms", "shards saved"],
        rows,
    )
    return {"results": results, "table": table}
