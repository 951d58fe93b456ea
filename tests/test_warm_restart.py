"""Warm restart on a real cluster: survivors keep their processes, a spare takes the evicted
slot, the group is re-formed in place, and every rank holds bitwise the committed step."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import ray
import torch

from ray_graceful import WarmGroup, WarmRestartFailed, latest_committed
from ray_graceful.checkpoint import load_committed_shard
from tests.helpers import wait_for
from tests.warm_jobs import Worker, alive, gone_within, training_until_evicted, warm_job


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
        spare_took = next(m for m in record["members"] if m["rank"] == 0)["seconds"]
        # Its shard was fetched while the group formed, not after it.
        assert spare_took["fetch_began"] < spare_took["rendezvous"], spare_took


@pytest.mark.timeout(240)
def test_survivors_hold_their_shards_and_train_on_before_the_step_is_committed(nodes, tmp_path):
    """With a memory tier, a survivor saves nothing before the group trains again: it holds its
    own shard (a snapshot), and the step is committed - in the keepers, then on disk - once
    the snapshots' copies land, with exactly the state the group trained on from."""
    # The group on node a, its spare on node b, the coordinator (and a keeper) on the head:
    # a SIGTERMed rank's node keeps no copy (its keeper may be going too).
    placed = ("node_a", "node_b")
    with warm_job(tmp_path, 3, 1, shards=["r0", "r1", "r2"], on=placed, memory_replicas=1) as (
        config,
        coordinator,
        workers,
        [spare],
    ):
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        # 1 s between steps: the order reaches every survivor before its next step's all-reduce
        # (at 0.2 s, once in a loaded CI run a survivor was inside it, released, and saved first)
        training_until_evicted(coordinator, workers, pids[0], step_s=1.0)

        restart = group.restart(timeout=60)
        outcome = restart.outcome
        assert outcome.result == "held", outcome.reason
        assert outcome.committed["step"] == restart.step
        assert sorted(outcome.committed["held"]) == ["policy/r1", "policy/r2"]
        # Nothing is committed yet that a restart could load at this step.
        record = coordinator.wait_rejoined(outcome.cycle + 1, timeout=30)
        assert record["result"] == "rejoined", record
        loaded = {m["rank"]: m["loaded_from"] for m in record["members"]}
        assert loaded[1] == loaded[2] == "own state"
        assert loaded[0].startswith("memory"), loaded  # the evicted shard, from a keeper
        at_restart = ray.get([w.snapshot.remote() for w in group.workers])
        assert {s["step"] for s in at_restart} == {restart.step}

        # The group trains on; the step becomes durable behind it.
        ray.get([w.train.remote(3) for w in group.workers], timeout=60)
        durable = coordinator.wait_durable(outcome.cycle, timeout=60)
        assert durable is not None and durable.get("path"), durable
        where = coordinator.durability(outcome.cycle)
        assert where["stage"] == "on-disk", where
        assert where["at"]["in-keepers"] >= max(m["started_at"] for m in record["members"])

        # What was committed is the state of the held step, not what the survivors trained to.
        committed = latest_committed(config.checkpoint_dir)
        assert committed is not None and committed.step == restart.step
        for snap in at_restart:
            saved = load_committed_shard(committed, f"policy/r{snap['rank']}")["state"]
            for name, tensor in saved["model"].items():
                assert torch.equal(snap["state"][name], tensor), (snap["rank"], name)


