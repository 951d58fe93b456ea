"""A user's driver, run as its own Ray job with the plugin switched on job-wide.

argv: KIND ADDRESS ENV_JSON WORKDIR EVICT
  KIND      sync | async | train | train-evicted | train-warm | warm-sync | warm-async
            (train-warm: the same Train job on the warm path, GracefulTorchConfig)
  ENV_JSON  the env vars a guide tells the user to set (the Anyscale option's output, a KubeRay
            pod's env): they are this driver's environment already (the test starts it so) and
            become the job's runtime_env - nothing is set per actor.
  EVICT     "sigterm" (a rank's process gets SIGTERM) or a shell command run as-is (the KubeRay
            preStop hook from examples/kuberay_raycluster.yaml).

Runs a normal training that must finish unharmed, then one that is evicted mid-run, and prints
one JSON line, ``{"result": ...}``, for the test to check.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

import ray

kind, address, env_path, workdir, evict = sys.argv[1:6]
with open(env_path) as f:
    job_env = json.load(f)
ray.init(address=address, runtime_env={"env_vars": job_env}, logging_level="WARNING")

from ray_graceful import Coordinator, latest_committed  # noqa: E402
from ray_graceful.worker.process_groups import free_port  # noqa: E402
from tests import actors, warm_actors  # noqa: E402

result: dict = {"kind": kind}


def evict_now(pid: int | None) -> None:
    result["evicted_at"] = time.time()
    if evict == "sigterm":
        result["evict"] = {"sigterm_to": pid}
        os.kill(pid, signal.SIGTERM)
        return
    done = subprocess.run(
        [*shlex.split(evict), "--address", address], capture_output=True, text=True, timeout=60
    )
    result["evict"] = {"status": done.returncode, "out": done.stdout + done.stderr}


def actor_group() -> None:
    coordinator = Coordinator.start()  # the driver's one line; its config comes from the env
    cls = actors.GracefulTrainer if kind == "sync" else actors.AsyncGracefulTrainer
    port = free_port()
    ranks = [ray.remote(cls).options(num_cpus=0).remote() for _ in range(2)]
    statuses = ray.get(
        [r.setup.remote(i, 2, "127.0.0.1", port, None) for i, r in enumerate(ranks)], timeout=120
    )
    result["statuses"] = statuses
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)

    # A normal run: trains, finishes, nothing happens.
    result["normal"] = ray.get([r.train.remote(3) for r in ranks], timeout=60)
    status = coordinator.status()
    result["after_normal"] = {
        k: status[k] for k in ("cycle", "tearing_down", "notices", "rejected", "failures")
    }
    watch, heard_by = status["host_watch"], time.time() + 20
    while watch is not None and not watch["hosts"] and time.time() < heard_by:
        time.sleep(0.1)  # on (RAY_GRACEFUL_HOST_WATCH): until this node's agent beats
        watch = coordinator.status()["host_watch"]
    result["host_watch"] = watch

    # An eviction in the middle of a run.
    training = [r.train.remote(100_000, 0.01) for r in ranks]
    time.sleep(1.5)
    evict_now(pids[0])
    outcome = coordinator.wait_outcome(timeout=90, cycle=0)
    ended = []
    for ref in training:
        try:
            ended.append(f"returned {ray.get(ref, timeout=30)}")
        except ray.exceptions.RayError as exc:  # the actor left; or its collective was released
            ended.append(f"raised {type(exc).__name__}")
    result["ended"] = ended
    result["outcome"] = None if outcome is None else outcome.to_dict()
    ckpt = latest_committed(os.environ["RAY_GRACEFUL_CHECKPOINT_DIR"])
    result["committed"] = None if ckpt is None else ckpt.step
    coordinator.job_finished()


def train_run() -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from benchmarks.train_job import train_func, warm_train_func
    from ray_graceful.train import GracefulTorchConfig

    warm = kind == "train-warm"

    def run(total: int, step_s: float, name: str, evicting: bool) -> dict:
        names = ("progress", "attempts", "final")
        files = {k: os.path.join(workdir, f"{name}-{k}") for k in names}
        trainer = TorchTrainer(
            warm_train_func if warm else train_func,
            train_loop_config={
                "total": total,
                "every": 100,
                "step_s": step_s,
                "progress": files["progress"],
                "attempt_file": files["attempts"],
                "final": files["final"],
            },
            scaling_config=ScalingConfig(num_workers=2),
            torch_config=GracefulTorchConfig() if warm else TorchConfig(),
            run_config=RunConfig(
                name=name,
                storage_path=tempfile.mkdtemp(dir=workdir),
                failure_config=FailureConfig(max_failures=2),
            ),  # no callbacks=: RAY_TRAIN_CALLBACKS in the job's env adds ours
        )
        if evicting:
            threading.Thread(
                target=evict_when_registered, args=(files["attempts"],), daemon=True
            ).start()
        fit = trainer.fit()
        with open(files["attempts"]) as f:
            lines = [line.split() for line in f if line.split()[1] == "start"]
        return {
            "error": repr(fit.error) if fit.error else None,
            "starts": sorted({int(line[2]) for line in lines}),
            "started_again": sorted(int(line[0]) for line in lines[2:]),  # ranks
        }

    def evict_when_registered(attempts: str) -> None:
        """Evict once this run's two workers (their pids from ``attempts``) are registered.

        Not just "two ranks registered": the previous run's coordinator may still be shutting
        down with the previous run's (finished) workers listed.
        """
        for _ in range(480):
            try:
                with open(attempts) as f:
                    pids = {int(line.split()[4]) for line in f if line.split()[1] == "start"}
                coordinator = Coordinator.connect()  # this job's, started by the callback
                registered = {r["pid"] for r in coordinator.status()["ranks"]}
                if len(pids) == 2 and registered == pids:
                    break
            except Exception as exc:
                result["evict_waiting"] = repr(exc)
            time.sleep(0.25)
        else:
            result["evict_waiting"] = "gave up: this run's workers never registered"
            return
        time.sleep(0.5)
        if evict == "sigterm":
            pid = next(r["pid"] for r in coordinator.status()["ranks"] if r["rank"] == 1)
            evict_now(pid)
        else:
            evict_now(None)

    if kind != "train-evicted":  # "train-evicted": the normal run is another flavour's
        result["normal"] = run(3, 0.05, "normal", evicting=False)
    # Long enough (9 s) for the eviction to land mid-run even on a loaded 2-core machine, where
    # the callback's coordinator and both registrations can take a few seconds.
    result["evicted"] = run(60, 0.15, "evicted", evicting=True)


def warm_group() -> None:
    """A group of 2 and one spare, the warm restart switched on by the job's env alone."""
    from ray_graceful import WarmGroup

    coordinator = Coordinator.start()  # its config, warm_restart included, comes from the env
    cls = ray.remote(
        warm_actors.WarmWorker if kind == "warm-sync" else warm_actors.AsyncWarmWorker
    ).options(num_cpus=0)
    port = free_port()
    workers = [cls.remote(2, r, "127.0.0.1", port) for r in range(2)]
    ray.get([w.init.remote(None) for w in workers], timeout=120)  # config: the env's
    group = WarmGroup(coordinator, workers, spares=[cls.remote()], method="rejoin")
    pids = ray.get([w.pid.remote() for w in workers], timeout=30)
    ray.get([w.train.remote(3) for w in workers], timeout=60)
    training = [w.train.remote(100_000, 0.02) for w in workers]
    time.sleep(1.5)
    evict_now(pids[0])
    ray.wait(training, num_returns=2, timeout=90)
    restart = group.restart(timeout=90)
    result["warm"] = {
        "outcome": restart.outcome.warm,
        "members": [(m.rank, m.world_size, m.was, m.loaded_from) for m in restart.members],
        "step": restart.step,
        "pids_before": pids,
        "pids_after": ray.get([w.pid.remote() for w in group.workers], timeout=30),
        "trained_on": ray.get([w.train.remote(2) for w in group.workers], timeout=60),
    }
    ckpt = latest_committed(os.environ["RAY_GRACEFUL_CHECKPOINT_DIR"])
    result["committed"] = None if ckpt is None else ckpt.step
    coordinator.job_finished()


if kind.startswith("train"):
    train_run()
elif kind.startswith("warm"):
    warm_group()
else:
    actor_group()
print(json.dumps({"result": result}, default=str), flush=True)
