"""The coordinator's warm-restart part as pure logic: who joins as which rank, or why not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ray_graceful import GracefulConfig
from ray_graceful.coordinator.spare_pool import SpareRecord as Spare
from ray_graceful.coordinator.warm_restarts import Survivor, WarmRestarts
from ray_graceful.protocol import (
    LoadedFrom,
    RankSpec,
    Rejoined,
    RejoinResult,
    Rendezvous,
    RendezvousAction,
    SpareAction,
    SpareAnswer,
    train_slot_member,
)

NOW = 1_000.0  # the events' time: the warm-restart part reads no clock


def warm(survivors: dict[int, str], world: int = 4, **config) -> WarmRestarts:
    """A warm part whose survivors hold ``{rank: shard}`` of group "g" (world ``world``)."""
    part = WarmRestarts(GracefulConfig(warm_restart=True, **config), ("10.0.0.1", 2345))
    part.survivors = {
        f"p{rank}": Survivor(f"p{rank}", RankSpec("g", rank, world, shard, True), "n1", 100 + rank)
        for rank, shard in survivors.items()
    }
    return part


def decide(part: WarmRestarts, evicted: dict[int, str], spares=(), step=7, committed=True):
    return part.decide(
        0,
        step,
        committed,
        {pid: True for pid in part.survivors},
        {"g": evicted},
        list(spares),
        frozenset({"gone"}),
        now=NOW,
    )


def test_a_spare_takes_the_evicted_rank_and_its_shard():
    part = warm({1: "model", 2: "model", 3: "model"})
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    assert record.result == "rejoining"
    assert {m: (r.rank, r.world_size, r.was) for m, r in record.members.items()} == {
        "s1": (0, 4, "spare for rank 0"),
        "p1": (1, 4, "survivor of rank 1"),
        "p2": (2, 4, "survivor of rank 2"),
        "p3": (3, 4, "survivor of rank 3"),
    }
    answer = record.members["s1"]
    assert (answer.step, answer.shard, answer.store_host, answer.store_port) == (
        7,
        "model",
        "10.0.0.1",
        2345,
    )
    assert answer.prefix == "ray_graceful/cycle1/g"  # a new prefix per cycle: stale ranks miss it


def test_spares_on_a_leaving_node_and_standbys_are_never_handed_a_slot():
    part = warm({1: "model"}, world=2)
    spares = [Spare("gone-spare", "spare", "gone", 1), Spare("standby", "standby", "n2", 2)]
    record = decide(part, {0: "model"}, spares)
    assert record.result == "cold" and "no spare free" in record.reason
    assert record.told_to_leave == {"p1": record.reason}


def test_the_group_continues_smaller_where_allowed_and_every_shard_keeps_a_holder():
    part = warm({0: "model", 2: "model", 3: "model"}, min_world_size=2)
    record = decide(part, {1: "model"})
    assert record.result == "rejoining"
    assert sorted((r.rank, r.world_size, r.was) for r in record.members.values()) == [
        (0, 3, "survivor of rank 0"),
        (1, 3, "survivor of rank 2"),
        (2, 3, "survivor of rank 3"),
    ]


@pytest.mark.parametrize(
    ("floor", "evicted", "why"),
    [
        (0, {1: "model"}, "min_world_size is 0"),
        (4, {1: "model"}, "below min_world_size 4"),
        (2, {1: "1"}, "shard(s) 1 would have no holder"),
    ],
)
def test_a_smaller_group_is_refused_with_the_reason(floor, evicted, why):
    part = warm(
        {0: "0", 2: "2", 3: "3"} if evicted == {1: "1"} else {0: "model", 2: "model", 3: "model"},
        min_world_size=floor,
    )
    record = decide(part, evicted)
    assert record.result == "cold" and why in record.reason


def test_without_a_committed_step_or_with_a_silent_survivor_every_survivor_leaves():
    part = warm({1: "model"}, world=2)
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)], committed=False)
    assert record.result == "cold" and "no checkpoint was committed" in record.reason
    part = warm({1: "model", 2: "model"}, world=3)
    record = part.decide(
        0,
        7,
        True,
        {"p1": True},
        {"g": {0: "model"}},
        [Spare("s", "spare", "n", 1)],
        frozenset(),
        now=NOW,
    )
    assert record.result == "cold" and "sent no teardown report (pid 102)" in record.reason


def test_a_member_has_no_answer_before_the_decision_and_its_own_after_it():
    """The actor holds a member's ask until ``answer`` has one (``CoordinatorActor.rendezvous``)."""
    part = warm({1: "model"}, world=2)
    assert part.answer("p1") is None  # the cycle has not concluded: its ask is held
    decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    answer = part.answer("p1")
    assert answer is not None
    assert (answer.action, answer.rank, answer.world_size) == ("join", 1, 2)
    stranger = part.answer("someone-else")
    assert stranger is not None
    assert stranger.action == "leave" and "not a member" in stranger.reason


