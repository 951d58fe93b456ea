"""The memory tier's faults: keepers lost or drained, savers killed, budgets, cycles in a row.

Each runs a real coordinator with ``memory_replicas=1``, gloo ranks on extra raylets, real
drains and real kills, and records what it saw for docs/reliability.md (``RG_FAULT_REPS``
repeats them, ``RG_FAULTS_SUMMARY`` writes the table). Nothing torn is ever listed as
committed, in either tier; a restart never mixes steps.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
import ray
import torch

from ray_graceful import latest_committed
from ray_graceful.coordinator import Coordinator
from ray_graceful.ray_adapter import drain_node
from tests import actors
from tests.helpers import free_port, kill_actors, wait_for, wait_in_collective, wait_saving
from tests.memory_groups import drain_b_and_conclude, place, start_group, train_then_block


def test_a_shard_over_the_keepers_budget_goes_to_disk_and_the_outcome_says_so(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Two 2 MiB shards, a 3 MiB budget on node a: one is held in memory, the other is saved
    to disk by its saver; the checkpoint is committed across both tiers and made durable."""
    config = memory_config.replace(memory_budget_mb=3)
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = start_group(
            config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2, ballast_mb=2
        )
        train_then_block(ranks)
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert len(outcome.committed["holders"]) == 1 and len(outcome.committed["on_disk"]) == 1
        details = [s["detail"] for r in outcome.reports for s in r["phases"] if s["name"] == "save"]
        assert any("over its budget" in d and "saving to disk" in d for d in details), details
        durable = coordinator.wait_durable(0, timeout=30)
        assert durable is not None and "path" in durable, durable
        ckpt = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert ckpt.step == 3 and sorted(ckpt.shards) == ["trainer/0", "trainer/1"]
        fault_log.record(
            "memory tier: a shard over its keeper's budget", 4, 4, 0, "committed", pids
        )
    finally:
        coordinator.shutdown()


