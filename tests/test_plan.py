"""The planner: who saves, who leaves; invariants checked on random inputs too."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_graceful import GracefulConfig
from ray_graceful.health import DEGRADED, FAULTY, HEALTHY, UNKNOWN
from ray_graceful.notices import EvictionNotice, NoticeError
from ray_graceful.place import Place, destination
from ray_graceful.plan import RankInfo, TopologyError, parse_topology, plan_termination

NAN = float("nan")

NOW = 1_000_000.0
CONFIG = GracefulConfig(
    checkpoint_dir="/ckpt",
    expected_save_s=5,
    plan_margin_s=1,
    watchdog_margin_s=1,
    teardown_timeout_s=25,
    save_budget_s=15,
)


def two_replicas_per_shard():
    """4 ranks on nodes A and B; shards 0 and 1, each with one replica on each node."""
    return [
        RankInfo("p", 0, "A", "0"),
        RankInfo("p", 1, "A", "1"),
        RankInfo("p", 2, "B", "0"),
        RankInfo("p", 3, "B", "1"),
    ]


def drain(node, in_s=30.0, cycle=0):
    return EvictionNotice(
        "drain", "spot preemption", cycle, NOW + in_s, node_id=node, received_at=NOW
    )


def actions(plan):
    return {o.rank: o.action for o in plan.orders}


def test_drained_node_survivors_save():
    plan = plan_termination(two_replicas_per_shard(), [drain("B")], {}, CONFIG, NOW)
    # The drained node's replicas are the backups: they save only if a survivor cannot.
    assert actions(plan) == {0: "save", 1: "save", 2: "backup", 3: "backup"}
    assert plan.abandoned is None
    assert plan.order_for(("p", 2)).reason == "saves shard 0 only if rank 0 cannot"
    assert plan.order_for(("p", 2)).deadline == NOW + 30
    # ... asked no later than the moment its own save still fits: 30 - 5 (save) - 2 (margins)
    assert plan.order_for(("p", 2)).start_by == NOW + 23
    assert plan.backups == {("p", "0"): ("p", 2), ("p", "1"): ("p", 3)}


def test_backup_is_the_next_viable_replica_never_a_faulty_one():
    ranks = [RankInfo("p", r, n, "0") for r, n in enumerate("ABCD")]
    health = {("p", 1): FAULTY, ("p", 2): DEGRADED}
    plan = plan_termination(ranks, [drain("D", in_s=4)], health, CONFIG, NOW)
    # A saves (healthy survivor); B is FAULTY; C is degraded but viable; D's 4 s do not fit.
    assert actions(plan) == {0: "save", 1: "leave", 2: "backup", 3: "leave"}
    assert plan.backups == {("p", "0"): ("p", 2)}
    single = plan_termination([RankInfo("p", 0, "A", "0")], [drain("A")], {}, CONFIG, NOW)
    assert single.backups == {} and actions(single) == {0: "save"}


def test_faulty_node_never_saves_even_as_survivor():
    health = {("p", 0): FAULTY, ("p", 1): FAULTY}
    plan = plan_termination(two_replicas_per_shard(), [drain("B", in_s=20)], health, CONFIG, NOW)
    assert actions(plan) == {0: "leave", 1: "leave", 2: "save", 3: "save"}
    assert "FAULTY" in plan.order_for(("p", 0)).reason


def test_no_viable_saver_abandons_for_everyone():
    # node B drains in 4 s: too short for a 5 s save; node A is FAULTY.
    health = {("p", 0): FAULTY, ("p", 1): FAULTY}
    plan = plan_termination(two_replicas_per_shard(), [drain("B", in_s=4)], health, CONFIG, NOW)
    assert set(actions(plan).values()) == {"leave"}
    assert plan.savers == {} and plan.backups == {}
    assert "p/0" in plan.abandoned and "p/1" in plan.abandoned


def test_prefers_healthy_then_latest_deadline():
    ranks = [RankInfo("p", r, n, "0") for r, n in enumerate("ABCD")]
    health = {("p", 0): DEGRADED, ("p", 1): UNKNOWN, ("p", 2): HEALTHY, ("p", 3): HEALTHY}
    # everyone is evicted; C has 20 s, D 60 s.
    notices = [drain("A", 60), drain("B", 60), drain("C", 20), drain("D", 60)]
    plan = plan_termination(ranks, notices, health, CONFIG, NOW)
    assert plan.savers == {("p", "0"): ("p", 3)}


def test_sigterm_to_one_rank_and_no_checkpoint_dir():
    notice = EvictionNotice("sigterm", "SIGTERM", 0, 0, rank=("p", 1), received_at=NOW)
    plan = plan_termination(two_replicas_per_shard(), [notice], {}, CONFIG, NOW)
    assert plan.order_for(("p", 1)).evicted and plan.order_for(("p", 1)).deadline == NOW + 25
    assert plan.savers[("p", "1")] == ("p", 3)  # the survivor replica
    nowhere = plan_termination(
        two_replicas_per_shard(), [notice], {}, CONFIG, NOW, destination=Place.NOWHERE
    )
    assert nowhere.abandoned == "nowhere to save: no checkpoint_dir is configured"
    assert nowhere.savers == {}


def test_measured_save_time_is_used():
    plan = plan_termination(
        two_replicas_per_shard(),
        [drain("A", 10), drain("B", 10)],
        {},
        CONFIG,
        NOW,
        expected_save_s={("p", "0"): 9.5},
    )
    assert plan.abandoned and "p/0" in plan.abandoned and "p/1" not in plan.abandoned


def test_plan_table_is_readable():
    text = plan_termination(
        two_replicas_per_shard(), [drain("B")], {("p", 1): DEGRADED}, CONFIG, NOW
    ).table(now=NOW)
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "node", "shard", "health", "action", "deadline", "reason"]
    assert "p/0" in lines[2] and "SAVE" in lines[2] and "+25.0s" in lines[2]
    assert "p/2" in lines[4] and "BACKUP" in lines[4]
    assert lines[-1] == "checkpoint: 2 shard(s), one saver each; 2 with a backup"


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 40))
    nodes = draw(st.lists(st.sampled_from("ABCDEF"), min_size=n, max_size=n))
    shards = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    can_save = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    ranks = [RankInfo("g", i, nodes[i], str(shards[i]), can_save[i]) for i in range(n)]
    health = {
        ("g", i): draw(st.sampled_from([HEALTHY, UNKNOWN, DEGRADED, FAULTY])) for i in range(n)
    }
    drained = draw(st.lists(st.tuples(st.sampled_from("ABCDEF"), st.floats(0, 60)), max_size=4))
    notices = [drain(node, s) for node, s in drained]
    return ranks, health, notices


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_invariants(scenario):
    ranks, health, notices = scenario
    plan = plan_termination(ranks, notices, health, CONFIG, NOW)
    by_key = {(r.group, r.rank): r for r in ranks}
    savers = [o for o in plan.orders if o.action == "save"]
    assert len(plan.orders) == len(ranks)
    assert all(o.health != FAULTY for o in savers), "a FAULTY rank never saves"
    assert all(by_key[(o.group, o.rank)].can_save for o in savers)
    shards_saved = [(o.group, o.shard) for o in savers]
    assert len(shards_saved) == len(set(shards_saved)), "at most one saver per shard"
    backups = [o for o in plan.orders if o.action == "backup"]
    assert all(o.health != FAULTY and by_key[(o.group, o.rank)].can_save for o in backups)
    backed = [(o.group, o.shard) for o in backups]
    assert len(backed) == len(set(backed)), "at most one backup per shard"
    assert set(backed) <= set(shards_saved), "a backup only where a saver is"
    for o in backups:
        assert o.start_by + CONFIG.expected_save_s + 2 <= o.deadline + 1e-9, "its save fits"
    if plan.abandoned:
        assert savers == [] and backups == []
    else:
        assert set(shards_saved) == {(r.group, r.shard) for r in ranks}, "every shard saved"
        for o in savers:
            assert NOW + CONFIG.expected_save_s + 2 <= o.deadline, "the save fits its deadline"


def test_parse_topology_errors():
    assert parse_topology({"ranks": [{"rank": 0, "node": "a"}]}) == [
        RankInfo("default", 0, "a", "0")
    ]
    for bad, message in [
        ([], "non-empty list"),
        ([{"rank": -1, "node": "a"}], "ranks[0].rank = -1"),
        ([{"rank": 0}], "ranks[0].node"),
        ([{"rank": 0, "node": "a", "colour": 1}], "unknown fields ['colour']"),
        ([{"rank": 0, "node": "a"}, {"rank": 0, "node": "b"}], "default/0 appears twice"),
        ([{"rank": 0, "node": "a", "shard": 1.5}], "shard = 1.5"),
    ]:
        with pytest.raises(TopologyError) as info:
            parse_topology(bad)
        assert message in str(info.value)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"source": "x", "reason": "r", "cycle": 0, "node_id": "n"}, "source 'x' is not allowed"),
        ({"source": "cli", "reason": " ", "cycle": 0, "node_id": "n"}, "reason must be"),
        ({"source": "cli", "reason": "r", "cycle": -1, "node_id": "n"}, "cycle -1"),
        ({"source": "cli", "reason": "r", "cycle": 0}, "exactly one of node_id or rank"),
        (
            {"source": "cli", "reason": "r", "cycle": 0, "node_id": "n", "rank": ["g", 0]},
            "exactly one of",
        ),
        ({"source": "cli", "reason": "r", "cycle": 0, "rank": ["g", -2]}, "rank ('g', -2)"),
        (
            {"source": "cli", "reason": "r", "cycle": 0, "node_id": "n", "deadline": -5},
            "deadline -5",
        ),
        (
            {"source": "cli", "reason": "r", "cycle": 0, "node_id": "n", "deadline": 1.8e12},
            "looks like milliseconds",
        ),
        ({"source": "cli", "reason": "r", "cycle": 0, "node_id": "n", "when": 1}, "unknown notice"),
        ({"source": "cli", "cycle": 0, "node_id": "n"}, "['reason'] are required"),
    ],
)
def test_malformed_notices(data, message):
    with pytest.raises(NoticeError) as info:
        EvictionNotice.parse(data)
    assert message in str(info.value)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["source", "reason", "cycle", "deadline", "node_id", "rank", "other"]),
        st.one_of(
            st.none(),
            st.integers(-5, 10**13),
            st.text(max_size=5),
            st.floats(allow_nan=True),
            st.lists(st.integers(), max_size=3),
            st.booleans(),
        ),
    )
)
def test_notice_parser_accepts_or_explains(data):
    """Whatever arrives, the parser returns a valid notice or raises NoticeError - nothing else."""
    try:
        notice = EvictionNotice.parse(data)
    except NoticeError as exc:
        assert str(exc)
    else:
        assert notice.source in ("drain", "sigterm", "cli", "health", "api")
        assert (notice.node_id is None) != (notice.rank is None)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.lists(
            st.dictionaries(
                st.sampled_from(["group", "rank", "node", "shard", "can_save", "x"]),
                st.one_of(
                    st.none(),
                    st.integers(-2, 3),
                    st.text(max_size=2),
                    st.booleans(),
                    st.floats(allow_nan=False),
                ),
            ),
            max_size=4,
        ),
    )
)
def test_topology_parser_accepts_or_explains(data):
    try:
        ranks = parse_topology(data)
    except TopologyError as exc:
        assert str(exc)
    else:
        assert len({r.key for r in ranks}) == len(ranks)


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"source": "cli", "reason": "x", "cycle": 0, "node_id": "n", "deadline": 30},
            "s in the past",
        ),
        (
            {"source": "cli", "reason": "x", "cycle": 0, "rank": ["g", 0], "received_at": "x"},
            "received_at 'x' is not allowed",
        ),
        (
            {"source": "cli", "reason": "x", "cycle": 0, "rank": ["g", 0], "received_at": NAN},
            "received_at nan is not allowed",
        ),
    ],
)
def test_deadlines_and_receipt_times_are_what_the_user_meant(data, message):
    with pytest.raises(NoticeError) as info:
        EvictionNotice.parse(data)
    assert message in str(info.value)
    if "deadline" in data:
        assert "--deadline-in" in str(info.value)


def test_messages_about_huge_values_stay_small():
    bomb: list = ["x"] * 10
    for _ in range(30):  # what a YAML alias bomb expands to: 10**30 leaves if printed
        bomb = [bomb] * 10
    with pytest.raises(NoticeError) as info:
        EvictionNotice.parse({"source": "cli", "reason": "x", "cycle": 0, "rank": bomb})
    assert len(str(info.value)) < 400


def test_a_group_missing_ranks_is_never_planned_for():
    """The review's case: world size 2, only rank 0 registered - nobody saves, and why."""
    plan = plan_termination([RankInfo("p", 0, "A", "0", True, 2)], [drain("B")], {}, CONFIG, NOW)
    assert plan.savers == {} and actions(plan) == {0: "leave"}
    assert plan.incomplete == {"p": "1 of 2 ranks registered (missing: 1)"}
    assert plan.abandoned == "no complete group: group p: 1 of 2 ranks registered (missing: 1)"
    assert "group p is incomplete" in plan.order_for(("p", 0)).reason


