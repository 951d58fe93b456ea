"""``python -m benchmarks watcher``: what one round of the lost-rank watcher asks of the GCS.

Every ``drain_poll_interval_s`` (0.25 s by default) the coordinator asks the GCS which of its
rank actors died (``ray_adapter.dead_actors``). This times one round for each of ``--sizes``
watched actors, both ways, in the same run on the same cluster:

- ``per actor``: one ``actor_table`` lookup per actor (what the watcher did at every size, and
  still does up to 64 actors);
- ``per job``: one call for the job's DEAD actors, filtered by the GCS (what it does past 64).

**Real:** a local Ray cluster's GCS and every call to it; ``--dead`` actors of this job really
started and killed, so the job's DEAD list is not empty and the answer must name them.
**Simulated:** the live watched actors are ids of this job that the GCS never saw
(``ActorID.of``; 16,384 real actors do not fit on 2 cores). The GCS answers a lookup of one with
"not found" instead of a live actor's record; ``--dead`` real lookups are timed beside them
(``found`` column) to show what a lookup that finds its actor costs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def _timed(call: Any, reps: int) -> tuple[list[float], Any]:
    times, answer = [], None
    for _ in range(reps):
        started = time.perf_counter()
        answer = call()
        times.append(time.perf_counter() - started)
    return times, answer


def bench_watcher(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.ray_adapter import dead_actors
    from ray_graceful.tools.bench.kit import local_cluster, markdown_table, percentile

    rows, results = [], []
    with local_cluster(head_cpus=2) as _cluster:
        import ray

        @ray.remote(num_cpus=0)
        class Gone:
            def actor_id(self) -> str:
                return ray.get_runtime_context().get_actor_id()

        started = [Gone.remote() for _ in range(args.dead)]
        dead = set(ray.get([a.actor_id.remote() for a in started], timeout=120))
        for actor in started:
            ray.kill(actor)
        deadline = time.monotonic() + 60
        while dead_actors(dead) != dead:
            if time.monotonic() > deadline:
                raise RuntimeError("the killed actors were not listed DEAD within 60 s")
            time.sleep(0.1)
        job = ray.get_runtime_context().get_job_id()
        job_id = ray.JobID.from_hex(job)
        task = ray.TaskID.for_driver_task(job_id)
        found, _ = _timed(lambda: dead_actors(dead, one_call_above=len(dead)), args.reps)
        found_ms = percentile(found, 0.5) / max(len(dead), 1) * 1000
        for n in args.sizes:
            live = {ray.ActorID.of(job_id, task, 1_000_000 + i).hex() for i in range(n - len(dead))}
            watched = live | dead
            one_each, a = _timed(lambda w=watched: dead_actors(w, one_call_above=len(w)), args.reps)
            per_job, b = _timed(lambda w=watched: dead_actors(w, one_call_above=0), args.reps)
            if a != dead or b != dead:
                raise RuntimeError(f"at {n}: per actor named {len(a)}, per job {len(b)} dead")
            results.append({"n": n, "per_actor_s": one_each, "per_job_s": per_job})
            p50_each, p50_job = percentile(one_each, 0.5), percentile(per_job, 0.5)
            rows.append(
                [
                    n,
                    len(dead),
                    p50_each * 1000,
                    n,
                    p50_job * 1000,
                    1,
                    found_ms,
                    p50_each / args.interval,
                ]
            )
            print(f"  n={n}: per actor {p50_each:.4f}s, per job {p50_job:.5f}s", flush=True)
    header = [
        "watched actors",
        "of them dead",
        "per actor: round p50 ms",
        "GCS calls",
        "per job: round p50 ms",
        "GCS calls",
        "found lookup ms",
        f"per actor: share of a {args.interval} s interval",
    ]
    return {"results": results, "table": markdown_table(header, rows)}


def add_watcher_parser(names: Any) -> Any:
    """``python -m benchmarks watcher``'s options."""
    from ray_graceful.tools.arguments import positive_int, positive_ints, positive_seconds

    watcher = names.add_parser("watcher", help="one round of the lost-rank watcher, in the GCS")
    watcher.add_argument(
        "--sizes",
        type=positive_ints,
        default="1024,4096,16384",
        help="watched actors (default 1024,4096,16384)",
    )
    watcher.add_argument(
        "--dead", type=positive_int, default=8, help="real actors started and killed (8)"
    )
    watcher.add_argument("--reps", type=positive_int, default=5, help="repetitions (default 5)")
    watcher.add_argument(
        "--interval",
        type=positive_seconds,
        default=0.25,
        help="the watcher's interval, drain_poll_interval_s (default 0.25)",
    )
    return watcher
