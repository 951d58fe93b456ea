"""``ray-graceful bench <name>``: the numbers behind docs/benchmarks.md, with their baselines.

- ``release``  N ranks all-reducing on gloo (or NCCL); one rank is evicted mid-collective by
               SIGTERM, or its node is drained with a deadline. Time from the eviction to the
               first rank out, every rank out, and the coordinator's outcome - and, in the same
               run, the same job without the plugin (its survivors wait out the collective
               timeout: a lower bound of the real 600-1800 s).
- ``plan``     planning time for 1,000 / 10,000 / 100,000 ranks with mixed health and deadlines.
- ``overhead`` training step time with the plugin installed and idle, against without.
- ``save``     emergency-save throughput against the directory's raw sequential write speed
               and a plain ``torch.save``, measured in the same run; ``--tier memory``: the
               memory tier (local and peer keeper) against the durable save, and the loads.
- ``recovery`` a Ray Train run preempted mid-way: time to resumed training and steps lost,
               with the callback and without.
- ``fanout``   a real coordinator and 1,024 - 16,384 simulated ranks holding long polls: time
               from a notice to every rank holding its order, memory, idle poll rate
               (``bench_fanout.py``).

Each prints a table and writes JSON (``--json``, default ``bench-output/<name>.json``).
Every Ray benchmark starts its own local cluster in a private temp directory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..config import GracefulConfig
from ..worker.mixin import GracefulWorkerMixin
from ..worker.process_groups import free_port

BENCHMARKS = ("release", "plan", "overhead", "save", "recovery", "fanout")


# --- common ------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import ray
    import torch

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@contextlib.contextmanager
def local_cluster(
    extra_nodes: int = 0,
    head_cpus: int = 4,
    node_resources: dict[str, float] | None = None,
    object_store_bytes: int | None = None,
) -> Iterator[tuple[Any, list[Any]]]:
    """A private multi-node Ray cluster on this machine; the driver attached to it."""
    work = tempfile.mkdtemp(prefix="ray-graceful-bench-")
    os.environ["RAY_TMPDIR"] = work
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "include_dashboard": False,
            "resources": {"bench_head": 1000},
            "object_store_memory": object_store_bytes,
        },
    )
    nodes = [
        cluster.add_node(
            num_cpus=2,
            resources={f"bench_n{i}": 1000, **(node_resources or {})},
            object_store_memory=object_store_bytes,
        )
        for i in range(extra_nodes)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


# --- release -----------------------------------------------------------------------------


class BenchRank:
    """A rank that all-reduces in a loop (the job without the plugin)."""

    def start(
        self,
        rank: int,
        world: int,
        port: int,
        timeout_s: float,
        backend: str,
        config: GracefulConfig | None = None,
        imports: tuple[str, ...] = (),
    ) -> int:
        import importlib

        import torch.distributed as dist

        for module in imports:  # a real training process's import graph (transformers, ...)
            importlib.import_module(module)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.backend = backend
        self.step = 0
        if config is not None:
            self.graceful_setup("bench", shard=str(rank), config=config)  # type: ignore[attr-defined]
        return os.getpid()

    def should_stop(self, step: int | None = None) -> bool:
        return False

    def train(self, steps: int) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        device = "cuda" if self.backend == "nccl" else "cpu"
        tensor = torch.ones(1 << 18, device=device)  # 1 MiB of float32
        try:
            for _ in range(steps):
                dist.all_reduce(tensor)
                self.step += 1
                if self.should_stop(self.step):
                    break
        except Exception as exc:
            return {"released_at": time.time(), "error": str(exc)[-80:], "step": self.step}
        return {"released_at": time.time(), "error": None, "step": self.step}


class GracefulBenchRank(GracefulWorkerMixin, BenchRank):
    """The same rank with the plugin adopted."""


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
) -> dict[str, Any]:
    """One run: rank 0 on a fresh node (drained, or its process signalled), the rest on the head.

    A rank is *out* when its process is gone or, without the plugin, when its collective
    returned an error (the process itself then lingers until someone kills it).
    """
    from ..coordinator import Coordinator
    from ..ray_adapter import drain_node

    work = tempfile.mkdtemp(prefix="release-")
    config = GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        drain_poll_interval_s=drain_poll_s,
        node_agent=node_agent,
    )
    coordinator = Coordinator.start(config) if graceful else None
    cls = GracefulBenchRank if graceful else BenchRank
    gpus = 1.0 / n if backend == "nccl" else 0
    node = cluster.add_node(num_cpus=2, resources={"bench_evicted": 1000})
    cluster.wait_for_nodes()
    ranks: list[Any] = []
    try:
        port = free_port()
        for i in range(n):
            where = {"bench_evicted": 1} if i == 0 else {"bench_head": 1}
            ranks.append(
                ray.remote(cls).options(num_cpus=0, num_gpus=gpus, resources=where).remote()
            )
        pids = ray.get(
            [
                r.start.remote(
                    i, n, port, timeout_s, backend, config if graceful else None, imports
                )
                for i, r in enumerate(ranks)
            ],
            timeout=600,
        )
        training = {r.train.remote(10**9): i for i, r in enumerate(ranks)}
        time.sleep(1.0)
        t0 = time.time()
        if how == "sigterm":
            os.kill(pids[0], signal.SIGTERM)
        else:
            drain_node(node.node_id, t0 + 30.0, "bench: drain")
        out: dict[int, float] = {}
        end = t0 + timeout_s + 30
        while len(out) < n and time.time() < end:
            for i, pid in enumerate(pids):
                if i not in out and not _alive(pid):
                    out[i] = time.time()
            ready, _ = ray.wait(list(training), timeout=0)
            for ref in ready:
                i = training.pop(ref)
                try:
                    out.setdefault(i, ray.get(ref)["released_at"])
                except Exception:  # the actor died: it was out when its process went
                    out.setdefault(i, time.time())
            time.sleep(0.002)
        outcome_s = None
        if coordinator is not None:
            outcome = coordinator.wait_outcome(timeout=30, cycle=0)
            if outcome is not None and outcome.notices:
                first = min(notice["received_at"] for notice in outcome.notices)
                outcome_s = first + outcome.timings["outcome"] - t0
        from ..ray_adapter import worker_exits
        from ..worker.report import read_reports

        # From the end of each rank's teardown (its report) to its process gone: the exit path
        # (Ray's intended exit, then what the interpreter does on its way out).
        ended = {r.pid: r.started_at + (r.finished_s or 0) for r in read_reports(config.report_dir)}
        linger = [out[i] - ended[pid] for i, pid in enumerate(pids) if i in out and pid in ended]
        time.sleep(1.0)  # the GCS records a worker's end a moment after the process is gone
        recorded = worker_exits(set(pids))
        return {
            "n": n,
            "graceful": graceful,
            "how": how,
            "after_teardown_s": linger,
            "ray_recorded": recorded,
            "crashes": sum(kind == "SYSTEM_ERROR" for kind in recorded.values()),
            "exit_paths": dict(_exit_paths(os.path.join(work, "reports"))),
            "first_out_s": min(out.values()) - t0 if out else None,
            "all_out_s": max(out.values()) - t0 if len(out) == n else None,
            "stuck": n - len(out),
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
    with local_cluster(head_cpus=max(4, *sizes)) as (cluster, _nodes):
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
                    )
                    r["how"] = how
                    results.append({**r, "rep": rep})
                    print(
                        f"  {how} N={n} rep {rep}: all out {r['all_out_s']}s, "
                        f"exits {r['exit_paths']}, {r['crashes']} recorded as crashes",
                        flush=True,
                    )
                if args.baseline and not how.endswith("+agent"):
                    b = _release_once(
                        ray, cluster, n, False, how, args.timeout, args.backend, imports
                    )
                    results.append({**b, "rep": 0})
                    print(
                        f"  baseline {how} N={n}: all out {b['all_out_s']}s, {b['stuck']} stuck",
                        flush=True,
                    )
    rows = []
    for how in hows:
        for n in sizes:
            runs = [r for r in results if (r["n"], r["how"], r["graceful"]) == (n, how, True)]
            alls = [r["all_out_s"] for r in runs if r["all_out_s"] is not None]
            firsts = [r["first_out_s"] for r in runs if r["first_out_s"] is not None]
            outcomes = [r["outcome_s"] for r in runs if r["outcome_s"] is not None]
            lingers = [x for r in runs for x in r["after_teardown_s"]]
            plain = how.removesuffix("+agent")
            base = [r for r in results if (r["n"], r["how"], r["graceful"]) == (n, plain, False)]
            waited = args.timeout + 30
            if not base:
                base_text, speedup = "-", "-"
            elif base[0]["all_out_s"] is not None:
                base_text = f"{base[0]['all_out_s']:.2f}"
                speedup = f"{base[0]['all_out_s'] / statistics.median(alls):.0f}x" if alls else "-"
            else:
                base_text = f"never ({base[0]['stuck']}/{n} stuck after {waited:.0f}s)"
                speedup = f">{waited / statistics.median(alls):.0f}x" if alls else "-"
            rows.append(
                [
                    how,
                    n,
                    len(runs),
                    _pct(firsts, 0.5),
                    _pct(alls, 0.5),
                    _pct(alls, 0.9),
                    _pct(alls, 0.99),
                    max(alls) if alls else float("nan"),
                    _pct(outcomes, 0.5),
                    _pct(lingers, 0.5),
                    max(lingers) if lingers else float("nan"),
                    f"{_count(runs, 'ray_kill')} / {_count(runs, 'hard')} of {n * len(runs)}",
                    f"{sum(r['crashes'] for r in runs)}/{n * len(runs)}",
                    base_text,
                    speedup,
                ]
            )
    table = _table(
        [
            "eviction",
            "N",
            "reps",
            "first out p50 s",
            "all out p50 s",
            "p90 s",
            "p99 s",
            "max s",
            "outcome p50 s",
            "gone after teardown p50 s",
            "max s",
            "Ray-killed / hard exits",
            "Ray: crashes",
            "baseline: all out s",
            "vs baseline",
        ],
        rows,
    )
    table += (
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
    from ..ray_adapter import draining_nodes

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
        "call_ms_p50": _pct(durations, 0.5) * 1000,
        "call_ms_p99": _pct(durations, 0.99) * 1000,
        "gcs_cpu_ms_per_call": per_call_ms,
        "gcs_cpu_share_pct": per_call_ms / 1000 / interval_s * 100,
    }


# --- plan ----------------------------------------------------------------------------------


def bench_plan(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from ..health import VERDICTS
    from ..notices import EvictionNotice
    from ..plan import RankInfo, plan_termination

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
                _pct(times, 0.5) * 1000,
                min(times) * 1000,
                max(times) * 1000,
                len(plan.savers),
            ]
        )
    table = _table(
        ["ranks", "drained nodes", "health verdicts", "p50 ms", "min ms", "max ms", "shards saved"],
        rows,
    )
    return {"results": results, "table": table}


# --- overhead ------------------------------------------------------------------------------


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

    from ..coordinator import Coordinator

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
            ray.get(
                [
                    r.start.remote(i, 2, port, 60, "gloo", config if label == "with" else None)
                    for i, r in enumerate(ranks)
                ],
                timeout=120,
            )
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
    noise = {k: (_pct(v, 0.75) - _pct(v, 0.25)) for k, v in samples.items()}
    # Each round ran both groups back to back: its ratio cancels drift shared by the two.
    paired = sorted(w / wo - 1 for w, wo in zip(rounds["with"], rounds["without"], strict=True))
    delta = statistics.median(paired)
    rows = [[k, len(samples[k]), med[k] * 1e3, noise[k] * 1e3] for k in ("without", "with")]
    table = _table(["plugin", "steps", "median step ms", "IQR ms"], rows)
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


# --- save ----------------------------------------------------------------------------------


def bench_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..checkpoint import fsync_path, save_state_dict, write_shard

    directory = args.dir or tempfile.mkdtemp(prefix="save-")
    os.makedirs(directory, exist_ok=True)
    rows, results = [], []
    for mb in args.sizes:
        state = {f"layer{i}": torch.randn(mb * (1 << 20) // 4 // 16) for i in range(16)}
        nbytes = sum(t.numel() * 4 for t in state.values())
        chunk = bytearray(os.urandom(8 << 20))
        timings: dict[str, list[float]] = {
            "raw": [],
            "torch.save": [],
            "torch.save+fsync": [],
            "ray_graceful": [],
        }
        for rep in range(args.reps):
            path = os.path.join(directory, f"raw-{rep}")
            start = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                left = nbytes
                while left > 0:
                    left -= f.write(chunk[: min(len(chunk), left)])
                os.fsync(f.fileno())
            timings["raw"].append(time.perf_counter() - start)
            os.remove(path)

            path = os.path.join(directory, f"plain-{rep}.pt")
            start = time.perf_counter()
            torch.save(state, path)
            timings["torch.save"].append(time.perf_counter() - start)
            fsync_path(path)
            os.remove(path)

            path = os.path.join(directory, f"plainsync-{rep}.pt")
            start = time.perf_counter()
            torch.save(state, path)
            fsync_path(path)
            timings["torch.save+fsync"].append(time.perf_counter() - start)
            os.remove(path)

            start = time.perf_counter()
            record = write_shard(
                directory, rep, "bench", lambda p, _step, state=state: save_state_dict(state, p)
            )
            timings["ray_graceful"].append(time.perf_counter() - start)
            os.remove(os.path.join(directory, f"step-{rep:08d}", record.file))
        mbs = {k: nbytes / (1 << 20) / statistics.median(v) for k, v in timings.items()}
        results.append({"mb": mb, "bytes": nbytes, "seconds": timings, "mb_per_s": mbs})
        rows.append(
            [
                mb,
                mbs["raw"],
                mbs["torch.save"],
                mbs["torch.save+fsync"],
                mbs["ray_graceful"],
                f"{mbs['ray_graceful'] / mbs['raw'] * 100:.0f}%",
                f"{mbs['ray_graceful'] / mbs['torch.save+fsync'] * 100:.0f}%",
            ]
        )
        state.clear()  # free this size's tensors before the next
    table = _table(
        [
            "MB",
            "raw MB/s",
            "torch.save MB/s",
            "torch.save+fsync MB/s",
            "ray_graceful MB/s",
            "of raw",
            "of torch.save+fsync",
        ],
        rows,
    )
    table += (
        f"\ndirectory: {directory}; ray_graceful = torch.save to a temp name, its fsync beside "
        "a CRC32 read-back, rename, directory fsync"
    )
    return {"results": results, "table": table}


# --- recovery ------------------------------------------------------------------------------


def bench_callback_config(work: str, **settings: Any) -> GracefulConfig:
    """ray_graceful's settings in the recovery benchmarks: a fast drain poll and probe."""
    return GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        train_shards="replicated",
        expected_save_s=1.0,
        **settings,
    )