def test_one_member_that_cannot_join_fails_the_warm_restart_with_its_reason():
    part = warm({1: "model", 2: "model"}, world=3)
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    ok = Rejoined("joined", "p1", "g", 1, 3, 7, record.cycle, loaded_from="own state")
    assert part.joined(ok, NOW) is None and record.result == "rejoining"
    bad = Rejoined("left", "s1", "g", 0, 3, 7, record.cycle, reason="load failed: disk gone")
    assert part.joined(bad, NOW) is record
    assert record.result == "failed" and "spare for rank 0: load failed" in record.reason
    assert record.finished
    described = {m["member"]: m["action"] for m in record.to_dict()["members"]}
    assert described == {"s1": "left", "p1": "joined", "p2": "pending"}


def test_every_member_joined_completes_the_record():
    part = warm({1: "model"}, world=2)
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    for member, answer in record.members.items():
        part.joined(Rejoined("joined", member, "g", answer.rank, 2, 7, record.cycle), NOW)
    assert record.result == "rejoined" and record.finished


def test_the_evicted_shards_copy_is_placed_on_the_node_of_the_spare_that_will_load_it():
    from types import SimpleNamespace

    part = warm({1: "s1", 3: "s3"})
    plan = SimpleNamespace(
        orders=[SimpleNamespace(group="g", rank=r, shard=f"s{r}") for r in (3, 2, 1, 0)]
    )
    spares = [
        Spare("taken", "spare", "n9", 1, assigned=True),
        Spare("standby", "standby", "n8", 2),
        Spare("a", "spare", "na", 3),
        Spare("b", "spare", "nb", 4),
    ]
    assert part.spare_nodes(plan, spares) == {"g/s0": ["na"], "g/s2": ["nb"]}
    # ... and decide hands the same slots to the same spares.
    record = decide(part, {0: "s0", 2: "s2"}, spares)
    assert {m: r.rank for m, r in record.members.items() if not m.startswith("p")} == {
        "a": 0,
        "b": 2,
    }


def test_a_member_rejoining_a_second_time_waits_for_the_new_decision_not_the_last_one():
    part = warm({1: "model", 2: "model", 3: "model"})
    first = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    assert first.members["p1"].cycle == 1
    # The next eviction: p1 is ordered to rejoin again, and asks before that cycle concluded.
    part.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 4, "model", True), "n1", 101)}
    assert part.answer("p1") is None, "not cycle 1's answer again"


def test_a_word_outside_its_set_is_refused_where_the_record_is_built_and_a_plain_one_is_typed():
    joined = Rejoined("joined", "p1", loaded_from="memory-peer")
    assert joined.action is RejoinResult.JOINED and joined.loaded_from is LoadedFrom.MEMORY_PEER
    assert joined.joined and Rendezvous("leave", "gone").action is RendezvousAction.LEAVE
    assert SpareAnswer("assigned", "slot", "g", 0).action is SpareAction.ASSIGNED
    for build in (
        lambda: Rejoined("rejoined", "p1"),
        lambda: Rejoined("joined", "p1", loaded_from="tape"),
        lambda: Rendezvous("jump"),
        lambda: SpareAnswer("stay"),
    ):
        with pytest.raises(ValueError, match="is not a valid"):
            build()