@pytest.mark.timeout(240)
def test_a_spare_receives_the_shard_a_surviving_replica_holds_over_the_new_group(nodes, tmp_path):
    """Replicas (shards a, b, a, b): rank 0 evicted, the surviving replica of its shard (rank 2)
    holds it and saves nothing; the spare taking rank 0 receives it from rank 2 once the group
    formed, checks its step and size, and the group trains on before the step is durable."""
    placed = ("node_a", "node_b")
    with warm_job(tmp_path, 4, 1, shards=["a", "b", "a", "b"], on=placed, memory_replicas=1) as (
        config,
        coordinator,
        workers,
        [spare],
    ):
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        # 1 s between steps: the order reaches every survivor before its next step's all-reduce
        # (at 0.2 s, once in a loaded CI run a survivor was inside it, released, and saved first)
        training_until_evicted(coordinator, workers, pids[0], step_s=1.0)

        restart = group.restart(timeout=60)
        assert restart.outcome.result == "held", restart.outcome.reason
        assert sorted(restart.outcome.committed["held"]) == ["policy/a", "policy/b"]
        members = {m.rank: m for m in restart.members}
        assert members[0].was == "spare for rank 0"
        assert members[0].loaded_from == "group-peer"
        assert {members[r].loaded_from for r in (1, 2, 3)} == {"own state"}
        assert "sent" in members[2].seconds  # the holder of shard a sent it

        at_restart = ray.get([w.snapshot.remote() for w in group.workers])
        for snap in at_restart[1:]:  # data-parallel: every replica holds the same state
            for name, tensor in snap["state"].items():
                assert torch.equal(at_restart[0]["state"][name], tensor), (snap["rank"], name)
        assert ray.get([w.all_reduce_rank.remote() for w in group.workers]) == [10.0] * 4
        ray.get([w.train.remote(2) for w in group.workers], timeout=60)

        durable = coordinator.wait_durable(restart.outcome.cycle, timeout=60)
        assert durable is not None and durable.get("path"), durable
        committed = latest_committed(config.checkpoint_dir)
        assert committed is not None and committed.step == restart.step
        saved = load_committed_shard(committed, "policy/a")["state"]
        for name, tensor in saved["model"].items():
            assert torch.equal(at_restart[0]["state"][name], tensor), name


