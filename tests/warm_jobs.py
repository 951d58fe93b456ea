"""A warm-restart job on the session's cluster, as a test drives one: a coordinator with
``warm_restart`` on, a group of ``WarmWorker`` ranks, its spares, and the eviction that ends a
training run. Shared by ``tests/test_warm_restart.py`` and ``tests/faults/test_warm_faults.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from dataclasses import dataclass

import ray

from ray_graceful import Coordinator, GracefulConfig, WarmGroup
from tests.helpers import free_port, kill_actors, wait_for
from tests.warm_actors import WarmWorker

Worker = ray.remote(num_cpus=0)(WarmWorker)


def warm_config(tmp_path, **overrides) -> GracefulConfig:
    values = dict(
        checkpoint_dir=str(tmp_path / "ckpt"),
        report_dir=str(tmp_path / "reports"),
        coordinator_name=f"warm-{uuid.uuid4().hex[:8]}",
        warm_restart=True,
        teardown_timeout_s=15.0,
        save_budget_s=8.0,
        expected_save_s=1.0,
        rejoin_timeout_s=30.0,
        health_probe="none",
    )
    values.update(overrides)
    return GracefulConfig(**values)


def start_group(
    config: GracefulConfig, world: int, shards: list[str] | None = None, on: str | None = None
) -> list:
    """``shards``: each rank's shard label (default: replicas of one); ``on``: a node's custom
    resource (the ``nodes`` fixture's "node_a") to place them on."""
    port = free_port()
    placed = Worker.options(resources={on: 1}) if on else Worker
    workers = [placed.remote(world, r, "127.0.0.1", port) for r in range(world)]
    labels = shards or ["model"] * world
    ray.get([w.init.remote(config, labels[i]) for i, w in enumerate(workers)], timeout=120)
    return workers


@contextlib.contextmanager
def warm_job(
    tmp_path,
    world: int,
    spares: int = 0,
    shards: list[str] | None = None,
    on: tuple[str | None, str | None] = (None, None),
    **overrides,
):
    """A coordinator with warm restart on, a trained-ready group and its spares; all ended.

    ``on``: the custom resources of the nodes the group and the spares go on (default: any)."""
    config = warm_config(tmp_path, **overrides)
    coordinator = Coordinator.start(config)
    workers, spare_actors = [], []
    try:
        workers = start_group(config, world, shards, on[0])
        placed = Worker.options(resources={on[1]: 1}) if on[1] else Worker
        spare_actors = [placed.remote(config=config) for _ in range(spares)]
        yield config, coordinator, workers, spare_actors
    finally:
        kill_actors(*workers, *spare_actors)
        coordinator.shutdown()


def training_until_evicted(
    coordinator: Coordinator,
    workers: list,
    victim: int,
    step_s: float = 0.02,
    late_s: list[float] | None = None,
) -> list:
    """Train all ranks, SIGTERM ``victim`` mid-run, and wait until every call has ended; the
    calls (a survivor's returns its step, or raises where it was released mid-step).

    ``step_s``: the pause between steps. Longer, and the order almost always finds every
    training thread between steps, where it parks at ``should_stop`` (its state provably the
    step); shorter, and some are inside a step's collective when a peer is released.
    ``late_s``: per worker, a pause inside each step before its boundary (a slow rank, which
    its peers wait for in the next step's all-reduce)."""
    ray.get([w.train.remote(3) for w in workers], timeout=60)
    late = late_s or [0.0] * len(workers)
    running = [w.train.remote(10_000, step_s, late[i]) for i, w in enumerate(workers)]
    wait_for(
        lambda: all((r["last_step"] or 0) >= 5 for r in coordinator.status()["ranks"]),
        60,
        "every rank past step 5",
        every=0.1,
    )
    os.kill(victim, signal.SIGTERM)
    ready, _ = ray.wait(running, num_returns=len(running), timeout=60)
    assert len(ready) == len(running), "a rank's training call did not end after the eviction"
    return running


def alive(actor) -> bool:
    try:
        ray.get(actor.pid.remote(), timeout=5)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def gone_within(actors: list, seconds: float, what: str) -> None:
    wait_for(lambda: not any(alive(a) for a in actors), seconds, what, every=0.2)


@dataclass
class HeldJob:
    """A warm job whose first eviction concluded *held*: what the test goes on with."""

    config: GracefulConfig
    coordinator: Coordinator
    workers: list
    spare: object
    spare_pid: int
    group: WarmGroup
    pids: list[int]
    outcome: object


@contextlib.contextmanager
def held_job(tmp_path, **overrides):
    """Three ranks with replicas (shards a, b, a) on node "a", a spare on node "b" (the
    ``nodes`` fixture), the memory tier on; rank 0 SIGTERMed between 1 s steps, so the survivors
    hold the step - shard a by rank 2, shard b by rank 1 - and the cycle concludes ``held``."""
    placed = ("node_a", "node_b")
    with warm_job(
        tmp_path, 3, 1, shards=["a", "b", "a"], on=placed, memory_replicas=1, **overrides
    ) as (config, coordinator, workers, [spare]):
        spare_pid = ray.get(spare.pid.remote(), timeout=30)  # before it waits in its rejoin
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        training_until_evicted(coordinator, workers, pids[0], step_s=1.0)
        outcome = coordinator.wait_outcome(cycle=0, timeout=60)
        assert outcome is not None and outcome.result == "held", outcome and outcome.reason
        yield HeldJob(config, coordinator, workers, spare, spare_pid, group, pids, outcome)
