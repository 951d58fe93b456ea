"""Fault injection: signals, kills, drains and broken saves, each repeated; hangs must be zero.

Every scenario runs a real coordinator and four real gloo ranks (two shards, two replicas each)
and records, for docs/reliability.md: how many ranks got out by their deadline, what became of
the checkpoint (committed, or abandoned with the previous committed one still loadable), and
hangs. A checkpoint that is not complete is never listed as committed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from ray_graceful import GracefulConfig, latest_committed
from ray_graceful.checkpoint import commit, save_state_dict, write_shard
from ray_graceful.coordinator import Coordinator
from ray_graceful.ray_adapter import drain_node
from tests import actors
from tests.helpers import free_port, kill_actors, wait_for, wait_in_collective, wait_saving

SHARDS = ["0", "1", "0", "1"]
DEADLINE_S = 12.0


@pytest.fixture
def config(tmp_path):
    return fault_config(tmp_path)


def fault_config(tmp_path) -> GracefulConfig:
    """What every fault scenario runs under: short intervals, a 12 s deadline."""
    return GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        expected_save_s=1.0,
        teardown_timeout_s=DEADLINE_S,
        save_budget_s=6.0,
        exit_grace_s=1.0,
    )


@pytest.fixture
def coordinator(ray_cluster, config):
    coord = Coordinator.start(config)
    yield coord
    coord.shutdown()


def seed_committed(config) -> None:
    """A committed checkpoint at step 1: what the job resumes from if this cycle's is lost."""
    records = [
        write_shard(
            config.checkpoint_dir,
            1,
            f"trainer/{s}",
            lambda p, step: save_state_dict({"step": step}, p),
        )
        for s in ("0", "1")
    ]
    commit(config.checkpoint_dir, 1, ["trainer/0", "trainer/1"], records)


def start(config, exit_recorder, **per_rank):
    """Four ranks; ``per_rank`` maps a setup keyword to {rank: value}."""
    port = free_port()
    actor = ray.remote(actors.GracefulTrainer)
    ranks = [
        actor.options(
            num_cpus=0,
            resources={"head": 1},  # never on a node a test drains
            runtime_env=exit_recorder.runtime_env(),
        ).remote()
        for _ in range(4)
    ]
    ray.get(
        [
            r.setup.remote(
                i,
                4,
                "127.0.0.1",
                port,
                config,
                shard=SHARDS[i],
                **{k: v.get(i) for k, v in per_rank.items() if i in v},
            )
            for i, r in enumerate(ranks)
        ],
        timeout=120,
    )
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    assert ray.get([r.train.remote(3) for r in ranks], timeout=60) == [3] * 4
    pending = [r.train.remote(10**6) for r in ranks[:-1]]  # rank 3 absent: 0-2 block
    wait_in_collective(pids[:-1])
    assert not ray.wait(pending, timeout=0)[0]
    return ranks, pids


def settle(exit_recorder, pids, within=DEADLINE_S + 3):
    codes = {pid: exit_recorder.wait(pid, within) for pid in pids}
    return sum(c is not None for c in codes.values()), sum(c is None for c in codes.values())


def checkpoint_state(outcome, config) -> str:
    """What happened to the checkpoint; asserts nothing incomplete is listed as committed."""
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    if outcome.result == "committed":
        assert latest is not None and latest.step == outcome.committed["step"]
        assert sorted(latest.shards) == ["trainer/0", "trainer/1"]
        return "committed"
    assert outcome.result == "abandoned" and outcome.reason, outcome.summary()
    if latest is not None:
        assert latest.step == 1, "an abandoned cycle never becomes the latest committed"
    return "abandoned (correct)"


def run_and_record(name, fault_log, config, coordinator, exit_recorder, pids, ranks, killed=()):
    released, hangs = settle(exit_recorder, pids)
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 10, cycle=0)
    assert outcome is not None, "the coordinator published no outcome"
    state = checkpoint_state(outcome, config)
    fault_log.record(name, len(pids), released, hangs, state, pids, killed)
    kill_actors(*ranks)
    assert hangs == 0
    return outcome