@pytest.mark.timeout(240)
def test_a_survivor_inside_the_next_step_when_the_order_came_still_holds_its_shard(nodes, tmp_path):
    """The race behind the held path's slow tail (issue 62). The evicted rank is told while it
    is still inside step k (1 s between its optimizer step and its boundary), so it parks at k,
    while its peers - past boundary k long before - wait for it inside step k+1's all-reduce.
    Released from there, a survivor could not prove its state and saved its shard first. Now the
    ranks agree in the group's store to stop at k+1: the evicted rank trains that step, every
    rank parks at k+1, and each survivor holds its own shard."""
    placed = ("node_a", "node_b")
    with warm_job(tmp_path, 3, 1, shards=["r0", "r1", "r2"], on=placed, memory_replicas=1) as (
        _config,
        coordinator,
        workers,
        [spare],
    ):
        group = WarmGroup(coordinator, workers, spares=[spare], method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        running = training_until_evicted(
            coordinator, workers, pids[0], step_s=0.0, late_s=[1.0, 0.0, 0.0]
        )
        # No survivor's call raised: none was released from inside its step.
        steps = ray.get(running[1:], timeout=10)
        assert len(set(steps)) == 1, f"the survivors stopped at one step: {steps}"

        restart = group.restart(timeout=60)
        assert restart.outcome.result == "held", restart.outcome.reason
        assert restart.step == steps[0]
        for report in restart.outcome.reports:
            assert report["parked_at"] == restart.step, report
            quiesce = next(p for p in report["phases"] if p["name"] == "quiesce")
            assert f"stop step {restart.step} agreed" in quiesce["detail"], quiesce
        record = coordinator.wait_rejoined(restart.outcome.cycle + 1, timeout=30)
        loaded = {m["rank"]: m["loaded_from"] for m in record["members"]}
        assert loaded[1] == loaded[2] == "own state", loaded
        ray.get([w.train.remote(2) for w in group.workers], timeout=60)


@pytest.mark.long
@pytest.mark.timeout(240)
def test_no_spare_and_no_smaller_size_allowed_ends_every_rank_cleanly(ray_cluster, tmp_path):
    with warm_job(tmp_path, 2) as (_config, coordinator, workers, _spares):
        group = WarmGroup(coordinator, workers, method="rejoin")
        pids = ray.get([w.pid.remote() for w in workers])
        training_until_evicted(coordinator, workers, pids[1])

        with pytest.raises(WarmRestartFailed, match="no spare free"):
            group.restart(timeout=60)
        # The survivor was told to leave: it is gone, not left behind as an idle actor.
        wait_for(lambda: not alive(workers[0]), 30, "the survivor to leave")


@pytest.mark.long
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
        assert outcome is not None and outcome.notices[0]["source"] == "rejoin", outcome
        wait_for(lambda: not alive(workers[0]), 30, "the survivor to leave")
        wait_for(lambda: not alive(spare), 30, "the spare to leave")


# --- it never makes an ending worse ---------------------------------------------------------


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_spare_that_died_ends_the_warm_restart_and_every_rank_leaves(ray_cluster, tmp_path):
    """The only spare is killed after it registered: no group of the old size can form. Every
    process is out within the rendezvous timeout, and the checkpoint stands for a cold start."""
    with warm_job(tmp_path, 2, spares=1, rejoin_timeout_s=6.0) as (config, coordinator, w, s):
        group = WarmGroup(coordinator, w, spares=s, method="rejoin")
        pids = ray.get([x.pid.remote() for x in w])
        ray.kill(s[0], no_restart=True)
        wait_for(lambda: not alive(s[0]), 30, "the spare to be gone")
        training_until_evicted(coordinator, w, pids[1])

        with pytest.raises(WarmRestartFailed) as failed:
            group.restart(timeout=60)
        assert failed.value.reason, "the failure says why"
        gone_within(w, 20, "the survivor to leave")
        assert latest_committed(config.checkpoint_dir) is not None, "the cold path still has it"


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_second_notice_before_the_rejoin_ends_every_rank_cleanly(ray_cluster, tmp_path):
    """A survivor gets SIGTERM while it waits to rejoin: it leaves at once, the other members
    cannot form the group without it and leave within the rendezvous timeout."""
    with warm_job(tmp_path, 3, spares=1, rejoin_timeout_s=6.0) as (_c, coordinator, w, s):
        group = WarmGroup(coordinator, w, spares=s, method="rejoin")
        pids = ray.get([x.pid.remote() for x in w])
        training_until_evicted(coordinator, w, pids[0])
        outcome = coordinator.wait_outcome(timeout=60, cycle=0)
        assert outcome is not None and outcome.warm["result"] == "rejoining"

        os.kill(pids[2], signal.SIGTERM)  # the second notice, to a survivor waiting to rejoin
        wait_for(lambda: not alive(w[2]), 20, "the signalled survivor to leave")
        with pytest.raises(WarmRestartFailed, match="of 3 member"):
            group.restart(timeout=60)
        gone_within([w[1], s[0]], 30, "the other members to leave")


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_coordinator_lost_before_the_rejoin_ends_every_survivor(ray_cluster, tmp_path):
    """The coordinator dies after deciding: the driver's restart says so, and each survivor,
    which keeps checking on it while it waits, leaves long before ``rejoin_timeout_s``."""
    with warm_job(tmp_path, 2, spares=1, rejoin_timeout_s=60.0) as (_c, coordinator, w, s):
        group = WarmGroup(coordinator, w, spares=s, method="rejoin")
        pids = ray.get([x.pid.remote() for x in w])
        training_until_evicted(coordinator, w, pids[1])
        assert coordinator.wait_outcome(timeout=60, cycle=0).warm["result"] == "rejoining"

        ray.kill(coordinator.handle, no_restart=True)
        gone_within([w[0]], 20, "the survivor to leave (well before rejoin_timeout_s=60)")
        with pytest.raises(WarmRestartFailed, match="coordinator is gone"):
            group.restart(timeout=30)


# --- 20 cycles in a row --------------------------------------------------------------------


def _process_resources(pid: int) -> dict[str, int]:
    """Threads, open fds, listening TCP ports and resident memory (kB) of a local process."""
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[8:-1])
    listening = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                    listening.add(int(fields[1].rsplit(":", 1)[1], 16))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": len(fds),
        "listening": len(listening),
        "rss_kb": rss,
    }


