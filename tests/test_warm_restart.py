"""Warm restart on a real cluster: survivors keep their processes, a spare takes the evicted
slot, the group is re-formed in place, and every rank holds bitwise the committed step."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid

import pytest
import ray
import torch

from ray_graceful import (
    Coordinator,
    GracefulConfig,
    WarmGroup,
    WarmRestartFailed,
    latest_committed,
)
from ray_graceful.checkpoint import load_committed_shard
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


def start_group(config: GracefulConfig, world: int) -> list:
    port = free_port()
    workers = [Worker.remote(world, r, "127.0.0.1", port) for r in range(world)]
    ray.get([w.init.remote(config) for w in workers], timeout=120)
    return workers


@contextlib.contextmanager
def warm_job(tmp_path, world: int, spares: int = 0):
    """A coordinator with warm restart on, a trained-ready group and its spares; all ended."""
    config = warm_config(tmp_path)
    coordinator = Coordinator.start(config)
    workers, spare_actors = [], []
    try:
        workers = start_group(config, world)
        spare_actors = [Worker.remote(config=config) for _ in range(spares)]
        yield config, coordinator, workers, spare_actors
    finally:
        kill_actors(*workers, *spare_actors)
        coordinator.shutdown()


def training_until_evicted(coordinator: Coordinator, workers: list, victim: int) -> None:
    """Train all ranks, SIGTERM ``victim`` mid-run, and wait until every call has ended."""
    ray.get([w.train.remote(3) for w in workers], timeout=60)
    running = [w.train.remote(10_000, 0.02) for w in workers]
    wait_for(
        lambda: all((r["last_step"] or 0) >= 5 for r in coordinator.status()["ranks"]),
        60,
        "every rank past step 5",
        every=0.1,
    )
    os.kill(victim, signal.SIGTERM)
    ready, _ = ray.wait(running, num_returns=len(running), timeout=60)
    assert len(ready) == len(running), "a rank's training call did not end after the eviction"


@pytest.mark.timeout(240)
def test_survivors_keep_their_processes_and_a_spare_takes_the_evicted_slot(ray_cluster, tmp_path):
    with warm_job(tmp_path, 4, spares=1) as (config, coordinator, workers, [spare]):
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        training_until_evicted(coordinator, workers, pids[0])

        restart = group.restart(timeout=60)

        assert [m.rank for m in restart.members] == [0, 1, 2, 3]
        assert restart.world_size == 4
        assert restart.members[0].was == "spare for rank 0"
        assert [m.was for m in restart.members[1:]] == [f"survivor of rank {r}" for r in (1, 2, 3)]
        new_pids = ray.get([w.pid.remote() for w in group.workers])
        assert new_pids[1:] == pids[1:], "a survivor's process was replaced"
        assert new_pids[0] == ray.get(spare.pid.remote())

        # Every rank holds bitwise the committed step: parameters and optimizer state.
        committed = latest_committed(config.checkpoint_dir)
        assert committed is not None and committed.step == restart.step
        saved = load_committed_shard(committed, "policy/model")["state"]
        for snap in ray.get([w.snapshot.remote() for w in group.workers]):
            assert snap["step"] == committed.step
            for name, tensor in saved["model"].items():
                assert torch.equal(snap["state"][name], tensor), (snap["rank"], name)
            for i, buffer in enumerate(snap["momentum"]):
                assert torch.equal(buffer, saved["opt"]["state"][i]["momentum_buffer"])

        # The new group is a real one: a collective sums over the new world.
        assert ray.get([w.all_reduce_rank.remote() for w in group.workers]) == [10.0] * 4
        steps = ray.get([w.train.remote(2) for w in group.workers], timeout=60)
        assert steps == [committed.step + 2] * 4

        # The outcome says it was warm, and the record who loaded what from where.
        assert restart.outcome.warm["result"] == "rejoining"
        record = coordinator.wait_rejoined(restart.outcome.cycle + 1, timeout=30)
        assert record["result"] == "rejoined", record
        loaded = {m["rank"]: m["loaded_from"] for m in record["members"]}
        assert loaded[0] == "disk"  # the spare had nothing of its own
        assert set(loaded.values()) <= {"own state", "disk"}


@pytest.mark.timeout(240)
def test_no_spare_and_no_smaller_size_allowed_ends_every_rank_cleanly(ray_cluster, tmp_path):
    with warm_job(tmp_path, 2) as (_config, coordinator, workers, _spares):
        group = WarmGroup(coordinator, workers, method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        training_until_evicted(coordinator, workers, pids[1])

        with pytest.raises(WarmRestartFailed, match="no spare free"):
            group.restart(timeout=60)
        # The survivor was told to leave: it is gone, not left behind as an idle actor.
        wait_for(lambda: not _alive(workers[0]), 30, "the survivor to leave")


def _alive(actor) -> bool:
    try:
        ray.get(actor.pid.remote(), timeout=5)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@pytest.mark.timeout(240)
def test_a_member_that_cannot_load_ends_the_warm_restart_and_every_rank_leaves(
    ray_cluster, tmp_path
):
    """The spare registered no load_state_dict: it cannot hold the committed step, says so,
    and the coordinator ends the members that did join with a normal teardown."""
    with warm_job(tmp_path, 2, spares=1) as (_config, coordinator, workers, [spare]):
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin_without_loader")
        pids = ray.get([w.pid.remote() for w in workers])
        training_until_evicted(coordinator, workers, pids[1])

        with pytest.raises(WarmRestartFailed, match="1 of 2 member"):
            group.restart(timeout=60)
        record = coordinator.wait_rejoined(1, timeout=30)
        assert record["result"] == "failed" and "no load_state_dict" in record["reason"]
        # The survivor had joined; the failure's notice ended it cleanly (cycle 1's outcome).
        outcome = coordinator.wait_outcome(timeout=60, cycle=1)
        assert outcome is not None and outcome.notices[0]["source"] == "rejoin"
        wait_for(lambda: not _alive(workers[0]), 30, "the survivor to leave")
        wait_for(lambda: not _alive(spare), 30, "the spare to leave")
