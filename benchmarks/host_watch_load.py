"""``python -m benchmarks host-watch-load``: false alarms of the host watch on a loaded cluster.

Before ``host_watch`` can be on by default it must not declare a healthy host lost where it
would hurt: a cluster whose every core is busy. **Real**, as ``host-loss`` is
(``benchmarks/hosts.py``): ``--hosts`` network namespaces, each with its own raylet, one gloo
rank adopting the plugin and a busy process beside it (a Python loop that never sleeps); a
coordinator with ``host_watch=True`` on the head, which runs a busy process of its own; the
ranks train in one group, and every step makes ``--garbage`` cyclic objects, so that Python's
collector pauses each rank again and again, and forces a full collection every 50 steps. Every
host shares this machine's 2 cores: with ``--hosts 8``, 9 busy loops, 8 ranks, 9 raylets and the
coordinator, the cores are saturated many times over - far more than a real cluster's hosts,
each with cores of its own.

For ``--minutes``, every 5 s: the hosts the watch declared lost (each a false alarm: no host
failed), the probes that found a suspected host alive, and whether every rank still trains.
Then, with the load still on, ``--crashes`` jobs - each a pair of hosts, a coordinator of its
own and four ranks, set up and training from before the load (on a machine this loaded a new
raylet does not start within Ray's bound, nor new ranks set up within 120 s) - have one host
crashed in turn (every process SIGKILLed, as ``host-loss --faults crash``): the seconds from
the crash to the survivors' release and to the cycle's outcome, noticed by whom. A training
that stops before the stop file is said with why (what the ranks returned, the cycle's notices).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from .host_loss import HostLossRank, _config, _Job, add_pair, time_fault, wait_watched

BUSY = [sys.executable, "-c", "while True: pass"]
SAMPLE_S = 5.0


class LoadedRank(HostLossRank):
    """A rank whose every step leaves cyclic garbage, so that the collector pauses it."""

    def train_with_garbage(self, stop_file: str, objects: int, pause_s: float) -> dict[str, Any]:
        """Train until ``stop_file`` exists; the ranks agree on the step to stop at (a MAX of
        their flags each step), so none is left in a collective."""
        import torch
        import torch.distributed as dist

        tensor = torch.ones(1 << 10)
        pauses: list[float] = []
        try:
            while True:
                dist.all_reduce(tensor)
                done = torch.tensor([float(os.path.exists(stop_file))])
                dist.all_reduce(done, op=dist.ReduceOp.MAX)
                if done.item():
                    break
                junk = [{"i": i} for i in range(objects)]
                for a, b in itertools.pairwise(junk):
                    a["next"], b["prev"] = b, a  # cycles: only the collector frees them
                del junk
                self.update()
                self.step += 1
                if self.step % 50 == 0:
                    started = time.perf_counter()
                    gc.collect()
                    pauses.append(time.perf_counter() - started)
                if self.should_stop(self.step):
                    break
                time.sleep(pause_s)
        except Exception as exc:
            return {"error": str(exc)[-120:], "step": self.step, "gc_max_s": max(pauses or [0])}
        return {"error": None, "step": self.step, "gc_max_s": max(pauses or [0])}


def add_host_watch_load_parser(names: Any) -> Any:
    """``python -m benchmarks host-watch-load``'s options."""
    from ray_graceful.tools.arguments import count, positive_int, positive_seconds

    p = names.add_parser(
        "host-watch-load", help="the host watch's false alarms on loaded real hosts"
    )
    p.add_argument("--hosts", type=positive_int, default=8, help="hosts, a rank each (default 8)")
    p.add_argument("--minutes", type=positive_seconds, default=30.0, help="loaded run (default 30)")
    p.add_argument(
        "--garbage", type=positive_int, default=20000,
        help="cyclic objects each rank makes per step (default 20000)",
    )  # fmt: skip
    p.add_argument(
        "--crashes", type=count, default=5, help="crashes timed under the load (default 5)"
    )
    return p


def _busy(log_dir: str, hosts: Any, made: list[Any]) -> list[subprocess.Popen]:
    """One busy loop on every host and one on the head (this namespace); ours to end."""
    loops = [
        hosts.start_process(h, BUSY, os.path.join(log_dir, f"busy-{h.namespace}.log")) for h in made
    ]
    loops.append(subprocess.Popen(BUSY, start_new_session=True))
    return loops


def _sample(coordinator: Any, training: list[Any]) -> dict[str, Any]:
    import ray

    watch = coordinator.status()["host_watch"]
    return {
        "lost": len(watch["lost"]),
        "watched": len(watch["hosts"]),
        "probed_alive": watch["alive_after_suspicion"],
        "training": not ray.wait(training, timeout=0)[0],
    }