def test_a_member_silent_past_the_join_deadline_fails_the_record_and_names_it():
    """A spare killed between its assignment and its registration never says what it did: at
    ``join_by`` (2 x rejoin_timeout_s after the decision) the record fails, naming it."""
    part = warm({1: "model"}, world=2, rejoin_timeout_s=5.0)
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    assert record.join_by == pytest.approx(record.started_at + 10.0)
    part.joined(Rejoined("joined", "p1", "g", 1, 2, 7, record.cycle, loaded_from="own state"), NOW)
    assert part.overdue(record.cycle, record.join_by - 0.1) is None, "not yet"
    assert part.overdue(record.cycle, record.join_by) is record
    assert record.result == "failed" and record.finished
    assert "1 member(s) did not join" in record.reason and "spare for rank 0" in record.reason
    assert part.overdue(record.cycle, record.join_by + 1) is None, "it fails once"


def test_a_record_every_member_spoke_for_is_never_overdue():
    part = warm({1: "model"}, world=2)
    record = decide(part, {0: "model"}, [Spare("s1", "spare", "n2", 9)])
    for member, answer in record.members.items():
        part.joined(Rejoined("joined", member, "g", answer.rank, 2, 7, record.cycle), NOW)
    assert part.overdue(record.cycle, record.join_by + 1) is None
    assert record.result == "rejoined"


class _Cuda:
    def __init__(self, available: bool, device: int = 0) -> None:
        self.available, self.device = available, device

    def is_available(self) -> bool:
        return self.available

    def current_device(self) -> int:
        return self.device


@pytest.mark.parametrize(
    ("backend", "cuda", "device"),
    [
        ("nccl", _Cuda(True, 3), "cuda:3"),  # built in the rendezvous, not at the first step
        ("cpu:gloo,cuda:nccl", _Cuda(True, 0), "cuda:0"),
        ("gloo", _Cuda(True, 0), None),  # gloo connects in init_process_group already
        ("nccl", _Cuda(False), None),
    ],
)
def test_a_warm_restarts_nccl_group_is_formed_eagerly_on_the_ranks_device(backend, cuda, device):
    from ray_graceful.rendezvous import eager_device

    found = eager_device(backend, cuda)
    assert (str(found) if found is not None else None) == device


class _SlowCoordinator:
    """The one call ``WarmGroup.restart`` makes first (``wait_outcome``), held until released:
    the coordinator's handle is the seam the driver's side is written against."""

    def __init__(self) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()

    def wait_outcome(self, timeout: float, cycle: int | None = None):
        self.entered.set()
        self.release.wait(timeout)
        return None  # no outcome: that call fails with its own reason


def test_a_second_restart_of_a_group_while_one_runs_is_refused_at_once_and_the_first_goes_on():
    """Two ``restart()`` calls at once took each other's members: one raised a bare KeyError,
    the other failed after 45 s, and ``group.workers`` was left stale."""
    import threading
    import time

    from ray_graceful import WarmGroup, WarmRestartFailed, WarmRestartInProgress

    coordinator = _SlowCoordinator()
    group = WarmGroup(coordinator, workers=[])  # type: ignore[arg-type]
    first: list[BaseException] = []

    def restart() -> None:
        try:
            group.restart(timeout=30)
        except BaseException as exc:
            first.append(exc)

    runner = threading.Thread(target=restart)
    runner.start()
    assert coordinator.entered.wait(10)
    started = time.monotonic()
    with pytest.raises(WarmRestartInProgress, match="another restart\\(\\) of this group"):
        group.restart(timeout=30)
    assert time.monotonic() - started < 1.0, "refused at once, not after the first one"
    coordinator.release.set()
    runner.join(10)
    assert len(first) == 1 and isinstance(first[0], WarmRestartFailed), first
    coordinator.release.set()
    with pytest.raises(WarmRestartFailed, match="no outcome"):  # the lock was let go
        group.restart(timeout=0.1)


# --- Ray Train's warm path: the new worker Train starts in an evicted slot ------------------------


def train_warm(survivors: dict[int, str], world: int = 4, **config) -> WarmRestarts:
    """Survivors of a group Ray Train replaces by slot (``RankSpec.replaced_by``)."""
    part = WarmRestarts(GracefulConfig(warm_restart=True, **config), ("10.0.0.1", 2345))
    part.survivors = {
        f"p{rank}": Survivor(
            f"p{rank}",
            RankSpec("g", rank, world, shard, True, replaced_by="ray-train-slot"),
            "n1",
            100 + rank,
        )
        for rank, shard in survivors.items()
    }
    return part


