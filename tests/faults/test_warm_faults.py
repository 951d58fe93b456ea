"""Faults on a warm restart's way back: a SIGTERM during the rejoin, a spare lost while the group
forms, a spare that left before the next eviction. Each ends in a bounded, clean, reported way:
the signalled process is evicted through a normal cycle of the new group (never killed by Ray as
a crash, never left training unseen), and ``WarmGroup.restart`` tells the truth."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from ray_graceful import WarmGroup, WarmRestartFailed
from ray_graceful.tools.bench.kit import recorded_crashes
from tests.helpers import wait_for
from tests.warm_jobs import alive, gone_within, held_job, training_until_evicted, warm_job


def _sigterm_notices(outcome) -> list[dict]:
    return [n for n in outcome.notices if n["source"] == "sigterm"]


def _waiting_spare(coordinator, spare):
    """Start ``spare`` waiting inside its rejoin; its call, once the coordinator lists it."""
    call = spare.rejoin.remote()
    wait_for(lambda: coordinator.status()["spares"], 60, "the spare to register")
    return call


@pytest.mark.timeout(240)
def test_a_sigterm_while_a_survivor_waits_in_the_rendezvous_evicts_it_from_the_new_group(
    rep, fault_log, ray_cluster, tmp_path
):
    """World 3 and a spare; rank 0 evicted. Survivor rank 1 waits in the new group's rendezvous
    (rank 2 has not come yet) when its SIGTERM arrives. It finishes joining, and its SIGTERM is
    the first notice of the new group's cycle: it is evicted through a normal cycle and leaves
    through Ray's intended exit - it does not train on unseen until Ray kills it."""
    with warm_job(tmp_path, 3, spares=1, rejoin_timeout_s=20.0) as (_c, coordinator, w, s):
        pids = ray.get([x.pid.remote() for x in w])
        spare_call = _waiting_spare(coordinator, s[0])
        training_until_evicted(coordinator, w, pids[0])
        assert coordinator.wait_outcome(timeout=60, cycle=0).warm["result"] == "rejoining"

        first = w[1].rejoin.remote()  # rank 1 waits for rank 2 in the rendezvous
        ready, _ = ray.wait([first], timeout=3)
        assert not ready, "rank 1 cannot have joined a group rank 2 is not in"
        os.kill(pids[1], signal.SIGTERM)
        second = w[2].rejoin.remote()

        joined = ray.get([first, second, spare_call], timeout=60)
        assert all(r.joined for r in joined), joined
        outcome = coordinator.wait_outcome(timeout=60, cycle=1)
        assert outcome is not None, "the SIGTERM during the rejoin reached no one"
        noticed = _sigterm_notices(outcome)
        assert [n["rank"] for n in noticed] == [["policy", 1]], outcome.notices
        gone_within([w[1]], 30, "the signalled survivor to leave")
        crashes = recorded_crashes({pids[1]})
        # No spare is left for cycle 1: its survivors are told to leave, cleanly.
        gone_within([w[2], *s], 40, "the other members to leave")
        fault_log.record(
            "SIGTERM to a survivor inside the rendezvous", 1, 1, 0, "committed", [pids[1]]
        )
        assert crashes == 0, "Ray recorded the signalled survivor's end as a crash"