def _why_stopped(coordinator: Any, training: list[Any]) -> dict[str, Any]:
    """A rank's training ended before the stop file: what it returned, and the cycle (if any)
    the plugin ran - its notices and result - so that the row says why, not only that."""
    import ray

    done, _ = ray.wait(training, num_returns=len(training), timeout=0)
    ended: list[Any] = []
    for ref in done:
        try:
            ended.append(ray.get(ref, timeout=5))
        except Exception as exc:
            ended.append(f"{type(exc).__name__}: {exc}"[:300])
    outcome = coordinator.wait_outcome(timeout=1.0)
    cycle = None
    if outcome is not None:
        cycle = {
            "result": str(outcome.result),
            "notices": [f"{n.get('source')}: {n.get('reason')}"[:120] for n in outcome.notices][:4],
            "reason": outcome.reason[:200],
        }
    return {"ranks_ended": ended[:4], "cycle": cycle}


def bench_host_watch_load(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import ray

    from benchmarks.hosts import HostCluster, unavailable
    from ray_graceful import Coordinator
    from ray_graceful.tools.bench.kit import markdown_table, percentile

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"host-watch-load needs network namespaces: {reason}")
    tag = uuid.uuid4().hex[:8]
    samples: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    loops: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="rg-watch-load-") as tmp, HostCluster() as hosts:
        try:
            made = [
                hosts.add_host(num_cpus=1, resources={f"H{i}-{tag}": 1}) for i in range(args.hosts)
            ]
            # Jobs to crash under the load, trained on from before it: under the load, new
            # ranks (Ray's workers, at niceness 15 beside busy loops at 0) did not set up
            # within 120 s, nor a new raylet start within Ray's bound.
            jobs = [_Job(hosts, tmp, watch=True, pair=add_pair(hosts)) for _ in range(args.crashes)]
            config = _config(tmp, tag, watch=True)
            coordinator = Coordinator.start(config)
            actor = ray.remote(num_cpus=0)(LoadedRank)
            env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}}
            ranks = [
                actor.options(resources={f"H{i}-{tag}": 0.1}, runtime_env=env).remote()
                for i in range(args.hosts)
            ]
            port = random.randint(20000, 40000)
            ray.get(
                [
                    r.setup.remote(i, len(ranks), made[0].ip, port, config)
                    for i, r in enumerate(ranks)
                ],
                timeout=300,
            )
            wait_watched(coordinator, args.hosts, timeout_s=60)
            stop_file = os.path.join(tmp, "stop")
            training = [r.train_with_garbage.remote(stop_file, args.garbage, 0.01) for r in ranks]
            loops = _busy(tmp, hosts, made)
            started = time.monotonic()
            while time.monotonic() < started + args.minutes * 60:
                time.sleep(SAMPLE_S)
                sample = _sample(coordinator, training)
                sample["at_s"] = round(time.monotonic() - started, 1)
                samples.append(sample)
                if len(samples) % 12 == 0 or sample["lost"] or not sample["training"]:
                    print(f"  {sample}", flush=True)
                if not sample["training"] and not any("stopped" in s for s in samples):
                    sample["stopped"] = _why_stopped(coordinator, training)
                    print(f"  training stopped: {sample['stopped']}", flush=True)
            for job in jobs:
                try:
                    run = time_fault(job, "crash", "watch")
                except Exception as exc:  # said in the row; the loaded run's samples stand
                    run = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
                finally:
                    job.end()
                print(f"  crash under load: {run}", flush=True)
                crashes.append(run)
            samples.append({**_sample(coordinator, training), "at_s": "after the crashes"})
            open(stop_file, "w").close()
            ended = ray.get(training, timeout=300)
            coordinator.shutdown()
        finally:
            for loop in loops:
                if loop.poll() is None:
                    os.killpg(loop.pid, signal.SIGKILL)
                loop.wait(10)
    last = samples[-1] if samples else {"lost": None, "probed_alive": None}
    not_training = sum(not s["training"] for s in samples)
    timed = [c for c in crashes if "failed" not in c]
    released = [c["released_s"] for c in timed if c["released_s"] is not None]
    outcome = [c["outcome_s"] for c in timed if c["outcome_s"] is not None]
    table = markdown_table(
        ["hosts", "minutes", "false alarms", "probed alive", "samples not training",
         "rank steps", "longest forced GC s"],
        [[args.hosts, f"{args.minutes:g}", last["lost"], last["probed_alive"],
          f"{not_training} of {len(samples)}",
          f"{min(e['step'] for e in ended)}-{max(e['step'] for e in ended)}",
          f"{max(e['gc_max_s'] for e in ended):.3f}"]],
    )  # fmt: skip
    if crashes:
        table += "\n\nCrashes under the load (seconds from the crash):\n\n" + markdown_table(
            ["crashes timed", "released p50 / max s", "outcome p50 / max s", "noticed by"],
            [[
                f"{len(timed)} of {len(crashes)}",
                f"{percentile(released, 0.5):.2f} / {max(released):.2f}" if released else "-",
                f"{percentile(outcome, 0.5):.2f} / {max(outcome):.2f}" if outcome else "-",
                ", ".join(sorted({str(c["source"]) for c in timed})),
            ]],
        )  # fmt: skip
    return {"table": table, "samples": samples, "crashes": crashes, "ranks": ended}