def test_sigterm_during_a_collective(rep, fault_log, config, coordinator, exit_recorder):
    ranks, pids = start(config, exit_recorder)
    os.kill(pids[1], signal.SIGTERM)
    outcome = run_and_record(
        "SIGTERM during a collective", fault_log, config, coordinator, exit_recorder, pids, ranks
    )
    assert outcome.result == "committed"


def test_sigterm_during_a_save(rep, fault_log, config, coordinator, exit_recorder, tmp_path):
    ranks, pids = start(config, exit_recorder, save_seconds={0: 1.5, 1: 1.5, 2: 1.5, 3: 1.5})
    os.kill(pids[3], signal.SIGTERM)
    wait_for(lambda: coordinator.status()["plan_table"], 10, "the plan")
    wait_saving([pids[0], pids[1]], 10)  # the savers (ranks 0 and 1, survivors) are saving
    os.kill(pids[0], signal.SIGTERM)
    outcome = run_and_record(
        "SIGTERM during a save", fault_log, config, coordinator, exit_recorder, pids, ranks
    )
    assert outcome.result == "committed", "a SIGTERM mid-save lets the save finish"


def test_sigterm_twice(rep, fault_log, config, coordinator, exit_recorder):
    ranks, pids = start(config, exit_recorder)
    os.kill(pids[2], signal.SIGTERM)
    os.kill(pids[2], signal.SIGTERM)
    run_and_record(
        "SIGTERM twice to one rank", fault_log, config, coordinator, exit_recorder, pids, ranks
    )


def test_sigterm_to_every_rank_at_once(rep, fault_log, config, coordinator, exit_recorder):
    ranks, pids = start(config, exit_recorder)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    outcome = run_and_record(
        "SIGTERM to every rank at once", fault_log, config, coordinator, exit_recorder, pids, ranks
    )
    assert outcome.result == "committed", "evicted replicas with time left still save"
    assert len({n["rank"][1] for n in outcome.notices}) == 4, "one plan for all four"


def test_sigterm_to_a_spare(rep, fault_log, config, coordinator, exit_recorder):
    worker = ray.remote(actors.SpareWorker)
    spare = worker.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
    pid = ray.get(spare.pid.remote(), timeout=60)
    waiting = spare.wait.remote("spare", config)
    wait_for(lambda: coordinator.status()["spares"], 30, "the spare to register")
    os.kill(pid, signal.SIGTERM)
    assert ray.get(waiting, timeout=10)["action"] == "exit"
    code = exit_recorder.wait(pid, 10)
    fault_log.record(
        "SIGTERM to a spare", 1, int(code is not None), int(code is None), "n/a", [pid]
    )
    assert code == 0
    assert coordinator.status()["spares"] == [], "an evicted spare is never handed a slot"


def test_worker_killed_with_sigkill(rep, fault_log, config, coordinator, exit_recorder):
    ranks, pids = start(config, exit_recorder)
    os.kill(pids[2], signal.SIGKILL)  # no notice at all: the coordinator must notice the loss
    outcome = run_and_record(
        "a worker killed with SIGKILL",
        fault_log,
        config,
        coordinator,
        exit_recorder,
        pids,
        ranks,
        killed=[pids[2]],
    )
    assert outcome.notices[0]["source"] == "lost"
    assert outcome.result == "committed", "rank 2's shard has a replica on rank 0"
    assert any("died without a notice" in m for m in outcome.missing)


def test_coordinator_killed(rep, fault_log, config, coordinator, exit_recorder):
    ranks, pids = start(config, exit_recorder)
    ray.kill(coordinator.handle)
    time.sleep(1.0)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    released, hangs = settle(exit_recorder, pids)
    fault_log.record("coordinator actor killed", 4, released, hangs, "n/a (no coordinator)", pids)
    kill_actors(*ranks)
    assert hangs == 0