def bench_trainer(loop: dict[str, Any], callbacks: list[Any], work: str) -> Any:
    """The recovery benchmarks' TorchTrainer: 2 CPU workers on ``bench_slot`` nodes."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ..train_job import train_func

    return TorchTrainer(
        train_func,
        train_loop_config=loop,
        scaling_config=ScalingConfig(
            num_workers=2, resources_per_worker={"CPU": 0, "bench_slot": 1}
        ),
        run_config=RunConfig(
            storage_path=os.path.join(work, "storage"),
            name="run",
            callbacks=callbacks,
            failure_config=FailureConfig(max_failures=3),
        ),
    )


def _recovery_once(
    graceful: bool, total: int, every: int, step_s: float, evict_after: int, deadline_s: float
) -> dict[str, Any]:
    """One Ray Train run; its node is drained with a deadline and removed at the deadline."""

    from ..ray_adapter import available_resources_per_node, drain_node
    from ..train import GracefulTrainCallback

    with local_cluster(extra_nodes=3, head_cpus=2, node_resources={"bench_slot": 1}) as (
        cluster,
        nodes,
    ):
        work = tempfile.mkdtemp(prefix="recovery-")
        progress, attempts = os.path.join(work, "progress"), os.path.join(work, "attempts")
        callbacks = []
        if graceful:
            callbacks.append(GracefulTrainCallback(bench_callback_config(work)))
        trainer = bench_trainer(
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
        from .bench_race import bench_race

        return bench_race(args)
    if getattr(args, "tier", None) == "memory":
        from .bench_memory import bench_restart_memory

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
    table = _table(
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


# --- command line ----------------------------------------------------------------------------


def add_bench_parser(sub: Any) -> None:
    from .cli import (
        comma_choices,
        positive_int,
        positive_ints,
        positive_seconds,
        writable_dir,
        writable_file,
    )

    bench = sub.add_parser(
        "bench",
        help="benchmarks against their baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")

    release = names.add_parser("release", help="eviction to every rank out, vs the baseline")
    release.add_argument(
        "--sizes", type=positive_ints, default="2,4,8,16", help="ranks per run (default 2,4,8,16)"
    )
    release.add_argument(
        "--reps", type=positive_int, default=5, help="repetitions per size (default 5)"
    )
    release.add_argument(
        "--how",
        type=comma_choices("sigterm", "drain"),
        default="sigterm,drain",
        help="sigterm, drain or sigterm,drain (default)",
    )
    release.add_argument(
        "--timeout",
        type=positive_seconds,
        default=60.0,
        help="collective timeout; the baseline waits this long (default 60)",
    )
    release.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the runs without the plugin",
    )
    release.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="nccl needs a GPU per rank"
    )
    release.add_argument(
        "--drain-poll",
        type=positive_seconds,
        default=1.0,
        help="the coordinator's drain_poll_interval_s in these runs (default 1.0); --how drain "
        "also measures what one poll costs the GCS",
    )
    release.add_argument(
        "--node-agent",
        type=comma_choices("off", "on"),
        default="off",
        help="ranks polling the coordinator themselves (off), through their node's agent (on), "
        "or off,on to compare both in one run (rows 'sigterm+agent')",
    )
    release.add_argument(
        "--imports",
        default="",
        help="modules every rank imports first, e.g. transformers (a real import graph: "
        "what the interpreter's exit has to go through)",
    )

    plan = names.add_parser("plan", help="planning time for many ranks")
    plan.add_argument("--sizes", type=positive_ints, default="1000,10000,100000")
    plan.add_argument("--reps", type=positive_int, default=7)

    overhead = names.add_parser("overhead", help="step time with the plugin idle, vs without")
    overhead.add_argument(
        "--steps", type=positive_int, default=100, help="steps per round (default 100)"
    )
    overhead.add_argument(
        "--rounds", type=positive_int, default=12, help="alternating rounds (default 12)"
    )

    save = names.add_parser("save", help="emergency-save MB/s vs raw writes and torch.save")
    save.add_argument(
        "--sizes", type=positive_ints, default="64,256,1024", help="state dict sizes in MB"
    )
    save.add_argument("--reps", type=positive_int, default=3)
    save.add_argument(
        "--dir", type=writable_dir, help="directory to write to (default: a temp directory)"
    )
    save.add_argument(
        "--tier",
        choices=("disk", "memory"),
        default="disk",
        help="disk: today's durable save vs raw writes; memory: the memory tier (a keeper on "
        "this node and on a second one) vs the durable disk save vs torch.save, and the loads",
    )
    save.add_argument(
        "--format",
        choices=("torch", "dcp"),
        default="torch",
        help="torch: the default saver (torch.save); dcp: the emergency DCP save (dcp_saver + "
        "the commit's metadata assembly) vs an ordinary collective dcp.save vs the default "
        "saver, and a dcp.load at another world size checked bitwise",
    )
    save.add_argument(
        "--ranks", type=positive_int, default=2, help="--format dcp: saving ranks (default 2)"
    )
    save.add_argument(
        "--load-ranks",
        type=positive_int,
        default=3,
        help="--format dcp: ranks that load the emergency checkpoint (default 3)",
    )
    save.add_argument(
        "--preallocate",
        action="store_true",
        help="--tier memory: start the object stores pre-populated "
        "(RAY_preallocate_plasma_memory=1), so the first hand-off pays no page faults",
    )

    recovery = names.add_parser("recovery", help="Ray Train: preemption to resumed training")
    recovery.add_argument(
        "--total", type=positive_int, default=80, help="steps in the run (default 80)"
    )
    recovery.add_argument(
        "--every", type=positive_int, default=10, help="periodic checkpoint interval (default 10)"
    )
    recovery.add_argument("--step-s", type=positive_seconds, default=0.3, help="seconds per step")
    recovery.add_argument(
        "--evict-after", type=positive_int, default=16, help="steps before the node is drained"
    )
    recovery.add_argument(
        "--deadline",
        type=positive_seconds,
        default=10.0,
        help="drain deadline in seconds (default 10)",
    )
    recovery.add_argument(
        "--tier",
        choices=("memory",),
        help="memory: a hand-built group's restart from the memory tier against the same "
        "checkpoint on disk, same run (see --sizes, --reps, --ranks)",
    )
    recovery.add_argument(
        "--sizes",
        type=positive_ints,
        default="64,256,1024",
        help="--tier memory: MB per shard (default 64,256,1024)",
    )
    recovery.add_argument(
        "--reps", type=positive_int, default=3, help="--tier memory: repetitions (default 3)"
    )
    recovery.add_argument(
        "--ranks", type=positive_int, default=2, help="--tier memory: ranks, one shard each"
    )
    recovery.add_argument(
        "--peers",
        action="store_true",
        help="the race: no handling, Ray Train's own preemption handling (documented, and its "
        "best), and ray_graceful, through each scenario (see --scenarios)",
    )
    recovery.add_argument(
        "--scenarios",
        type=comma_choices("drain", "sigterm", "stuck", "faulty"),
        default="drain,sigterm,stuck,faulty",
        help="with --peers: drain, sigterm, stuck, faulty (default: all)",
    )
    recovery.add_argument(
        "--ways",
        type=comma_choices("none", "ray-documented", "ray-best", "graceful"),
        default="none,ray-documented,ray-best,graceful",
        help="with --peers: none, ray-documented, ray-best, graceful (default: all)",
    )

    from .bench_fanout import add_fanout_parser

    fanout = add_fanout_parser(names, positive_int, positive_ints, positive_seconds)

    from .bench_restart import add_restart_parser

    restart = add_restart_parser(names, positive_int, positive_ints, positive_seconds)

    for p in (release, plan, overhead, save, recovery, fanout, restart):
        p.add_argument(
            "--json",
            type=writable_file,
            help="where to write the results (default bench-output/<name>.json)",
        )
    bench.set_defaults(func=run_benchmark)


def _sibling(module: str) -> Any:
    """A benchmark of a sibling module, imported only when it runs."""
    return lambda args: getattr(importlib.import_module(f".{module}", __package__), module)(args)


def _bench_save(args: argparse.Namespace) -> dict[str, Any]:
    if args.format == "dcp":
        if args.tier != "disk":
            from .cli import CliError

            raise CliError(
                "bench save --format dcp measures the disk save (emergency DCP vs dcp.save); "
                "use --tier disk (the default) with it"
            )
        from .bench_dcp import bench_save_dcp

        return bench_save_dcp(args)
    if args.tier == "memory":
        from .bench_memory import bench_save_memory

        return bench_save_memory(args)
    return bench_save(args)


def run_benchmark(args: argparse.Namespace) -> int:
    run = {
        "restart": _sibling("bench_restart"),
        "release": bench_release,
        "plan": bench_plan,
        "overhead": bench_overhead,
        "save": _bench_save,
        "recovery": bench_recovery,
        "fanout": _sibling("bench_fanout"),
    }[args.bench]
    command = "ray-graceful " + " ".join(sys.argv[1:])
    started = time.time()
    out = run(args)
    out.update(
        {
            "benchmark": args.bench,
            "command": command.strip(),
            "machine": _machine(),
            "seconds": time.time() - started,
            "args": {k: v for k, v in vars(args).items() if k not in ("func",)},
        }
    )
    print(out["table"])
    path = args.json or os.path.join("bench-output", f"{args.bench}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, sort_keys=True, default=str)
    print(f"wrote {path}")
    return 0