def test_an_evicted_slot_of_a_train_group_goes_to_the_worker_train_starts_there():
    part = train_warm({0: "model", 2: "model", 3: "model"})
    slot = train_slot_member("g", 1)
    assert part.answer(slot) is None  # Train's new worker asked before the decision: it waits
    record = decide(part, {1: "model"})
    assert record.result == "rejoining"
    assert record.members[slot].rank == 1 and record.members[slot].world_size == 4
    assert record.members[slot].was == "Ray Train's new worker for rank 1"
    assert part.answer(slot) == record.members[slot]
    # A slot nobody was evicted from is no member
    assert part.answer(train_slot_member("g", 2)).action == "leave"


def test_a_waiting_spare_still_comes_first_and_a_plain_groups_slot_is_never_promised():
    part = train_warm({0: "model", 2: "model", 3: "model"})
    record = decide(part, {1: "model"}, [Spare("s1", "spare", "n2", 9)])
    assert "s1" in record.members and train_slot_member("g", 1) not in record.members
    plain = warm({0: "model", 2: "model", 3: "model"})  # a hand-built group: no one comes
    assert plain.answer(train_slot_member("g", 1)).action == "leave"
    assert decide(plain, {1: "model"}).result == "cold"


def test_train_s_new_worker_is_told_why_when_the_warm_restart_does_not_go_ahead():
    part = train_warm({0: "model", 2: "model", 3: "model"})
    record = decide(part, {1: "model"}, committed=False)
    assert record.result == "cold"
    answer = part.answer(train_slot_member("g", 1))
    assert answer.action == "leave" and answer.reason == record.reason
    assert "no checkpoint was committed" in answer.reason


def test_survivors_of_a_train_group_may_hold_the_step_train_refills_every_slot():
    part = train_warm({0: "model", 2: "model", 3: "model"}, memory_replicas=1)
    orders = [SimpleNamespace(group="g", rank=r, shard="model") for r in range(4)]
    the_plan = SimpleNamespace(orders=orders)
    assert part.may_hold(the_plan, part.spare_nodes(the_plan, [])) == {
        ("g", 0),
        ("g", 2),
        ("g", 3),
    }


def test_no_survivor_is_chosen_where_ray_train_restarts_the_whole_group():
    """A Ray without replica groups restarts every Train worker when one fails: a survivor
    kept to rejoin would be killed in its rejoin (or its save). So none is chosen; the others
    are, whoever takes their slots."""
    part = WarmRestarts(GracefulConfig(warm_restart=True), ("10.0.0.1", 2345))
    orders = tuple(
        SimpleNamespace(group="g", rank=r, evicted=r == 0, health="healthy") for r in range(3)
    )
    the_plan = SimpleNamespace(orders=orders, abandoned=None, incomplete={})

    def process(rank: int, replaced_by: str) -> SimpleNamespace:
        spec = RankSpec("g", rank, 3, "model", True, replaced_by=replaced_by)
        return SimpleNamespace(
            process_id=f"p{rank}", keys=[spec.key], node_id="n1",
            registration=SimpleNamespace(ranks=(spec,), pid=100 + rank),
        )  # fmt: skip

    for replaced_by, survivors in [
        ("whole-group", set()),
        ("ray-train-slot", {"p1", "p2"}),
        ("spare", {"p1", "p2"}),
    ]:
        processes = [process(r, replaced_by) for r in range(3)]
        assert part.choose_survivors(the_plan, processes, train_fn_saves=False) == survivors


def test_a_train_slot_on_a_node_drained_until_a_later_deadline_is_not_waited_for():
    """Train starts the new worker in the slot's placement-group bundle, which stays on the
    drained node until its deadline: past ``TRAIN_SLOT_WAIT_LIMIT_S`` the full restart is sooner."""
    from ray_graceful.coordinator.warm_restarts import TRAIN_SLOT_WAIT_LIMIT_S

    def decide_with(free_in: float) -> object:
        part = train_warm({0: "model", 2: "model", 3: "model"})
        return part.decide(
            0, 7, True, {pid: True for pid in part.survivors}, {"g": {1: "model"}}, [],
            frozenset({"gone"}), slots_free_at={("g", 1): NOW + free_in}, now=NOW,
        )  # fmt: skip

    soon = decide_with(TRAIN_SLOT_WAIT_LIMIT_S - 1)
    assert soon.result == "rejoining" and train_slot_member("g", 1) in soon.members
    late = decide_with(30)
    assert late.result == "cold"
    assert "drained until its deadline in 30s" in late.reason and "full restart" in late.reason