def test_only_complete_groups_are_saved_the_incomplete_one_is_named():
    ranks = [RankInfo("p", r, n, str(r), True, 2) for r, n in ((0, "A"), (1, "B"))]
    ranks.append(RankInfo("q", 0, "A", "0", True, 2))  # a second group under another name
    plan = plan_termination(ranks, [drain("B")], {}, CONFIG, NOW)
    assert plan.abandoned is None
    assert set(plan.savers) == {("p", "0"), ("p", "1")}
    assert plan.incomplete == {"q": "1 of 2 ranks registered (missing: 1)"}
    assert plan.order_for(("q", 0)).action == "leave"
    assert "group q not saved" in plan.table(NOW)


def test_ranks_that_disagree_on_the_world_size_make_a_group_incomplete():
    ranks = [RankInfo("p", 0, "A", "0", True, 2), RankInfo("p", 1, "B", "1", True, 3)]
    plan = plan_termination(ranks, [], {}, CONFIG, NOW)
    assert "disagree on the world size ([2, 3])" in plan.incomplete["p"]
    assert plan.savers == {}


def test_a_topology_may_give_world_sizes():
    ranks = parse_topology([{"rank": 0, "node": "a", "world_size": 2}])
    assert ranks[0].world_size == 2
    with pytest.raises(TopologyError, match=r"ranks\[0\].world_size = 0"):
        parse_topology([{"rank": 0, "node": "a", "world_size": 0}])


def test_the_destination_is_one_place_word():
    assert destination("/ckpt", 0, train_fn_saves=True) is Place.RAY_TRAIN
    assert destination("/ckpt", 1, train_fn_saves=False) is Place.MEMORY
    assert destination(None, 1, train_fn_saves=False) is Place.MEMORY
    assert destination("/ckpt", 0, train_fn_saves=False) is Place.DISK
    assert destination(None, 0, train_fn_saves=False) is Place.NOWHERE