def test_the_drivers_node_drained(rep, fault_log, ray_cluster, config, exit_recorder):
    """The coordinator runs next to the driver; when Ray drains that node the job ends with it.

    No rank's own node is drained, yet every rank is ordered, each shard is saved once, every
    rank is out by the drain's deadline, and the checkpoint commits before the node goes.
    """
    node = ray_cluster.add_node(num_cpus=1)
    ray_cluster.wait_for_nodes()
    coord = Coordinator.start(config, node_id=node.node_id)  # the driver's node, as start() says
    try:
        ranks, pids = start(config, exit_recorder)
        rank_node = ray_cluster.head_node.node_id  # start() puts every rank on the head
        drain_node(node.node_id, time.time() + DEADLINE_S, "the driver's node is reclaimed")
        outcome = coord.wait_outcome(timeout=DEADLINE_S + 10, cycle=0)
        assert outcome is not None, "the coordinator published no outcome"
        released, hangs = settle(exit_recorder, pids)
        state = checkpoint_state(outcome, config)
        fault_log.record("drain of the driver's node", 4, released, hangs, state, pids)
        kill_actors(*ranks)
        assert hangs == 0
        assert outcome.result == "committed", outcome.summary()
        assert {n["node_id"] for n in outcome.notices} == {rank_node}
        assert "driver's node" in outcome.notices[0]["reason"]
    finally:
        kill_actors(coord.handle)
        ray_cluster.remove_node(node)


def _alive(coordinator) -> bool:
    try:
        ray.get(coordinator.handle.ping.remote(), timeout=2)
        return True
    except Exception:
        return False


def test_a_save_that_hangs(rep, fault_log, config, coordinator, exit_recorder, tmp_path):
    seed_committed(config)
    hang = str(tmp_path / "hanging")
    ranks, pids = start(config, exit_recorder, hang_save={0: hang, 2: hang})
    os.kill(pids[3], signal.SIGTERM)
    outcome = run_and_record(
        "a save that hangs", fault_log, config, coordinator, exit_recorder, pids, ranks
    )
    assert outcome.result == "abandoned" and "trainer/0" in outcome.reason


def test_a_save_that_raises(rep, fault_log, config, coordinator, exit_recorder):
    seed_committed(config)
    ranks, pids = start(config, exit_recorder, fail_save={0: True, 2: True})
    os.kill(pids[3], signal.SIGTERM)
    outcome = run_and_record(
        "a save that raises", fault_log, config, coordinator, exit_recorder, pids, ranks
    )
    assert outcome.result == "abandoned"
    saver = next(r for r in outcome.reports if r["ranks"][0]["rank"] == 0)
    save = next(s for s in saver["phases"] if s["name"] == "save")
    assert save["status"] == "failed" and "No space left on device" in save["detail"]


def test_a_save_killed_halfway(rep, fault_log, config, coordinator, exit_recorder):
    seed_committed(config)
    ranks, pids = start(config, exit_recorder, save_seconds={0: 3.0, 1: 3.0, 2: 3.0})
    os.kill(pids[3], signal.SIGTERM)
    wait_for(lambda: coordinator.status()["plan_table"], 10, "the plan")
    wait_saving([pids[0]], 10)  # rank 0 is inside its 3 s save of shard 0
    os.kill(pids[0], signal.SIGKILL)
    outcome = run_and_record(
        "a save killed halfway",
        fault_log,
        config,
        coordinator,
        exit_recorder,
        pids,
        ranks,
        killed=[pids[0]],
    )
    # Rank 2, the other replica of shard 0, was parked as its backup: it saves it instead.
    assert outcome.result == "committed", outcome.summary()
    assert [(f["shard"], f["why"]) for f in outcome.fallbacks] == [
        ("trainer/0", "its process died")
    ]
    savers = {(r["ranks"][0]["rank"], s["shard"]) for r in outcome.reports for s in r["saved"]}
    assert (2, "trainer/0") in savers
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert latest.step == outcome.committed["step"] > 1, "the killed save's file is never used"
