"""A step held by a warm restart's survivors, as pure logic and as the rank's save makes it.

Who may hold (``WarmRestarts.may_hold``), how a held step is concluded (``carry_out``), when
it becomes a checkpoint (``HeldSteps``: every survivor's copy landed, at the size it was held),
and the survivor's snapshot (``EmergencySave``): its own copy, whatever the training does next.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from ray_graceful import GracefulConfig
from ray_graceful.checkpoint import ShardRecord, shard_file_name
from ray_graceful.coordinator.conclusion import CommitRequest, carry_out
from ray_graceful.coordinator.held import HeldSteps, Stage
from ray_graceful.coordinator.spare_pool import SpareRecord as Spare
from ray_graceful.coordinator.warm_restarts import Survivor, WarmRestarts
from ray_graceful.protocol import LateSave, RankSpec, Result
from ray_graceful.worker.emergency_save import EmergencySave, ShardSave
from ray_graceful.worker.save_ways import Fallback, HoldWay

STEP = 41


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
        [Spare("a", "spare", "na", 1)], frozenset(), held,
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
    record = part.decide(*args, spares, frozenset(), held, parked=frozenset({"p1", "p2"}))
    assert record is not None and record.result == "rejoining", record.reason
    assert (record.members["p3"].peer, record.members["p3"].shard_bytes) == (1, 2048)
    assert record.members["p1"].send_to == (3,)
    assert record.members["a"].peer == 2 and record.members["p2"].send_to == (0,)

    part = warm({1: "s1", 2: "s0", 3: "s1"})
    spares = [Spare("a", "spare", "na", 1)]
    record = part.decide(*args, spares, frozenset(), held, parked=frozenset({"p1", "p2", "p3"}))
    assert record.members["p3"].peer == -1 and record.members["p1"].send_to == ()


def test_a_spare_whose_shard_no_survivor_holds_loads_it_from_a_keeper():
    part = warm({1: "s1", 2: "s2", 3: "s3"})
    spares = [Spare("a", "spare", "na", 1)]
    held = {f"g/s{r}": (f"p{r}", 10) for r in (1, 2, 3)}
    record = part.decide(0, STEP, True, {p: True for p in part.survivors}, {"g": {0: "s0"}},
                         spares, frozenset(), held)  # fmt: skip
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


def test_the_step_is_committed_only_once_every_held_shards_copy_landed():
    steps = HeldSteps()
    steps.expect(
        request(record("g/0", "memory"), record("g/1", "held"), record("g/2", "held")), 9e9
    )
    done, why = steps.take(LateSave("p1", 3, (record("g/1", "memory"),)))
    assert (done, why) == (None, None)
    assert steps.describe(3)["missing"] == ["g/2"]
    done, why = steps.take(LateSave("p2", 3, (record("g/2", "memory"),)))
    assert why is None and done is not None
    commit = done.commit_request()
    assert commit.tier == "memory"
    assert [r.tier for r in commit.records] == ["memory"] * 3
    landed = carry_out(commit)
    assert landed.result is Result.COMMITTED and landed.memory is not None
    assert landed.memory.step == STEP
    assert done.stage is Stage.COMMITTING


def test_a_copy_that_is_not_what_was_held_loses_the_step():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held", nbytes=100)), 9e9)
    done, why = steps.take(LateSave("p1", 3, (record("g/1", "memory", nbytes=99),)))
    assert (done, why) == (None, None)
    held = steps.steps[3]
    assert held.stage is Stage.LOST
    assert "not what was held" in held.reason
    # Nothing more is taken for it, and it is never offered to a spare.
    assert steps.take(LateSave("p1", 3, (record("g/1", "memory"),)))[1] is not None
    assert steps.saved_copy("g/0", STEP) is None


def test_a_copy_that_failed_or_did_not_land_in_time_loses_the_step_with_the_reason():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9)
    steps.take(LateSave("p1", 3, (), failed=("g/1",), reason="keeper gone"))
    assert steps.steps[3].stage is Stage.LOST
    assert "keeper gone" in steps.describe(3)["reason"]

    now = time.time()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held"), cycle=4), now + 5)
    assert steps.overdue(4, now) is None  # not yet
    lost = steps.overdue(4, now + 6)
    assert lost is not None and lost.stage is Stage.LOST and "g/1" in lost.reason


def test_a_held_steps_disk_copy_that_failed_every_try_is_said_never_left_in_the_keepers():
    """The checkpoint directory replaced by a file after a held restart: ``durability`` said
    "in-keepers" with no reason for ever after."""
    steps = HeldSteps()
    held = steps.expect(request(record("g/0", "memory")), 9e9)
    held.reached(Stage.IN_KEEPERS)
    assert held.disk_copy_ended(None) is False and held.stage is Stage.IN_KEEPERS  # running
    assert held.disk_copy_ended({"error": "NotADirectoryError: ckpt", "tries": 3}) is True
    described = steps.describe(3)
    assert described["stage"] == "durable-failed"
    assert described["reason"] == "the disk copy failed: NotADirectoryError: ckpt"
    other = steps.expect(request(record("g/0", "memory"), cycle=4), 9e9)
    assert other.disk_copy_ended({"path": "/ckpt/step-9", "at": 1.0}) is True
    assert steps.describe(4)["stage"] == "on-disk" and other.durable_path == "/ckpt/step-9"


def test_late_saves_for_no_held_step_or_a_shard_not_held_are_refused():
    steps = HeldSteps()
    assert "no held step" in steps.take(LateSave("p", 9, ()))[1]
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9)
    assert "was not held" in steps.take(LateSave("p", 3, (record("g/0", "memory"),)))[1]


def test_a_spare_may_load_an_evicted_shard_of_the_held_step_a_cold_restart_may_not():
    steps = HeldSteps()
    steps.expect(request(record("g/0", "memory"), record("g/1", "held")), 9e9)
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
                         spares, frozenset(), held, parked=frozenset({"p2", "p3"}))  # fmt: skip
    assert record is not None and record.result == "rejoining", record.reason
    assert record.members["b"].shard == "s1" and record.members["b"].peer == -1, "a keeper's"

    steps = HeldSteps()
    steps.expect(request(record_of("g/s0", "held"), record_of("g/s1", "held")), 9e9)
    assert steps.awaiting_copy("g/s1", STEP) and steps.saved_copy("g/s1", STEP) is None
    assert not steps.awaiting_copy("g/s1", STEP - 1), "another step: nothing to wait for"
    steps.take(LateSave("p1", 3, (record_of("g/s1", "memory"),)))
    assert not steps.awaiting_copy("g/s1", STEP) and steps.saved_copy("g/s1", STEP) is not None
    steps.steps[3].lose("a copy failed")
    assert not steps.awaiting_copy("g/s0", STEP), "a lost step: nothing will come"


record_of = record