def test_two_cycles_in_a_row_commit_in_memory_and_the_older_is_released(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Cycle 0: node b drained, step 3 committed in a's keeper. The group restarts on a and the
    head from memory; cycle 1: SIGTERM to a rank on the head, step 5 committed in a's keeper.
    Once step 5 is durable, the keepers hold nothing of step 3: memory does not grow."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = start_group(config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2)
        train_then_block(ranks)
        drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert coordinator.wait_durable(0, timeout=30)["path"]

        placement = ["a", "a", "head", "head"]
        first = pids
        restarted, pids = start_group(config, exit_recorder, placement, ["0", "1"] * 2)
        loaded = ray.get(
            [r.restore.remote(s, config) for r, s in zip(restarted, "0101", strict=True)],
            timeout=60,
        )
        assert {x["step"] for x in loaded} == {3}
        ray.get([r.train.remote(2) for r in restarted], timeout=60)  # steps 4 and 5
        [r.train.remote(1000) for r in restarted[:-1]]
        wait_in_collective(pids[:-1])
        os.kill(pids[2], signal.SIGTERM)
        codes = {pid: exit_recorder.wait(pid, 20) for pid in pids}
        assert set(codes.values()) == {0}, codes
        second = coordinator.wait_outcome(timeout=30, cycle=1)
        assert second.result == "committed" and second.committed["step"] == 5, second.summary()
        assert set(second.committed["holders"]) == {"trainer/0", "trainer/1"}
        assert coordinator.wait_durable(1, timeout=30)["path"]
        held = [
            (shard["step"], shard["shard"])
            for stats in coordinator.keeper_stats().values()
            for shard in stats.get("shards", [])
        ]
        assert held and all(step == 5 for step, _ in held), held
        assert latest_committed(config.checkpoint_dir).step == 5
        fault_log.record("memory tier: two cycles in a row", 8, 8, 0, "committed", first + pids)
    finally:
        coordinator.shutdown()


def test_a_keeper_whose_node_is_drained_later_hands_its_shards_on(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Memory only (no checkpoint_dir). Cycle 0: node b drained, step 3 held by a's keeper.
    Then node a is drained too - no rank of the job runs there any more: its keeper hands both
    shards on to the keeper that stays (the head's) before a's deadline, and after a's keeper
    is gone a restarted group still loads step 3 from memory, the same weights."""
    config = memory_config.replace(checkpoint_dir=None)
    head = ray.get_runtime_context().get_node_id()
    coordinator = Coordinator.start(config, node_id=head)
    try:
        ranks, pids = start_group(config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2)
        weights = train_then_block(ranks)
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert set(map(tuple, outcome.committed["holders"].values())) == {(nodes["a"],)}

        drain_node(nodes["a"], time.time() + 15)

        def handed_on():
            record = coordinator.memory_record(0)
            return record if len(record["handed_on"]) == 2 else None

        committed = wait_for(handed_on, 30, "a's keeper to hand both shards on", every=0.5)
        assert committed["holders"] == {"trainer/0": [head], "trainer/1": [head]}, committed
        assert {(h["from"], h["to"]) for h in committed["handed_on"]} == {(nodes["a"], head)}
        assert committed["lost"] is None
        ray.kill(_keeper_of(coordinator, nodes["a"]))  # node a's memory is gone with it

        restarted, _ = start_group(config, exit_recorder, ["head"] * 2, ["0", "1"])
        loaded = ray.get(
            [r.restore.remote(s, config) for r, s in zip(restarted, "01", strict=True)],
            timeout=60,
        )
        assert [(x["tier"], x["step"]) for x in loaded] == [("memory-local", 3)] * 2, loaded
        assert ray.get(restarted[0].weights_sum.remote(), timeout=30) == pytest.approx(weights)
        kill_actors(*restarted)
        fault_log.record(
            "memory tier: a keeper's node drained later", 4, 4, 0, "committed (handed on)", pids
        )
    finally:
        coordinator.shutdown()


def test_a_saver_killed_during_its_save_is_replaced_by_its_backup_in_memory(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Node b is drained; rank 0 (on a) saves shard 0 slowly and is SIGKILLed halfway. Its
    backup, rank 2 on b, saves shard 0 and hands it to a's keeper: the cycle commits in memory
    with the fallback named, and nothing of the killed saver is held."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        port = free_port()
        ranks = place(actors.GracefulTrainer, "aabb", exit_recorder)
        ray.get(
            [
                r.setup.remote(
                    i, 4, "127.0.0.1", port, config, shard="01"[i % 2], save_seconds=4.0 * (i == 0)
                )
                for i, r in enumerate(ranks)
            ],
            timeout=120,
        )
        pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
        train_then_block(ranks)
        drain_node(nodes["b"], time.time() + 20)
        wait_for(lambda: coordinator.status()["plan_table"], 10, "the plan")
        wait_saving([pids[0]], 10)  # rank 0 is inside its 4 s save of shard 0
        os.kill(pids[0], signal.SIGKILL)
        codes = {pid: exit_recorder.wait(pid, 30) for pid in pids[1:]}
        assert set(codes.values()) == {0}, codes
        outcome = coordinator.wait_outcome(timeout=30, cycle=0)
        assert outcome.result == "committed", outcome.summary()
        assert outcome.committed["tier"] == "memory"
        assert [(f["shard"], f["why"]) for f in outcome.fallbacks] == [
            ("trainer/0", "its process died")
        ]
        holders = outcome.committed["holders"]
        assert holders["trainer/1"] == [nodes["a"]], holders
        assert len(holders["trainer/0"]) == 1 and nodes["b"] not in holders["trainer/0"], holders
        stats = coordinator.keeper_stats()
        # Node b is draining: its keeper may already be gone. The holders' keepers must answer.
        held = {node: k for node, k in stats.items() if "shards" in k}
        assert {n for hs in holders.values() for n in hs} <= set(held), stats
        assert sorted(s["shard"] for k in held.values() for s in k["shards"]) == [
            "trainer/0",
            "trainer/1",
        ]
        assert all(k["reserved_bytes"] == 0 for k in held.values()), stats
        fault_log.record(
            "memory tier: a saver killed during its save",
            4,
            4,
            0,
            "committed",
            pids,
            killed=[pids[0]],
        )
    finally:
        coordinator.shutdown()


def test_a_state_that_never_returns_is_covered_by_its_backup_in_memory(
    rep, fault_log, nodes, memory_config, exit_recorder, tmp_path
):
    """Node b is drained; rank 0 (on a) saves shard 0, but its state_dict() never returns.
    Its save fails at its budget - not tried again on disk, which would hang as long again -
    so its backup, rank 2 on b, still has the time to save shard 0: committed in memory.
    (Found by ``python -m benchmarks soak``: the retry on disk left the backup no time.)"""
    config = memory_config.replace(teardown_timeout_s=10.0, save_budget_s=5.0)
    coordinator = Coordinator.start(config)
    try:
        port = free_port()
        ranks = place(actors.GracefulTrainer, "aabb", exit_recorder)
        hang = str(tmp_path / "hanging")
        ray.get(
            [
                r.setup.remote(
                    i,
                    4,
                    "127.0.0.1",
                    port,
                    config,
                    shard="01"[i % 2],
                    hang_save=hang if i == 0 else None,
                )
                for i, r in enumerate(ranks)
            ],
            timeout=120,
        )
        pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
        train_then_block(ranks)
        drain_node(nodes["b"], time.time() + 20)
        codes = {pid: exit_recorder.wait(pid, 30) for pid in pids}
        assert None not in codes.values(), codes
        outcome = coordinator.wait_outcome(timeout=30, cycle=0)
        assert outcome.result == "committed", outcome.summary()
        assert outcome.committed["tier"] == "memory"
        details = [s["detail"] for r in outcome.reports for s in r["phases"] if s["name"] == "save"]
        assert any("not tried again on disk" in d for d in details), details
        (hung,) = [r for r in outcome.reports if r["ranks"][0]["rank"] == 0]
        (save,) = [s for s in hung["phases"] if s["name"] == "save"]
        assert save["duration_s"] < config.save_budget_s + 1.0, save  # failed at its budget
        assert any("backup of shard 'trainer/0': saving" in d for d in details), details
        fault_log.record(
            "memory tier: a saver whose state never returns", 4, 4, 0, "committed", pids
        )
    finally:
        coordinator.shutdown()


@ray.remote
def _value_in(seconds: float) -> bytes:
    time.sleep(seconds)
    return b"x" * (1 << 20)


@ray.remote(num_cpus=0)
class _Saver:
    """Owns an object still being computed, as a saver owns its shard during the hand-off."""

    def pending(self) -> list:
        self.ref = _value_in.options(num_cpus=0).remote(30.0)
        return [self.ref]

    def pid(self) -> int:
        return os.getpid()


def test_a_saver_killed_mid_hand_off_leaves_nothing_held(rep, fault_log, ray_cluster):
    """The keeper is inside its ``ray.get`` of the saver's object when the saver is SIGKILLed:
    the hold fails, nothing is held or reserved, and the shard can be held again whole (the
    backup's hand-off)."""
    from ray_graceful.memory.keeper import Keeper

    keeper = ray.remote(Keeper).options(num_cpus=0, max_concurrency=4).remote("j", "n", 1 << 30)
    saver = _Saver.remote()
    ref_in_list, pid = ray.get([saver.pending.remote(), saver.pid.remote()], timeout=60)
    hold = keeper.hold.remote(0, 3, "trainer/0", ref_in_list, 1 << 20, timeout_s=60.0)
    wait_for(
        lambda: ray.get(keeper.stats.remote(), timeout=10)["reserved_bytes"],
        30,
        "the keeper to start taking the shard",
        every=0.05,
    )
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(hold, timeout=60)
    stats = ray.get(keeper.stats.remote(), timeout=10)
    assert (stats["used_bytes"], stats["reserved_bytes"], stats["shards"]) == (0, 0, []), stats
    again = ray.put(b"y" * (1 << 20))
    reply = ray.get(keeper.hold.remote(0, 3, "trainer/0", [again], 1 << 20), timeout=60)
    assert reply.accepted and not reply.again, reply
    ray.kill(keeper)
    fault_log.record("memory tier: a saver killed mid-hand-off", 1, 1, 0, "n/a")


def test_a_keeper_lost_before_its_durable_copy_leaves_nothing_torn(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """The durable copy of step 3 cannot be written (a file sits where its directory goes);
    shard 0 is held on a, shard 1 on the head, and a's keeper is then killed. No manifest of
    step 3 ever appears, the outcome says the durable copy failed and the memory checkpoint is
    lost, and a restart loads step 1 from disk for *both* shards - never shard 1 at step 3 from
    memory next to shard 0 at step 1 from disk."""
    config = memory_config
    from ray_graceful.checkpoint import commit, save_state_dict, step_dir, write_shard

    state = {"step": 1, "state": {"model": torch.nn.Linear(4, 4).state_dict()}}
    seed = [
        write_shard(
            config.checkpoint_dir, 1, f"trainer/{s}", lambda p, _s: save_state_dict(state, p)
        )
        for s in "01"
    ]
    commit(config.checkpoint_dir, 1, ["trainer/0", "trainer/1"], seed)
    with open(step_dir(config.checkpoint_dir, 3), "w") as f:
        f.write("in the way")
    head = ray.get_runtime_context().get_node_id()
    coordinator = Coordinator.start(config, node_id=head)
    try:
        ranks, pids = start_group(config, exit_recorder, ["a", "head", "b", "b"], ["0", "1"] * 2)
        train_then_block(ranks)
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert outcome.committed["holders"] == {"trainer/0": [nodes["a"]], "trainer/1": [head]}
        durable = coordinator.wait_durable(0, timeout=30)
        assert durable is not None and "error" in durable, durable
        ray.kill(_keeper_of(coordinator, nodes["a"]))
        time.sleep(1.0)
        latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert latest.step == 1, "nothing of step 3 is listed as committed on disk"
        restarted, _ = start_group(config, exit_recorder, ["head", "head"], ["0", "1"])
        loaded = ray.get(
            [r.restore.remote(s, config) for r, s in zip(restarted, "01", strict=True)],
            timeout=60,
        )
        assert [(x["tier"], x["step"]) for x in loaded] == [("disk", 1)] * 2, loaded
        record = coordinator.memory_record(0)
        assert record["lost"] and "trainer/0" in record["lost"], record
        with open(os.path.join(config.report_dir, outcome.job_id, "memory-cycle-0.json")) as f:
            assert json.load(f) == record, "the record on disk says what the API returns"
        kill_actors(*restarted)
        fault_log.record(
            "memory tier: a keeper lost before its durable copy",
            4,
            4,
            0,
            "lost; last durable loaded (correct)",
            pids,
        )
    finally:
        coordinator.shutdown()


def test_a_coordinator_killed_before_its_memory_commit_comes_back_to_its_keepers(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Issue 22: the coordinator is frozen once its plan is out, and SIGKILLed once the savers
    have handed both shards to keepers - before it could commit. Ray restarts it; it adopts the
    same keeper processes, concludes the cycle from what they hold (committed in memory, one
    step), makes it durable, and a restarted group loads that step from memory."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        # each save takes 3 s once begun: the coordinator is frozen inside that window
        ranks, pids = start_group(
            config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2, save_seconds=3.0
        )
        train_then_block(ranks)
        keepers = coordinator.keeper_stats()
        handles = {
            n: ray.get_actor(k["name"], namespace="ray_graceful") for n, k in keepers.items()
        }
        pid = coordinator.stats()["pid"]
        drain_node(nodes["b"], time.time() + 12)
        wait_for(lambda: glob.glob(f"{config.report_dir}/*/inflight-cycle-0.json"), 10, "the plan")
        # Both savers (on node a) inside their save: their orders have arrived. Frozen before
        # the plan is out to every rank, a saver would never hear its order (the CI flake).
        wait_saving(pids[:2], timeout=10)
        os.kill(pid, signal.SIGSTOP)  # no report can land, nothing be committed
        try:
            wait_for(lambda: _held(handles) >= {"trainer/0", "trainer/1"}, 15, "both shards held")
        finally:
            os.kill(pid, signal.SIGKILL)
        codes = {p: exit_recorder.wait(p, 25) for p in pids}
        assert None not in codes.values(), codes
        outcome = coordinator.wait_outcome(timeout=40, cycle=0)
        assert outcome.result == "committed" and "restarted" in outcome.reason, outcome.summary()
        assert outcome.committed["tier"] == "memory"
        assert set(outcome.committed["holders"]) == {"trainer/0", "trainer/1"}
        after = coordinator.keeper_stats()
        assert {n: after[n]["pid"] for n in keepers} == {n: k["pid"] for n, k in keepers.items()}
        durable = coordinator.wait_durable(0, timeout=30)
        assert durable is not None and "path" in durable, durable
        latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert latest.step == outcome.committed["step"]
        restarted, _ = start_group(config, exit_recorder, ["a", "head"], ["0", "1"])
        loaded = ray.get(
            [r.restore.remote(s, config) for r, s in zip(restarted, "01", strict=True)],
            timeout=60,
        )
        assert {x["step"] for x in loaded} == {latest.step}, loaded
        kill_actors(*restarted)
        fault_log.record(
            "memory tier: coordinator killed between hand-off and commit",
            4,
            sum(c is not None for c in codes.values()),
            0,
            "committed (keepers adopted)",
            pids,
        )
    finally:
        coordinator.shutdown()


def _held(handles) -> set[str]:
    """The shards the keepers hold, asked of them directly (the coordinator is frozen)."""
    stats = ray.get([h.stats.remote() for h in handles.values()], timeout=10)
    return {shard["shard"] for s in stats for shard in s["shards"]}


def _keeper_of(coordinator, node_id: str):
    """This coordinator's keeper on ``node_id`` (named in its stats)."""
    return ray.get_actor(coordinator.keeper_stats()[node_id]["name"], namespace="ray_graceful")


def test_memory_only_a_shard_over_budget_is_never_written_to_the_working_directory(
    rep, fault_log, nodes, memory_config, exit_recorder
):
    """Review defect 4: with checkpoint_dir=None a shard no keeper could hold "fell back
    to disk" with an empty root: it landed in ./step-*/ of the worker's working directory, and
    the outcome said no-checkpoint. Now nothing is written anywhere, and the outcome says why."""
    config = memory_config.replace(memory_budget_mb=1, checkpoint_dir=None)  # 2 MiB shards
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = start_group(
            config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2, ballast_mb=2
        )
        cwds = set(ray.get([r.cwd.remote() for r in ranks], timeout=30))
        train_then_block(ranks)
        drain_node(nodes["b"], time.time() + 12)
        codes = {pid: exit_recorder.wait(pid, 20) for pid in pids}
        assert set(codes.values()) == {0}, codes
        outcome = coordinator.wait_outcome(timeout=30, cycle=0)
        assert outcome.result == "abandoned", outcome.summary()
        assert "not held in memory and no checkpoint_dir is configured" in outcome.reason
        for cwd in cwds:
            assert not glob.glob(os.path.join(cwd, "step-*")), f"a shard was written in {cwd}"
        fault_log.record(
            "memory tier only: a shard over budget, no checkpoint_dir",
            4,
            4,
            0,
            "abandoned (correct)",
            pids,
        )
    finally:
        coordinator.shutdown()
