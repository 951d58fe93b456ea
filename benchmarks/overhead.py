"""``python -m benchmarks overhead``: training step time with the plugin adopted and idle,
against the same ranks without it, in alternating rounds on one local cluster."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from ray_graceful.config import GracefulConfig
from ray_graceful.tools.bench.kit import BenchRank, local_cluster, markdown_table, percentile
from ray_graceful.worker.mixin import GracefulWorkerMixin
from ray_graceful.worker.process_groups import free_port


class StepRank(BenchRank):
    """A training step: ~20 ms of single-threaded compute and a gradient all-reduce.

    The compute is sized like a small real step so that the per-step cost of the plugin
    (one ``should_stop`` flag read) is measured against something, not against noise.
    """

    def steps(self, count: int) -> list[float]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        weights = torch.randn(768, 768) / 768**0.5
        x0 = torch.randn(256, 768)
        grad = torch.ones(1 << 18)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            x = x0
            for _ in range(4):
                x = torch.tanh(x @ weights)
            dist.all_reduce(grad)
            self.step += 1
            self.should_stop(self.step)
            times.append(time.perf_counter() - start)
        return times


class GracefulStepRank(GracefulWorkerMixin, StepRank):
    pass


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_graceful.coordinator import Coordinator

    samples: dict[str, list[float]] = {"without": [], "with": []}
    rounds: dict[str, list[float]] = {"without": [], "with": []}
    with local_cluster() as _:
        work = tempfile.mkdtemp(prefix="overhead-")
        config = GracefulConfig(report_dir=work)
        coordinator = Coordinator.start(config)
        groups = {}
        for label, cls in (("without", StepRank), ("with", GracefulStepRank)):
            port = free_port()
            ranks = [ray.remote(cls).options(num_cpus=0).remote() for _ in range(2)]
            ray.get([r.join_group.remote(i, 2, port) for i, r in enumerate(ranks)], timeout=120)
            if label == "with":
                setups = [
                    r.graceful_setup.remote("bench", shard=str(i), config=config)
                    for i, r in enumerate(ranks)
                ]
                ray.get(setups, timeout=120)
            ray.get([r.steps.remote(50) for r in ranks], timeout=120)  # warm up
            groups[label] = ranks
        for _ in range(args.rounds):  # alternate, so drift hits both alike
            for label in ("without", "with"):
                times = ray.get([r.steps.remote(args.steps) for r in groups[label]], timeout=600)
                step_times = [max(a, b) for a, b in zip(*times, strict=True)]
                samples[label].extend(step_times)
                rounds[label].append(statistics.median(step_times))
        coordinator.shutdown()
    med = {k: statistics.median(v) for k, v in samples.items()}
    noise = {k: (percentile(v, 0.75) - percentile(v, 0.25)) for k, v in samples.items()}
    # Each round ran both groups back to back: its ratio cancels drift shared by the two.
    paired = sorted(w / wo - 1 for w, wo in zip(rounds["with"], rounds["without"], strict=True))
    delta = statistics.median(paired)
    rows = [[k, len(samples[k]), med[k] * 1e3, noise[k] * 1e3] for k in ("without", "with")]
    table = markdown_table(["plugin", "steps", "median step ms", "IQR ms"], rows)
    table += (
        f"\nwith vs without, paired by round ({len(paired)} rounds): median {delta * 100:+.2f}%, "
        f"range {paired[0] * 100:+.2f}% .. {paired[-1] * 100:+.2f}%"
    )
    return {
        "results": {
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
            "round_medians_ms": {k: [x * 1e3 for x in v] for k, v in rounds.items()},
            "paired_deltas": paired,
            "delta": delta,
        },
        "table": table,
    }