@pytest.mark.long
@pytest.mark.timeout(900)
def test_ten_warm_cycles_in_a_row_leak_no_threads_fds_ports_actors_or_memory(ray_cluster, tmp_path):
    """Rank 0 is evicted 10 times; each time a new spare takes its slot. Each restart resumes
    from the step the ranks had reached, every replica the same state (a survivor's parked step
    once outlived its cycle and labelled every later save with it). Ranks 1 and 2 survive
    every cycle in the same processes, as does the coordinator: their threads, open files,
    listening ports and memory stay flat, and every evicted process is gone. (Flat over the
    last 7 cycles: a thread, two descriptors or 2.3 MB kept per cycle fails it; the long soak
    is a benchmark's job, not the suite's.)"""
    from ray_graceful.ray_adapter import dead_actors

    cycles = 10
    with warm_job(tmp_path, 3, spares=1) as (config, coordinator, workers, spares):
        created = {a: ray.get(a.actor_id.remote()) for a in [*workers, *spares]}
        pid_of = {a: ray.get(a.pid.remote()) for a in [*workers, *spares]}  # asked while idle
        group = WarmGroup(coordinator, workers, spares=spares, method="rejoin")
        watched = {
            "coordinator": coordinator.stats()["pid"],
            "rank 1": ray.get(workers[1].pid.remote()),
            "rank 2": ray.get(workers[2].pid.remote()),
        }
        samples: list[dict[str, dict[str, int]]] = []
        for cycle in range(cycles):
            spare = Worker.remote(config=config)  # the next spare starts while this cycle runs
            step = ray.get(group.workers[1].train.remote(0))  # its current step
            running = [w.train.remote(10_000, 0.02) for w in group.workers]
            wait_for(
                lambda step=step: all(
                    (r["last_step"] or 0) >= step + 3 for r in coordinator.status()["ranks"]
                ),
                60,
                f"cycle {cycle}: every rank 3 steps on",
                every=0.05,
            )
            os.kill(pid_of[group.workers[0]], signal.SIGTERM)
            ready, _ = ray.wait(running, num_returns=3, timeout=60)
            assert len(ready) == 3, f"cycle {cycle}: a training call did not end"
            restart = group.restart(timeout=60)
            assert [m.was for m in restart.members] == [
                "spare for rank 0",
                "survivor of rank 1",
                "survivor of rank 2",
            ], f"cycle {cycle}: {restart.members}"
            assert restart.step >= step + 3, f"cycle {cycle}: resumed at {restart.step}, not past"
            snaps = ray.get([w.snapshot.remote() for w in group.workers])
            assert {s["step"] for s in snaps} == {restart.step}, f"cycle {cycle}: {snaps}"
            for other in snaps[1:]:  # replicas of one shard: bitwise the same state
                assert all(torch.equal(v, other["state"][k]) for k, v in snaps[0]["state"].items())
            assert ray.get([w.all_reduce_rank.remote() for w in group.workers]) == [6.0] * 3
            created[spare] = ray.get(spare.actor_id.remote())
            pid_of[spare] = ray.get(spare.pid.remote())
            group.add_spares([spare])
            samples.append({name: _process_resources(pid) for name, pid in watched.items()})

        # Every process that was evicted is gone: the group's 3 and the one waiting spare are
        # the only live actors this test created.
        gone = {created[a] for a in created} - {created[a] for a in group.workers + group.spares}
        assert len(gone) == cycles
        assert dead_actors(gone) == gone, "an evicted actor lingers"

        first, last = samples[2], samples[-1]  # after 3 cycles: lazily made pools exist
        print({name: [samples[i][name] for i in (0, 2, -1)] for name in watched})  # for -s
        for name in watched:
            grew = {k: last[name][k] - first[name][k] for k in first[name]}
            assert grew["threads"] <= 2, (name, grew, [s[name]["threads"] for s in samples])
            assert grew["fds"] <= 4, (name, grew, [s[name]["fds"] for s in samples])
            assert grew["listening"] <= 0, (name, grew, [s[name]["listening"] for s in samples])
            assert grew["rss_kb"] <= 16 * 1024, (name, grew, [s[name]["rss_kb"] for s in samples])