@pytest.mark.timeout(240)
def test_a_spare_signalled_after_its_assignment_claims_the_signal_and_is_evicted_cleanly(
    rep, fault_log, ray_cluster, tmp_path
):
    """World 2 and a spare; rank 1 evicted. The spare gets SIGTERM once it is assigned, on its
    way in - its wait for a slot returning, or in the rendezvous. It claims the signal (Ray does
    not kill it as a crash), the group forms, and the spare is evicted through the new group's
    first cycle; the survivor is never left registered in a world whose other member is dead,
    nor waiting in the rendezvous for a spare that left."""
    with warm_job(tmp_path, 2, spares=1, rejoin_timeout_s=20.0) as (_c, coordinator, w, [spare]):
        spare_pid = ray.get(spare.pid.remote())  # asked before it waits inside its rejoin
        group = WarmGroup(coordinator, w, spares=[spare], method="rejoin")
        pids = ray.get([x.pid.remote() for x in w])
        training_until_evicted(coordinator, w, pids[1])
        assert coordinator.wait_outcome(timeout=60, cycle=0).warm["result"] == "rejoining"
        wait_for(lambda: not coordinator.status()["spares"], 30, "the spare to take its slot")

        os.kill(spare_pid, signal.SIGTERM)  # assigned: its poll took the word
        restart = group.restart(timeout=60)
        assert [m.was for m in restart.members] == ["survivor of rank 0", "spare for rank 1"]

        outcome = coordinator.wait_outcome(timeout=60, cycle=1)
        assert outcome is not None, "the spare's SIGTERM reached no one"
        noticed = _sigterm_notices(outcome)
        assert [n["rank"] for n in noticed] == [["policy", 1]], outcome.notices
        gone_within([spare, w[0]], 40, "both members to leave (no spare for cycle 1)")
        record = coordinator.wait_rejoined(1, timeout=5)
        assert record["result"] == "rejoined", record
        crashes = recorded_crashes({spare_pid, pids[0]})
        fault_log.record(
            "SIGTERM to a spare inside the rendezvous", 2, 2, 0, "committed", [spare_pid, pids[0]]
        )
        assert crashes == 0, "Ray recorded a member's end as a crash"


@pytest.mark.timeout(240)
def test_a_spare_that_left_is_dropped_and_the_next_restart_takes_the_assigned_one(
    rep, fault_log, ray_cluster, tmp_path
):
    """Two spares; one is SIGTERMed while it waits and leaves, as documented. The next eviction
    is restarted warm with the other: ``restart()`` matches members by the ids the coordinator
    assigned, never by which spare's call happened to finish first."""
    with warm_job(tmp_path, 2, spares=2) as (_c, coordinator, w, spares):
        leaving, staying = spares
        leaving_pid = ray.get(leaving.pid.remote())  # asked before it waits inside its rejoin
        group = WarmGroup(coordinator, w, spares=spares, method="rejoin")
        os.kill(leaving_pid, signal.SIGTERM)
        wait_for(lambda: len(coordinator.status()["spares"]) == 1, 30, "one spare to leave")
        pids = ray.get([x.pid.remote() for x in w])
        training_until_evicted(coordinator, w, pids[1])

        restart = group.restart(timeout=60)

        assert [m.was for m in restart.members] == ["survivor of rank 0", "spare for rank 1"]
        assert group.workers == [w[0], staying]
        assert group.spares == [], "the spare that left is still in the pool"
        assert ray.get([x.all_reduce_rank.remote() for x in group.workers]) == [3.0, 3.0]
        fault_log.record("a waiting spare left before the eviction", 2, 2, 0, "committed", pids)
        assert not alive(leaving)


@pytest.mark.timeout(300)
def test_keepers_lost_before_the_held_copies_land_the_held_step_is_never_committed(nodes, tmp_path):
    """Every keeper killed after the cycle concluded *held*, before the group trained again.
    Replicas (shards a, b, a; rank 0 evicted): the spare gets shard a from the survivor that
    holds it, over the new group - no keeper needed - so the group re-forms and trains on; the
    survivors' copies of the held step find no keeper. That step is lost - never committed, and
    said so - and a cold restart would not load it."""
    from ray_graceful import latest_committed

    with held_job(tmp_path) as job:
        config, coordinator, group = job.config, job.coordinator, job.group
        for stats in coordinator.keeper_stats().values():
            ray.kill(ray.get_actor(stats["name"], namespace=config.coordinator_namespace))
        wait_for(
            lambda: all("error" in s for s in coordinator.keeper_stats().values()),
            30,
            "every keeper gone",
        )

        restart = group.restart(timeout=90)
        assert restart.members[0].loaded_from == "group-peer"
        assert (
            ray.get([w.train.remote(2) for w in group.workers], timeout=60)
            == [restart.step + 2] * 3
        )

        durable = coordinator.wait_durable(0, timeout=90)
        assert durable is not None and "lost" in durable.get("error", ""), durable
        where = coordinator.durability(0)
        assert where["stage"] == "lost", where
        assert "did not land" in where["reason"], where
        assert latest_committed(config.checkpoint_dir) is None


