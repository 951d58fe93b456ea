"""A step held by a warm restart's survivors, as pure logic and as the rank's save makes it.

Who may hold (``WarmRestarts.may_hold``), how a held step is concluded (``carry_out``), when
it becomes a checkpoint (``HeldSteps``: every survivor's copy landed, at the size it was held),
and the survivor's snapshot (``EmergencySave``): its own copy, whatever the training does next.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import torch

from ray_graceful import GracefulConfig
from ray_graceful.checkpoint import ShardRecord, shard_file_name
from ray_graceful.coordinator import events as ev
from ray_graceful.coordinator.conclusion import (
    CommitRequest,
    CommitResult,
    carry_out,
    written_through,
)
from ray_graceful.coordinator.held import HeldSteps, Stage
from ray_graceful.coordinator.spare_pool import SpareRecord as Spare
from ray_graceful.coordinator.warm_restarts import Survivor, WarmRestarts
from ray_graceful.protocol import LateSave, RankSpec, Reply, Result
from ray_graceful.worker.emergency_save import EmergencySave, ShardSave
from ray_graceful.worker.save_ways import Fallback, HoldWay

STEP = 41
T0 = NOW = 1_000.0  # the machine's parts run on the events' times: no clock is read


def record(shard: str, tier: str, nbytes: int = 100, step: int = STEP) -> ShardRecord:
    holders = ("survivor-node",) if tier == "held" else ("keeper-node",)
    return ShardRecord(shard, step, shard_file_name(shard), nbytes, 0, tier=tier,
                       holders=holders if tier != "disk" else ())  # fmt: skip


def request(*records: ShardRecord, cycle: int = 3) -> CommitRequest:
    expected = tuple(r.shard for r in records)
    return CommitRequest(cycle, "job", "held", "/ckpt", expected, records, replicas=1)


# --- who holds ----------------------------------------------------------------------------------


def warm(survivors: dict[int, str], **config) -> WarmRestarts:
    part = WarmRestarts(GracefulConfig(warm_restart=True, memory_replicas=1, **config), ("h", 1))
    part.survivors = {
        f"p{r}": Survivor(f"p{r}", RankSpec("g", r, 4, shard, True), "n1", 100 + r)
        for r, shard in survivors.items()
    }
    return part


def plan(shards: dict[int, str]) -> SimpleNamespace:
    orders = [SimpleNamespace(group="g", rank=r, shard=s) for r, s in shards.items()]
    return SimpleNamespace(orders=orders)


def test_survivors_hold_their_own_shards_where_a_spare_takes_every_evicted_slot():
    part = warm({1: "s1", 2: "s2", 3: "s3"})
    the_plan = plan({0: "s0", 1: "s1", 2: "s2", 3: "s3"})
    spare_nodes = part.spare_nodes(the_plan, [Spare("a", "spare", "na", 1)])
    assert part.may_hold(the_plan, spare_nodes) == {("g", 1), ("g", 2), ("g", 3)}
    # No spare: the warm restart may not go ahead - everyone saves before, as before.
    assert part.may_hold(the_plan, part.spare_nodes(the_plan, [])) == set()


def test_a_spare_receives_the_shard_a_surviving_replica_holds_from_it_over_the_group():
    part = warm({1: "s0", 2: "s2", 3: "s3"})  # rank 1 holds the evicted rank 0's shard too
    the_plan = plan({0: "s0", 1: "s0", 2: "s2", 3: "s3"})
    spare_nodes = part.spare_nodes(the_plan, [Spare("a", "spare", "na", 1)])
    assert part.may_hold(the_plan, spare_nodes) == {("g", 1), ("g", 2), ("g", 3)}

    held = {"g/s0": ("p1", 4096), "g/s2": ("p2", 10), "g/s3": ("p3", 10)}
    record = part.decide(
        0, STEP, True, {p: True for p in part.survivors}, {"g": {0: "s0"}},
        [Spare("a", "spare", "na", 1)], frozenset(), held, now=NOW,
    )  # fmt: skip
    assert record is not None and record.result == "rejoining", record.reason
    spare, holder = record.members["a"], record.members["p1"]
    assert (spare.rank, spare.peer, spare.shard_bytes) == (0, 1, 4096)
    assert holder.send_to == (0,)
    assert record.members["p2"].send_to == () and record.members["p3"].peer == -1


def test_a_survivor_not_parked_at_the_step_receives_its_held_shard_from_the_holder():
    """Found by the held soak: rank 3, a backup of shard s1 released from inside its step,
    cannot prove step k itself, and shard s1 at k was held by rank 1 alone (no keeper copy).
    It looked for s1 in the keepers, found only an older step, and the restart failed. Now it
    receives s1 from rank 1 over the group, as a spare does; parked at k, it keeps its own."""
    part = warm({1: "s1", 2: "s0", 3: "s1"})
    held = {"g/s1": ("p1", 2048), "g/s0": ("p2", 10)}
    spares = [Spare("a", "spare", "na", 1)]
    args = (0, STEP, True, {p: True for p in part.survivors}, {"g": {0: "s0"}})
    record = part.decide(*args, spares, frozenset(), held, parked=frozenset({"p1", "p2"}), now=NOW)
    assert record is not None and record.result == "rejoining", record.reason
    assert (record.members["p3"].peer, record.members["p3"].shard_bytes) == (1, 2048)
    assert record.members["p1"].send_to == (3,)
    assert record.members["a"].peer == 2 and record.members["p2"].send_to == (0,)

    part = warm({1: "s1", 2: "s0", 3: "s1"})
    spares = [Spare("a", "spare", "na", 1)]
    record = part.decide(
        *args, spares, frozenset(), held, parked=frozenset({"p1", "p2", "p3"}), now=NOW
    )
    assert record.members["p3"].peer == -1 and record.members["p1"].send_to == ()


def test_a_spare_whose_shard_no_survivor_holds_loads_it_from_a_keeper():
    part = warm({1: "s1", 2: "s2", 3: "s3"})
    spares = [Spare("a", "spare", "na", 1)]
    held = {f"g/s{r}": (f"p{r}", 10) for r in (1, 2, 3)}
    record = part.decide(0, STEP, True, {p: True for p in part.survivors}, {"g": {0: "s0"}},
                         spares, frozenset(), held, now=NOW)  # fmt: skip
    assert record.members["a"].peer == -1  # the evicted rank saved s0 itself
    assert all(record.members[f"p{r}"].send_to == () for r in (1, 2, 3))


def test_nobody_holds_without_a_memory_tier_or_with_holding_off():
    the_plan = plan({0: "s0", 1: "s1"})
    spares = [Spare("a", "spare", "na", 1)]
    for part in (warm({1: "s1"}, warm_restart_holds=False), warm({1: "s1"})):
        if part.config.warm_restart_holds:
            part.config = part.config.replace(memory_replicas=0, checkpoint_dir="/ckpt")
        assert part.may_hold(the_plan, part.spare_nodes(the_plan, spares)) == set()


# --- the conclusion: held, not committed --------------------------------------------------------


def test_a_cycle_whose_survivors_hold_concludes_held_and_commits_nothing():
    landed = carry_out(request(record("g/0", "memory"), record("g/1", "held")))
    assert landed.result is Result.HELD, landed.reason
    assert landed.committed == {"tier": "held", "step": STEP, "held": {"g/1": ["survivor-node"]}}
    assert landed.memory is None  # no memory checkpoint a restart could load


def test_a_held_cycle_missing_a_shard_or_at_two_steps_is_abandoned():
    missing = request(record("g/0", "memory"), record("g/1", "held"))
    missing = CommitRequest(3, "job", "held", "/ckpt", ("g/0", "g/1", "g/2"), missing.records, 1)
    assert carry_out(missing).result is Result.ABANDONED
    torn = carry_out(request(record("g/0", "memory"), record("g/1", "held", step=STEP + 1)))
    assert torn.result is Result.ABANDONED
    assert "steps" in torn.reason


# --- the held step on its way: held -> committing (-> in keepers -> on disk) | lost ----------


def kinds(decisions) -> list[str]:
    return [type(d).__name__ for d in decisions]


def test_the_step_is_committed_only_once_every_held_shards_copy_landed():
    steps = HeldSteps()
    out = steps.expect(
        request(record("g/0", "memory"), record("g/1", "held"), record("g/2", "held")),
        until=T0 + 30,
        now=T0,
    )
    assert out == [ev.HeldChanged(3, steps.describe(3)), ev.HeldTimer(3, T0 + 30)]
    out = steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0 + 1)
    assert out == [ev.Replied(Reply.ok())]
    assert steps.describe(3)["missing"] == ["g/2"]
    out = steps.late(LateSave("p2", 3, (record("g/2", "memory"),)), T0 + 2)
    assert kinds(out) == ["Replied", "CommitHeld"]
    commit = out[1].request
    assert commit.tier == "memory"
    assert [r.tier for r in commit.records] == ["memory"] * 3
    held = steps.steps[3]
    assert held.stage is Stage.COMMITTING and held.at["committing"] == T0 + 2
    landed = carry_out(commit)
    assert landed.result is Result.COMMITTED and landed.memory is not None
    assert landed.memory.step == STEP
    out = steps.committed(3, landed, T0 + 3)
    assert out == [ev.HeldChanged(3, steps.describe(3)), ev.MakeDurable(3, landed.memory)]
    assert held.stage is Stage.IN_KEEPERS and held.at["in-keepers"] == T0 + 3
    assert steps.durable(3, None, T0 + 4) == []  # the disk copy still runs
    out = steps.durable(3, {"path": "/ckpt/step-00000009"}, T0 + 5)
    assert kinds(out) == ["HeldChanged"] and out[0].record["stage"] == "on-disk"
    assert held.at["on-disk"] == T0 + 5


def test_a_cold_restart_waits_for_a_held_step_still_settling_not_the_step_before():
    """Every survivor left after holding (Ray Train's full restart once they were SIGTERMed
    too): their copies land as they go, and the new workers' loads must wait for the commit,
    not resume from the step before it (``durability.loadable``)."""
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0)
    assert steps.settling("g/1") and steps.settling("g/0") and not steps.settling("h/0")
    out = steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0 + 1)
    assert steps.settling("g/1"), "committing in memory: not a checkpoint yet"
    steps.committed(3, carry_out(out[1].request), T0 + 2)
    assert not steps.settling("g/1"), "in the keepers: loadable as any checkpoint"
    lost = HeldSteps()
    lost.expect(request(record("g/1", "held")), T0 + 5, T0)
    lost.due(3, T0 + 5)
    assert not lost.settling("g/1"), "lost: the step before it is the checkpoint"


def test_a_copy_that_is_not_what_was_held_loses_the_step():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held", nbytes=100)), 9e9, T0)
    out = steps.late(LateSave("p1", 3, (record("g/1", "memory", nbytes=99),)), T0 + 1)
    assert kinds(out) == ["Replied", "HeldLost", "HeldChanged"]
    held = steps.steps[3]
    assert held.stage is Stage.LOST and held.at["lost"] == T0 + 1
    assert "not what was held" in held.reason and out[1] == ev.HeldLost(3, STEP, held.reason)
    # Nothing more is taken for it, and it is never offered to a spare.
    again = steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0 + 2)
    assert kinds(again) == ["Rejected", "Replied"] and not again[1].answer.accepted
    assert steps.saved_copy("g/0", STEP) is None


def test_a_copy_that_failed_or_did_not_land_in_time_loses_the_step_with_the_reason():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0)
    steps.late(LateSave("p1", 3, (), failed=("g/1",), reason="keeper gone"), T0 + 1)
    assert steps.steps[3].stage is Stage.LOST
    assert "keeper gone" in steps.describe(3)["reason"]

    steps.expect(request(record("g/0", "memory"), record("g/1", "held"), cycle=4), T0 + 5, T0)
    assert steps.due(4, T0 + 4) == []  # not yet
    lost = steps.due(4, T0 + 6)
    assert kinds(lost) == ["HeldLost", "HeldChanged"] and "g/1" in lost[0].reason
    assert steps.steps[4].stage is Stage.LOST
    assert steps.due(4, T0 + 7) == []  # once


def test_a_failed_memory_commit_loses_the_step():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0)
    steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0 + 1)
    out = steps.committed(3, CommitResult(Result.ABANDONED, "keeper gone"), T0 + 2)
    assert kinds(out) == ["HeldLost", "HeldChanged"]
    assert "the memory commit failed: keeper gone" in out[0].reason


def test_a_held_step_whose_keepers_are_all_leaving_is_written_through_to_disk_not_lost():
    """Every Ray Train worker SIGTERMed in turn: the survivors held the step, then left too,
    copying it to keepers on nodes that all have notices. Not a memory checkpoint (it would
    vanish with them): ``carry_out`` asks for a write-through, and once the keepers wrote it,
    the step is on disk - or, where they could not, lost with both reasons."""
    wrote_or_not = [
        ({"path": "/ckpt/step-00000041"}, Stage.ON_DISK),
        ({"error": "gone"}, Stage.LOST),
    ]
    for wrote, stage in wrote_or_not:
        steps = HeldSteps()
        leaving = dataclasses.replace(
            request(record("g/0", "memory"), record("g/1", "held")),
            evicted_nodes=frozenset({"keeper-node", "survivor-node"}),
        )
        steps.expect(leaving, 9e9, T0)
        out = steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0 + 1)
        landed = carry_out(out[1].request)
        assert landed.result is Result.ABANDONED and landed.memory is None
        assert "held by 0 node(s) not being evicted" in landed.reason
        assert landed.write_through is not None and landed.write_through.step == STEP
        assert steps.settling("g/1"), "a cold restart's load waits for the write-through"
        out = steps.committed(3, written_through(landed, wrote), T0 + 2)
        held = steps.steps[3]
        assert held.stage is stage and not steps.settling("g/1")
        if stage is Stage.ON_DISK:
            assert kinds(out) == ["HeldChanged"], "no MakeDurable: it is on disk already"
            assert held.durable_path == "/ckpt/step-00000041" and held.at["on-disk"] == T0 + 2
        else:
            assert kinds(out) == ["HeldLost", "HeldChanged"]
            assert "not being evicted" in held.reason and "write-through" in held.reason
    # Without a checkpoint_dir there is nowhere to write it through: abandoned, as before.
    nowhere = dataclasses.replace(leaving, root=None, tier="memory")
    assert carry_out(nowhere).write_through is None


def test_a_held_steps_disk_copy_that_failed_every_try_is_said_never_left_in_the_keepers():
    """The checkpoint directory replaced by a file after a held restart: ``durability`` said
    "in-keepers" with no reason for ever after."""
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory")), 9e9, T0)
    held = steps.steps[3]
    held.reached(Stage.IN_KEEPERS, T0)
    assert steps.durable(3, None, T0 + 1) == [] and held.stage is Stage.IN_KEEPERS  # running
    assert kinds(steps.durable(3, {"error": "NotADirectoryError: ckpt", "tries": 3}, T0 + 2)) == [
        "HeldChanged"
    ]
    described = steps.describe(3)
    assert described["stage"] == "durable-failed"
    assert described["reason"] == "the disk copy failed: NotADirectoryError: ckpt"
    steps.expect(request(record("g/0", "memory"), cycle=4), 9e9, T0)
    assert kinds(steps.durable(4, {"path": "/ckpt/step-9", "at": 1.0}, T0 + 3)) == ["HeldChanged"]
    assert steps.describe(4)["stage"] == "on-disk"
    assert steps.steps[4].durable_path == "/ckpt/step-9"


def test_late_saves_for_no_held_step_or_a_shard_not_held_are_refused():
    steps = HeldSteps()
    refused = steps.late(LateSave("p", 9, ()), T0)
    assert "no held step" in refused[1].answer.reason
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0)
    refused = steps.late(LateSave("p", 3, (record("g/0", "memory"),)), T0)
    assert "was not held" in refused[1].answer.reason


def test_a_copy_that_lands_before_its_cycle_concluded_is_taken_when_the_step_is_expected():
    """A survivor that left before its warm restart was decided copies its held shard as it
    goes - before the cycle concluded. That copy is kept (answered ok) and counted once the
    step is expected: the step commits, and a member taking that slot loads the copy."""
    steps = HeldSteps()
    early = LateSave("p1", 3, (record("g/1", "memory"),))
    assert kinds(steps.late(early, T0, open_cycle=3)) == ["Replied"]
    assert steps.late(early, T0, open_cycle=3)[0].answer.accepted
    steps.early[3].pop()  # the same copy once
    decisions = steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0 + 1)
    assert kinds(decisions) == ["HeldChanged", "HeldTimer", "CommitHeld"]
    assert steps.saved_copy("g/1", STEP).holders == ("keeper-node",)
    assert not steps.awaiting_copy("g/1", STEP) and steps.early == {}


def test_an_early_copy_whose_cycle_concluded_without_a_held_step_is_refused_with_the_reason():
    steps = HeldSteps()
    steps.late(LateSave("p1", 3, (record("g/1", "memory"),)), T0, open_cycle=3)
    refused = steps.not_held(3)
    assert [(d.summary, d.reason) for d in refused] == [
        ("late save of cycle 3 from p1", "cycle 3 concluded without a held step")
    ]
    assert steps.early == {} and steps.not_held(3) == []


def test_a_spare_may_load_an_evicted_shard_of_the_held_step_a_cold_restart_may_not():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9, T0)
    assert steps.saved_copy("g/0", STEP).holders == ("keeper-node",)
    assert steps.saved_copy("g/0", STEP - 1) is None  # another step: not this one's copy
    assert steps.saved_copy("g/1", STEP) is None  # held by a survivor, no keeper has it yet


# --- the survivor's snapshot ----------------------------------------------------------------------


def saving(state, **config) -> EmergencySave:
    order = ShardSave("", "g/1", 5.0, lambda path, step: None, "g", 1, keepers=("k",),
                      state=lambda: state, hold=True)  # fmt: skip
    return EmergencySave(GracefulConfig(**config), [order], time.monotonic() + 30)


def test_a_held_snapshot_is_its_own_copy_whatever_the_training_does_next():
    """Reported held at once; inside Ray its copy is made in the background, and once
    ``settle`` said it is done (``rejoin`` waits for that before the state may move) it is its
    own copy, whatever the training does to the live state next."""
    weights = torch.arange(8, dtype=torch.float32)
    state = {"model": {"w": weights}, "step_count": 5, "rng": [1, 2]}
    save = saving(state)
    done = save.run(STEP)
    assert "held by this process" in done
    [held] = save.held
    assert save.saved == [held.record] and held.record.tier == "held"
    assert held.snapshot.settle(30.0) is None, "the copy is made"
    weights.add_(100.0)  # the group trains on, in place
    state["rng"].append(3)
    from ray_graceful.memory.tree import from_tree, tree_bytes

    snapshot = from_tree(held.snapshot.value())  # outside Ray: a tree of copies
    assert snapshot["step"] == STEP
    assert torch.equal(snapshot["state"]["model"]["w"], torch.arange(8, dtype=torch.float32))
    assert snapshot["state"]["rng"] == [1, 2]
    assert held.record.bytes == held.snapshot.nbytes == tree_bytes(held.snapshot.value())


def test_a_snapshot_over_the_memory_budget_is_not_held_and_the_save_says_so():
    big = {"w": torch.zeros(1 << 19)}  # 2 MiB, budget 1 MiB
    save = saving(big, memory_budget_mb=1)
    # Not held: the save goes on to its next way (the hand-off to keepers, then disk).
    fallback = HoldWay().try_save(save.ways, save.orders[0], STEP, [])
    assert isinstance(fallback, Fallback)
    assert "do not fit memory_budget_mb=1 for a snapshot; saving it now" in fallback.why
    assert save.held == [] and save.saved == []


def test_a_snapshot_over_the_hosts_free_memory_is_not_taken_and_says_so():
    """A warm restart holds by default: a shard larger than the host's free RAM (a GPU model
    on a small host) must be saved, not copied into memory it would exhaust."""
    from ray_graceful.memory.handoff import host_memory_available, take_snapshot

    state = {"w": torch.zeros(1 << 10)}  # 4 KiB
    why = take_snapshot(state, STEP, 1 << 30, available=lambda: 1024)
    assert isinstance(why, str)
    assert why.endswith("bytes do not fit the host's free memory (1024 bytes) for a snapshot")
    assert not isinstance(take_snapshot(state, STEP, 1 << 30, available=lambda: None), str)
    free = host_memory_available()  # Linux: MemAvailable, read the way the check reads it
    assert free is not None and free > 0


# --- the late copy --------------------------------------------------------------------------------


def test_a_late_copy_waits_for_the_group_then_reports_what_did_not_land():
    """It starts at ``go()`` (the group trains again), not before; a copy that fails (a keeper
    gone) is reported failed with its reason, one that lands with its record - none dropped."""
    from ray_graceful.memory.handoff import MemoryTierError, take_snapshot
    from ray_graceful.worker.late_copy import HeldShard, LateCopies

    def keepers(snapshot, shard, keepers, *rest) -> ShardRecord:
        if keepers == ("gone",):
            raise MemoryTierError("keeper gone")
        return record(shard, "memory", step=snapshot.step)

    told: list[tuple] = []
    snapshot = take_snapshot({"w": torch.ones(4)}, STEP, 1 << 20)
    shards = [
        HeldShard(snapshot, record("g/1", "held"), ("gone",), "ns", 1.0),
        HeldShard(snapshot, record("g/2", "held"), ("here",), "ns", 1.0),
    ]
    late = LateCopies(keepers)
    late.take(3, shards, lambda *args: told.append(args), wait_s=30.0)
    assert late.waiting and late.pending() and told == []  # until the group trains again
    assert late.finish(10.0)  # the process leaves: copy now, and wait for it
    [(cycle, saved, failed, why)] = told
    assert (cycle, [r.shard for r in saved], failed) == (3, ["g/2"], ["g/1"])
    assert why == "g/1: MemoryTierError: keeper gone"
    # The ask to rejoin and a leave both hand a cycle's shards over: copied once.
    late.take(3, shards, lambda *args: told.append(args), wait_s=30.0)
    assert not late.pending() and len(told) == 1


def test_a_spare_in_the_slot_of_a_holder_found_faulty_waits_for_its_copy_not_an_older_step():
    """A held survivor found FAULTY after the plan is told to leave, and copies its snapshot to
    the keepers as it goes. The spare that takes its slot cannot receive the shard from it over
    the group (it is no member): it loads from the keepers, and asked before the copy landed it
    used to be offered the older step - "found at step k-1, not the committed step k", the
    restart failed. The coordinator now holds the answer while that copy is on its way."""
    part = warm({1: "s1", 2: "s0", 3: "s1"})
    part.survivors.pop("p1")  # found FAULTY after the plan: no member (``after_cycle``)
    held = {"g/s1": ("p1", 2048), "g/s0": ("p2", 10)}
    spares = [Spare("a", "spare", "na", 1), Spare("b", "spare", "nb", 1)]
    record = part.decide(0, STEP, True, {"p2": True, "p3": True}, {"g": {0: "s0", 1: "s1"}},
                         spares, frozenset(), held, parked=frozenset({"p2", "p3"}),
                         now=NOW)  # fmt: skip
    assert record is not None and record.result == "rejoining", record.reason
    assert record.members["b"].shard == "s1" and record.members["b"].peer == -1, "a keeper's"

    steps = HeldSteps()
    steps.expect(request(record_of("g/s0", "held"), record_of("g/s1", "held")), 9e9, T0)
    assert steps.awaiting_copy("g/s1", STEP) and steps.saved_copy("g/s1", STEP) is None
    assert not steps.awaiting_copy("g/s1", STEP - 1), "another step: nothing to wait for"
    steps.late(LateSave("p1", 3, (record_of("g/s1", "memory"),)), T0)
    assert not steps.awaiting_copy("g/s1", STEP) and steps.saved_copy("g/s1", STEP) is not None
    steps.steps[3].lose("a copy failed", T0)
    assert not steps.awaiting_copy("g/s0", STEP), "a lost step: nothing will come"


record_of = record