def left(member: str, why: str = "SIGTERM while waiting to rejoin") -> Rejoined:
    """A survivor's word that it left before it had its rendezvous: it names no cycle."""
    return Rejoined(RejoinResult.LEFT, member, reason=why, pid=1)


def test_a_train_survivor_that_left_before_its_rendezvous_hands_its_slot_to_train():
    """Survivor p2 of a Train group is SIGTERMed after the decision, before it fetched its
    answer: Train refills its slot, so the worker it starts there is the member at rank 2 -
    the others wait for that rank in the rendezvous - and p2 is told to leave."""
    part = train_warm({0: "model", 2: "model", 3: "model"})
    record = decide(part, {1: "model"})
    assert part.joined(left("p2"), NOW + 1) is None, "the warm restart goes on"
    assert record.result == "rejoining" and "p2" not in record.members
    slot = record.members[train_slot_member("g", 2)]
    assert (slot.rank, slot.world_size, slot.prefix) == (2, 4, "ray_graceful/cycle1/g")
    assert slot.was == "Ray Train's new worker for rank 2 (its survivor left)"
    assert part.answer(train_slot_member("g", 2)) == slot
    told = part.answer("p2")
    assert told.action == "leave" and "SIGTERM while waiting to rejoin" in told.reason


def test_a_survivor_that_left_after_the_decision_fails_it_now_where_nobody_takes_its_slot():
    """In a hand-built group nobody takes a slot after the decision, and under Train a slot
    whose shard only a survivor holds could not be loaded by Train's next worker: the warm
    restart fails at once with the reason, where the others would wait for the member in the
    rendezvous until its timeout."""
    plain = warm({0: "model", 2: "model", 3: "model"})
    record = decide(plain, {1: "model"}, [Spare("s1", "spare", "n2", 9)])
    failed = plain.joined(left("p2"), NOW + 1)
    assert failed is record and record.result == "failed" and record.finished
    assert record.reason.startswith("survivor of rank 2: it left before it had its rendezvous")

    held = train_warm({0: "model", 2: "model", 3: "model"}, memory_replicas=1)
    record = held.decide(
        0, 7, True, {pid: True for pid in held.survivors}, {"g": {1: "model"}}, [],
        frozenset({"gone"}), {"g/model": ("p0", 64)}, now=NOW,
    )  # fmt: skip
    assert held.joined(left("p2"), NOW + 1) is record and record.result == "failed"


def test_a_member_that_left_once_it_had_spoken_or_was_told_to_leave_changes_nothing():
    part = train_warm({0: "model", 2: "model", 3: "model"})
    record = decide(part, {1: "model"})
    joined = Rejoined(RejoinResult.JOINED, "p2", "g", 2, 4, 7, 1, loaded_from=LoadedFrom.OWN_STATE)
    part.joined(joined, NOW + 1)
    assert part.joined(left("p2"), NOW + 2) is None and "p2" in record.members
    assert part.joined(left("nobody"), NOW + 2) is None and record.result == "rejoining"


def test_a_shard_held_only_by_a_survivor_that_left_before_the_decision_is_loaded_from_its_copy():
    """Survivor p2 holds its own shard (no copy anywhere yet) and leaves before the decision,
    copying the shard to the keepers as it goes: the warm restart goes ahead, and the worker
    Train starts in p2's slot loads that copy (no peer: p2 is not in the new group) while p0,
    parked at the step, keeps its own."""
    part = train_warm({0: "0", 2: "2", 3: "3"}, memory_replicas=1)
    assert part.joined(left("p2"), NOW) is None and "p2" not in part.survivors
    record = part.decide(
        0, 7, True, {pid: True for pid in part.survivors}, {"g": {1: "1", 2: "2"}}, [],
        frozenset({"gone"}), {"g/2": ("p2", 64), "g/0": ("p0", 64)}, frozenset({"p0"}), now=NOW,
    )  # fmt: skip
    assert record.result == "rejoining", record.reason
    taker = record.members[train_slot_member("g", 2)]
    assert (taker.rank, taker.shard, taker.peer) == (2, "2", -1)
    assert record.members["p0"].send_to == ()