@pytest.mark.timeout(240)
def test_a_replica_that_dies_as_it_sends_fails_the_restart_and_its_step_is_never_committed(
    nodes, tmp_path
):
    """Replicas (shards a, b, a; rank 0 evicted): the survivor rank 2 holds shard a and must
    send it to the spare over the new group; it is SIGKILLed as it sends. The spare's receive
    fails, so the warm restart fails with the reason, every member still running is ended
    within the rendezvous bound, nobody trains, and the held step - whose shard a now exists
    nowhere - is never committed."""
    from ray_graceful import latest_committed

    with held_job(tmp_path, rejoin_timeout_s=8.0) as job:
        config, coordinator, workers = job.config, job.coordinator, job.workers
        assert "policy/a" in job.outcome.committed["held"], "shard a is held by a survivor only"
        ray.get(workers[2].die_as_it_sends.remote(), timeout=30)

        with pytest.raises(WarmRestartFailed) as failed:
            job.group.restart(timeout=90)
        assert "spare for rank 0" in failed.value.reason, failed.value.reason
        gone_within([workers[1], workers[2], job.spare], 40, "every member to be ended")
        clean = {job.pids[1], job.spare_pid}
        assert recorded_crashes(clean) == 0, "the others end cleanly, not crashed"

        durable = coordinator.wait_durable(0, timeout=60)
        assert durable is not None and "lost" in durable.get("error", ""), durable
        assert coordinator.durability(0)["stage"] == "lost"
        assert latest_committed(config.checkpoint_dir) is None


@pytest.mark.timeout(240)
def test_a_notice_before_the_held_snapshot_is_durable_finishes_the_copy_first(nodes, tmp_path):
    """The group re-formed from a held step; before it trained (so no survivor's snapshot has
    gone to a keeper yet) survivor rank 1 - the only holder of shard b - gets SIGTERM. Its
    teardown hands its snapshot on before it leaves: the held step becomes durable all the
    same, and the new cycle ends cleanly without training on anything unproven."""
    from ray_graceful import latest_committed

    with held_job(tmp_path) as job:
        config, coordinator, workers = job.config, job.coordinator, job.workers
        assert "policy/b" in job.outcome.committed["held"], "shard b is held by rank 1 only"
        restart = job.group.restart(timeout=90)
        assert coordinator.durability(0)["stage"] == "held", "no copy before the first step"

        os.kill(job.pids[1], signal.SIGTERM)  # the next notice, before any snapshot is durable
        durable = coordinator.wait_durable(0, timeout=90)
        assert durable is not None and "at" in durable, durable
        committed = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert committed is not None and committed.step == restart.step
        nxt = coordinator.wait_outcome(cycle=1, timeout=60)
        assert nxt is not None and nxt.result != "failed", nxt and nxt.reason

        # The next cycle committed the same step in memory; its durable copy must not touch the
        # step already on disk: a committed checkpoint is never modified.
        def files() -> dict[str, bytes]:
            return {
                f: open(os.path.join(committed.path, f), "rb").read()
                for f in os.listdir(committed.path)
            }

        before = files()
        if nxt.result == "committed" and nxt.committed["step"] == committed.step:
            assert coordinator.wait_durable(1, timeout=60) is not None
            assert files() == before
        gone_within([workers[1]], 30, "the signalled survivor to leave")
