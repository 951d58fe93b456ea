"""The coordinator on a real multi-node cluster: drains, faults, who saves, commits, restarts.

Nodes A and B are extra raylets (``ray.cluster_utils.Cluster``); four gloo ranks hold two
shards, one replica of each shard on each node.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from ray_graceful import latest_committed
from ray_graceful.coordinator import Coordinator
from ray_graceful.health.scripted import write_faults
from ray_graceful.protocol import PollState, RankSpec, Register, SigtermSeen
from ray_graceful.ray_adapter import drain_node
from tests import actors
from tests.helpers import free_port, kill_actors, report_for, wait_for, wait_in_collective

SHARDS = ["0", "1", "0", "1"]
NODES = ["a", "a", "b", "b"]


@pytest.fixture
def config(drain_config):
    return drain_config


@pytest.fixture
def coordinator(ray_cluster, config):
    coord = Coordinator.start(config)
    yield coord
    coord.shutdown()


def start_group(
    config, exit_recorder, placement=NODES, resume=None, save_seconds=0.0, failing_savers=()
):
    port = free_port()
    actor = ray.remote(actors.GracefulTrainer)
    ranks = [
        actor.options(
            num_cpus=0,
            resources={"head" if n == "head" else f"node_{n}": 1},
            runtime_env=exit_recorder.runtime_env(),
        ).remote()
        for n in placement
    ]
    statuses = ray.get(
        [
            r.setup.remote(
                i,
                len(ranks),
                "127.0.0.1",
                port,
                config,
                shard=SHARDS[i],
                save_seconds=save_seconds,
                fail_save=i in failing_savers,
            )
            for i, r in enumerate(ranks)
        ],
        timeout=120,
    )
    if resume is not None:
        ray.get(
            [r.load.remote(resume.shard_path(f"trainer/{SHARDS[i]}")) for i, r in enumerate(ranks)],
            timeout=60,
        )
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    return ranks, pids, statuses


def block_in_collective(ranks, steps=3):
    """Train ``steps`` steps on every rank, then leave ranks 0-2 blocked on the absent rank 3."""
    assert ray.get([r.train.remote(steps) for r in ranks], timeout=60) == [steps] * len(ranks)
    pids = ray.get([r.pid.remote() for r in ranks[:-1]], timeout=30)
    pending = [r.train.remote(1000) for r in ranks[:-1]]
    wait_in_collective(pids)
    assert not ray.wait(pending, timeout=0)[0]
    return pending


def wait_all_exited(exit_recorder, pids, timeout):
    codes = {pid: exit_recorder.wait(pid, timeout) for pid in pids}
    return codes


def test_drain_with_deadline_saves_once_per_shard_commits_and_resumes(
    nodes, config, coordinator, exit_recorder
):
    ranks, pids, statuses = start_group(config, exit_recorder)
    job = ray.get_runtime_context().get_job_id()
    assert f"coordinator 'ray_graceful_coordinator-{job}', cycle 0" in statuses[0], statuses[0]
    block_in_collective(ranks)

    drained_at = time.monotonic()
    drain_node(nodes["b"], time.time() + 12)
    codes = wait_all_exited(exit_recorder, pids, 20)
    everyone_out = time.monotonic() - drained_at
    assert set(codes.values()) == {0}, codes
    budget = config.drain_poll_interval_s + config.expected_save_s + 2.0
    assert everyone_out < budget, f"all ranks out after {everyone_out:.2f}s (budget {budget}s)"

    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome is not None and outcome.result == "committed", outcome.summary()
    assert outcome.notices[0]["source"] == "drain"
    savers = {(r["ranks"][0]["rank"], s["shard"]) for r in outcome.reports for s in r["saved"]}
    assert savers == {(0, "trainer/0"), (1, "trainer/1")}, "the survivors on node A save"
    assert outcome.committed["step"] == 3 and not outcome.missing

    ckpt = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert ckpt.step == 3 and sorted(ckpt.shards) == ["trainer/0", "trainer/1"]
    # The next cycle: a new group on node A only resumes at the saved step, no step lost.
    restarted, _new_pids, statuses = start_group(config, exit_recorder, ["a"] * 4, resume=ckpt)
    assert "cycle 1" in statuses[0]
    assert ray.get([r.train.remote(2) for r in restarted], timeout=60) == [5] * 4
    kill_actors(*restarted)


@pytest.mark.long
def test_a_saver_that_cannot_save_is_replaced_by_its_backup(
    nodes, config, coordinator, exit_recorder
):
    """Rank 0 (survivor) is to save shard 0 but its disk is full: rank 2, the replica on the
    drained node, parked as its backup, saves it instead - the checkpoint is still committed."""
    ranks, pids, _ = start_group(config, exit_recorder, failing_savers={0})
    block_in_collective(ranks)
    drain_node(nodes["b"], time.time() + 12)
    codes = wait_all_exited(exit_recorder, pids, 20)
    assert set(codes.values()) == {0}, codes
    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome.result == "committed", outcome.summary()
    savers = {(r["ranks"][0]["rank"], s["shard"]) for r in outcome.reports for s in r["saved"]}
    assert savers == {(2, "trainer/0"), (1, "trainer/1")}, savers
    assert [f["shard"] for f in outcome.fallbacks] == ["trainer/0"]
    assert "No space left on device" in outcome.fallbacks[0]["why"]
    by_rank = {r["ranks"][0]["rank"]: r for r in outcome.reports}
    save_of_3 = next(s for s in by_rank[3]["phases"] if s["name"] == "save")
    assert "not saving (" in save_of_3["detail"], "rank 1 saved its shard: its backup did not"
    ckpt = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert ckpt.step == 3 and sorted(ckpt.shards) == ["trainer/0", "trainer/1"]


def test_faulty_node_saves_nothing_and_leaves_first(nodes, config, coordinator, exit_recorder):
    ranks, pids, _ = start_group(config, exit_recorder, save_seconds=0.5)
    block_in_collective(ranks)
    faulted_at = time.time()
    write_faults(
        config.health_script_path,
        [
            {
                "node": nodes["a"],
                "verdict": "FAULTY",
                "code": "xid_79",
                "detail": "GPU has fallen off the bus",
            }
        ],
    )
    codes = wait_all_exited(exit_recorder, pids, 20)
    assert set(codes.values()) == {0}, codes
    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome.result == "committed", outcome.summary()
    assert outcome.notices[0]["source"] == "health"
    by_rank = {r["ranks"][0]["rank"]: r for r in outcome.reports}
    assert by_rank[0]["saved"] == [] and by_rank[1]["saved"] == []
    assert {s["shard"] for r in (by_rank[2], by_rank[3]) for s in r["saved"]} == {
        "trainer/0",
        "trainer/1",
    }
    ends = {rank: r["started_at"] + r["finished_s"] for rank, r in by_rank.items()}
    assert max(ends[0], ends[1]) < min(ends[2], ends[3]), "the faulty ranks leave first"
    assert "FAULTY" in outcome.plan_table and "xid_79" in outcome.plan_table
    assert ends[0] - faulted_at < config.health_interval_s + 3


@pytest.fixture
def slow_save_config(config):
    """Saves are expected to take 14 s: no rank has that long before its deadline."""
    return config.replace(expected_save_s=14.0)


@pytest.mark.long
def test_no_viable_saver_writes_no_manifest(nodes, slow_save_config, exit_recorder):
    config = slow_save_config
    coordinator = Coordinator.start(config)
    try:
        ranks, pids, _ = start_group(config, exit_recorder)
        block_in_collective(ranks)
        drain_node(nodes["b"], time.time() + 5)
        codes = wait_all_exited(exit_recorder, pids, 20)
        assert set(codes.values()) == {0}, codes
        outcome = coordinator.wait_outcome(timeout=30, cycle=0)
        assert outcome.result == "abandoned", outcome.summary()
        assert "no replica" in outcome.reason and "trainer/0" in outcome.reason
        assert all(r["saved"] == [] for r in outcome.reports)
        assert all(o["action"] == "leave" for o in outcome.plan["orders"])
        assert outcome.resume_from is None and "no committed checkpoint" in outcome.summary()
        assert latest_committed(config.checkpoint_dir) is None
    finally:
        coordinator.shutdown()


def test_bad_and_stale_notices_change_nothing(nodes, config, coordinator, exit_recorder):
    ranks, _pids, _ = start_group(config, exit_recorder)
    for bad, why in [
        ({"source": "cli", "reason": "x", "node_id": "f" * 56}, "no rank of this job runs on"),
        ({"source": "cli", "reason": "x", "rank": ["trainer", 99]}, "trainer/99 is not registered"),
        ({"source": "cli", "reason": "x", "node_id": nodes["a"], "cycle": 7}, "stale: cycle 7"),
        ({"source": "nope", "reason": "x", "node_id": nodes["a"]}, "source 'nope'"),
        ({"source": "cli", "reason": "", "node_id": nodes["a"]}, "reason must be"),
        (
            {"source": "cli", "reason": "x", "node_id": nodes["a"], "deadline": 1.9e12},
            "looks like milliseconds",
        ),
    ]:
        answer = ray.get(coordinator.handle.notify.remote(bad), timeout=10)
        assert answer.accepted is False and why in answer.reason, (bad, answer)
    status = coordinator.status()
    assert not status["tearing_down"] and status["cycle"] == 0
    assert len(status["rejected"]) == 6
    assert ray.get([r.train.remote(2) for r in ranks], timeout=60) == [2] * 4, "still training"
    stale = ray.get(coordinator.handle.report_sigterm.remote(SigtermSeen("nobody", 0, time.time())))
    assert stale.accepted is False
    kill_actors(*ranks)


@pytest.mark.long
def test_coordinator_killed_ranks_still_leave_by_deadline(
    nodes, config, coordinator, exit_recorder
):
    ranks, pids, _ = start_group(config, exit_recorder)
    block_in_collective(ranks)
    ray.kill(coordinator.handle)
    time.sleep(1.0)  # the ranks' long polls fail: they note the coordinator is gone
    sent = time.monotonic()
    os.kill(pids[0], signal.SIGTERM)
    assert exit_recorder.wait(pids[0], 10) == 0
    assert time.monotonic() - sent < 2.0
    report = wait_for(lambda: report_for(config.report_dir, pids[0]), 5, "the report")
    assert report["trigger"] == "signal 15 (no coordinator reachable)"
    for pid in pids[1:]:  # its peers were told through the group's store, and left too
        assert exit_recorder.wait(pid, config.teardown_timeout_s + 3) == 0
        peer = wait_for(lambda p=pid: report_for(config.report_dir, p), 5, "a peer's report")
        assert peer["trigger"].startswith("released by a peer"), peer["trigger"]
    kill_actors(*ranks)


def test_sigterm_to_one_rank_tears_the_group_down_with_survivors_saving(
    nodes, config, coordinator, exit_recorder
):
    ranks, pids, _ = start_group(config, exit_recorder)
    block_in_collective(ranks)
    sent = time.monotonic()
    os.kill(pids[2], signal.SIGTERM)
    codes = wait_all_exited(exit_recorder, pids, 20)
    assert set(codes.values()) == {0}, codes
    assert time.monotonic() - sent < config.expected_save_s + 2.0
    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome.result == "committed", outcome.summary()
    assert {n["source"] for n in outcome.notices} == {"sigterm"}
    savers = sorted(s["shard"] for r in outcome.reports for s in r["saved"])
    assert savers == ["trainer/0", "trainer/1"]
    signalled = next(r for r in outcome.reports if r["pid"] == pids[2])
    assert signalled["saved"] == [] and "coordinator order" in signalled["trigger"]


def test_spares_and_standbys_exit_zero_when_the_job_succeeds(
    ray_cluster, config, coordinator, exit_recorder
):
    worker = ray.remote(actors.SpareWorker)
    spare, standby = (
        worker.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
        for _ in range(2)
    )
    pids = ray.get([spare.pid.remote(), standby.pid.remote()], timeout=60)
    waits = [spare.wait.remote("spare", config), standby.wait.remote("standby", config)]
    wait_for(lambda: len(coordinator.status()["spares"]) == 2, 30, "both to register")
    assert not ray.wait(waits, timeout=0)[0], "they wait"
    closed = coordinator.job_finished(success=True)
    assert (closed.job_state, closed.spares_told) == ("succeeded", 2), closed
    results = ray.get(waits, timeout=30)
    assert [r["action"] for r in results] == ["exit", "exit"]
    assert [exit_recorder.wait(pid, 15) for pid in pids] == [0, 0]
    assert coordinator.status()["spares"] == []


def test_spare_takes_a_slot_and_standby_exits_on_permanent_close(
    ray_cluster, config, coordinator, exit_recorder
):
    worker = ray.remote(actors.SpareWorker)
    spare, standby = (
        worker.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
        for _ in range(2)
    )
    standby_pid = ray.get(standby.pid.remote(), timeout=60)
    spare_wait = spare.wait.remote("spare", config)
    standby_wait = standby.wait.remote("standby", config)
    wait_for(lambda: len(coordinator.status()["spares"]) == 2, 30, "both to register")
    assigned = coordinator.assign_spare("trainer", 2)
    assert assigned.assigned and (assigned.group, assigned.rank) == ("trainer", 2), assigned
    result = ray.get(spare_wait, timeout=30)
    assert (result["action"], result["group"], result["rank"]) == ("assigned", "trainer", 2)
    assert ray.get(spare.pid.remote(), timeout=10), "an assigned spare stays to join the group"
    coordinator.job_finished(success=False, permanent=True)
    assert ray.get(standby_wait, timeout=30)["action"] == "exit"
    assert exit_recorder.wait(standby_pid, 15) == 0
    kill_actors(spare)


def test_thousands_of_pending_polls_answered_at_once(ray_cluster, config, coordinator):
    """The fan-out: 2,000 long polls held open, all answered when the notice comes."""
    handle, n = coordinator.handle, 2000
    job = ray.get_runtime_context().get_job_id()  # registered as ranks of this job
    ray.get(
        [
            handle.register.remote(
                Register(f"p{i}", "node-x", i, "h", job, (RankSpec("g", i, n, str(i % 8), True),))
            )
            for i in range(n)
        ],
        timeout=120,
    )
    polls = [handle.poll.remote(f"p{i}", 0, PollState(), 50.0) for i in range(n)]
    held = lambda: coordinator.stats()["pending_polls"] == n  # noqa: E731
    wait_for(held, 60, "every poll held by the coordinator", every=0.1)
    assert not ray.wait(polls, num_returns=n, timeout=0)[0], "the polls are held open"
    start = time.monotonic()
    assert coordinator.notify(node_id="node-x", reason="test", source="cli").accepted
    answers = ray.get(polls, timeout=60)
    answered = time.monotonic() - start
    assert all(a.kind == "order" for a in answers)
    assert len({a.order.cycle for a in answers}) == 1
    saves = [s for a in answers for s in a.order.saves]
    assert sum(not s.is_backup for s in saves) == 8, "one saver per shard"
    assert sum(s.is_backup for s in saves) == 8, "and one backup"
    print(f"2000 polls answered {answered:.2f}s after the notice")


def test_a_group_started_while_the_last_one_tears_down_is_covered_once_that_ended(
    ray_cluster, config, exit_recorder
):
    """Review defect 2: a group whose registration came while the previous cycle was still
    tearing down was refused and never registered again, so a SIGTERM to it gave no plan, no
    save and no outcome. Now its control thread registers again until the next cycle takes it.
    """
    config = config.replace(teardown_timeout_s=5.0, save_budget_s=2.0, expected_save_s=0.5)
    coordinator = Coordinator.start(config)
    try:
        # The old group: a stand-in rank that never reports, so cycle 0 tears down until its
        # deadline (5 s) and the report grace (2 s) have passed.
        node, job = ray.get_runtime_context().get_node_id(), ray.get_runtime_context().get_job_id()
        old = Register("old", node, 1, "h", job, (RankSpec("old", 0, 1, "0", True),))
        assert ray.get(coordinator.handle.register.remote(old), timeout=30).accepted
        assert coordinator.notify(node_id=node, reason="the old group's node").accepted
        assert coordinator.status()["tearing_down"]

        ranks, pids, statuses = start_group(config, exit_recorder, placement=["head"])
        assert "registration is retried in the background" in statuses[0], statuses[0]
        assert coordinator.status()["tearing_down"], "cycle 0 must still be tearing down"

        def registered_in_cycle_1():
            status = coordinator.status()
            return status["cycle"] == 1 and [(r["group"], r["rank"]) for r in status["ranks"]]

        assert wait_for(registered_in_cycle_1, 30, "the new group in cycle 1") == [("trainer", 0)]
        assert ray.get(ranks[0].train.remote(4), timeout=30) == 4
        os.kill(pids[0], signal.SIGTERM)
        assert exit_recorder.wait(pids[0], 20) == 0
        outcome = coordinator.wait_outcome(timeout=30, cycle=1)
        assert outcome is not None and outcome.result == "committed", outcome
        assert outcome.notices[0]["source"] == "sigterm"
        assert outcome.committed["step"] == 4
        assert sorted(latest_committed(config.checkpoint_dir).shards) == ["trainer/0"]
    finally:
        coordinator.shutdown()


def test_dead_actors_answers_the_same_one_lookup_each_or_one_call_per_job(ray_cluster):
    """The lost-rank watcher's question to the GCS: past 64 actors it asks once per Ray job
    for that job's DEAD actors instead of once per actor. Both ways name exactly the dead one."""
    from ray_graceful.ray_adapter import dead_actors

    @ray.remote(num_cpus=0)
    class Idle:
        def actor_id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    idle = [Idle.remote() for _ in range(3)]
    ids = ray.get([a.actor_id.remote() for a in idle], timeout=60)
    ray.kill(idle[0])
    wait_for(lambda: dead_actors(set(ids)) == {ids[0]}, 30, "the killed actor listed DEAD")
    assert dead_actors(set(ids), one_call_above=0) == {ids[0]}, "one call for the job"
    kill_actors(*idle[1:])
