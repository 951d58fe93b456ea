"""The cycle machine on its own: typed events in, typed decisions out - no Ray, no event loop.

What the actor does with the decisions is ``test_coordinator_logic.py``'s; here each rule is
read straight off the decisions: who is woken with which order, when the cycle may conclude,
what is to be committed, and that the outcome is the one record of the cycle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ray_graceful import TeardownReport, read_reports
from ray_graceful.checkpoint import ShardRecord, save_state_dict, write_shard
from ray_graceful.coordinator import events as ev
from ray_graceful.coordinator.conclusion import carry_out
from ray_graceful.coordinator.cycle import Cycle
from ray_graceful.coordinator.machine import CycleMachine
from ray_graceful.coordinator.spare_pool import SparePool, SpareRecord
from ray_graceful.coordinator.warm_restarts import Survivor, WarmRestarts
from ray_graceful.notices import EvictionNotice
from ray_graceful.protocol import (
    Ack,
    PhaseRecord,
    PhaseStatus,
    PollState,
    RankSpec,
    Register,
    Rejoined,
    ReportedRank,
    TeardownPhase,
    train_slot_member,
)
from ray_graceful.worker.report_file import write_report_file
from tests.helpers import fast_config

pytestmark = pytest.mark.unit


@pytest.fixture
def config(tmp_path):
    return fast_config(tmp_path)


def machine(config) -> CycleMachine:
    return CycleMachine(config, "job-a", WarmRestarts(config, ("h", 1)), SparePool())


def registered(config, ranks=2) -> CycleMachine:
    """A machine with group "g" of ``ranks`` replicas of shard "0", one process per node."""
    m = machine(config)
    for rank in range(ranks):
        spec = RankSpec("g", rank, ranks, "0", True)
        m.step(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,)), time.time())
    return m


def of(decisions, kind):
    return [d for d in decisions if isinstance(d, kind)]


def report(m: CycleMachine, pid: str, saved: list | None = None) -> list:
    rep = TeardownReport(1, "h", "n", "job-a", [], "t", m.cycle.number, time.time(), time.time())
    rep.saved.extend(saved or [])
    return m.step(ev.ReportIn(pid, rep), time.time())


def test_a_notice_opens_the_cycle_and_closing_the_gathering_orders_every_process(config):
    m = registered(config)
    opened = m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    assert of(opened, ev.CycleOpened) == [ev.CycleOpened(0)]
    assert ev.reply_of(opened).accepted
    held = m.step(ev.Polled("p0", 0, PollState()), time.time())
    assert of(held, ev.HoldPoll) == [ev.HoldPoll("p0")], "no order before the plan"

    ordered = m.step(ev.GatheringClosed(0), time.time())
    out = {d.process_id: d.answer.order for d in of(ordered, ev.OrderOut)}
    assert set(out) == {"p0", "p1"}
    # The survivor saves (rank 0 on n0); the evicted replica on n1 is its backup.
    assert [s.shard_key for s in out["p0"].saves] == ["g/0"] and not out["p0"].saves[0].is_backup
    assert out["p1"].saves[0].backup_for == 0
    assert ev.NodeLeaving("n1", pytest.approx(out["p1"].deadline, abs=0.5)) in ordered
    # Unacknowledged, the order is the answer to every poll; acknowledged, polls are held.
    again = m.step(ev.Polled("p0", 0, PollState()), time.time())
    assert ev.reply_of(again).order == out["p0"]
    m.step(Ack("p0", 0, out["p0"].order_id), time.time())
    assert of(m.step(ev.Polled("p0", 0, PollState()), time.time()), ev.HoldPoll)


def test_processes_told_the_same_share_one_order_and_each_still_acknowledges_its_own(config):
    """Most processes of a large job are told the same ("leave by T"): one order object and
    one id for them (built and pickled once per reply, not once per process), a distinct one
    for each process told something else - and an acknowledgement still counts for its
    sender only."""
    m = registered(config, ranks=6)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    out = {
        d.process_id: d.answer for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    savers = [pid for pid, answer in out.items() if answer.order.saves]
    stay = [pid for pid, answer in out.items() if not answer.order.saves and pid != "p1"]
    assert len(savers) >= 2 and len(stay) >= 2, f"a saver and a backup, then leavers: {out}"
    assert all(out[pid] is out[stay[0]] for pid in stay), "they only leave: one order"
    ids = {pid: answer.order.order_id for pid, answer in out.items()}
    assert len({ids[pid] for pid in savers}) == len(savers), "each saver's is its own"
    assert ids[stay[0]] not in {ids[pid] for pid in savers}
    one, other = stay[:2]
    assert ev.reply_of(m.step(Ack(one, 0, ids[one]), time.time())).accepted
    assert (
        ev.reply_of(m.step(ev.Polled(other, 0, PollState()), time.time())).order == out[other].order
    ), "one's acknowledgement is not the other's: it is told again until it acknowledges"
    assert of(m.step(ev.Polled(one, 0, PollState()), time.time()), ev.HoldPoll)


def test_a_report_whose_saved_shards_are_not_records_is_refused_and_saves_nothing(config):
    """A report carries ``ShardRecord``s; anything else is refused with the reason, not read."""
    m = registered(config)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    m.step(ev.GatheringClosed(0), time.time())
    entry = {"shard": "g/0", "step": 5, "file": "shard-g_0-1.pt", "bytes": 1, "crc32": 0}
    refused = report(m, "p0", [entry])
    assert not ev.reply_of(refused).accepted and "ShardRecord" in ev.reply_of(refused).reason
    assert not of(refused, ev.SaveResolved), "nothing was taken from the refused report"
    assert m.registry.processes["p0"].report is None, "p0 may still send its real report"


def test_a_teardown_report_reads_back_from_its_json_equal_and_typed(tmp_path):
    record = write_shard(str(tmp_path), 3, "g/0", lambda p, s: save_state_dict({"s": s}, p))
    ranks = [ReportedRank("g", 0, 2)]
    steps = [PhaseRecord(TeardownPhase.SAVE, PhaseStatus.RAN, "1 shard", 0.1, 0.2)]
    sent = TeardownReport(1, "h", "n", "job-a", ranks, "t", 0, 1.0, 2.0, steps, saved=[record])
    back = TeardownReport.from_dict(json.loads(sent.to_json()))
    assert back == sent and isinstance(back.saved[0], ShardRecord)
    assert isinstance(back.ranks[0], ReportedRank) and back.phases[0].status is PhaseStatus.RAN
    assert back.summary().startswith("pid=1 ranks=g/0 trigger=t save=ran(200ms)"), back.summary()


def test_read_reports_reads_them_back_typed_and_skips_a_torn_one_with_a_warning(tmp_path, caplog):
    record = write_shard(str(tmp_path), 3, "g/0", lambda p, s: save_state_dict({"s": s}, p))
    sent = TeardownReport(1, "h", "n", "job-a", [], "t", 0, 1.0, 2.0, saved=[record])
    write_report_file(sent, str(tmp_path / "reports"))
    job_dir = tmp_path / "reports" / "job-a"
    (job_dir / "teardown-h-2.json").write_text('{"pid": 2, "hostn')  # torn mid-write
    bad = {**sent.to_dict(), "pid": 3, "saved": [{"shard": "g/0", "file": "../escape.pt"}]}
    (job_dir / "teardown-h-3.json").write_text(json.dumps(bad))
    assert read_reports(str(tmp_path / "reports"), "job-a") == [sent]
    skipped = [r.getMessage() for r in caplog.records if "skipped report" in r.getMessage()]
    assert len(skipped) == 2 and any("teardown-h-3.json" in m for m in skipped), skipped


def test_the_cycle_concludes_once_every_ordered_process_reported_and_commits(config, tmp_path):
    m = registered(config)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    m.step(ev.GatheringClosed(0), time.time())
    record = write_shard(
        config.checkpoint_dir, 5, "g/0", lambda p, s: save_state_dict({"s": s}, p), group="g"
    )
    first = report(m, "p0", [record])
    assert of(first, ev.SaveResolved) == [ev.SaveResolved(0, "g/0", True, "h:0 saved it")]
    assert not of(first, ev.AllReported), "p1 has not reported yet"
    assert of(report(m, "p1"), ev.AllReported) == [ev.AllReported(0)]

    (commit,) = of(m.step(ev.ReportsClosed(0), time.time()), ev.Commit)
    assert (commit.request.tier, commit.request.expected) == ("disk", ("g/0",))
    landed = carry_out(commit.request)  # the actor runs this on a thread: the disk only
    concluded = m.step(ev.CommitDone(0, landed), time.time())
    (done,) = of(concluded, ev.Concluded)
    assert done.outcome.result == "committed" and done.outcome.committed["step"] == 5
    assert m.cycle.number == 1 and m.registry.processes == {}, "the next cycle is open, empty"
    with pytest.raises(AttributeError):
        done.outcome.result = "abandoned"  # an outcome is a record: written once


def test_all_reported_comes_with_the_last_awaited_report_in_any_order(config):
    """The wait for reports ends with the last process that got an order, whatever the order
    they report in; one that reported before the plan, or died, is not waited for."""
    m = registered(config, ranks=40)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n39"),)), time.time())
    report(m, "p39")  # its process tore down on its own before the plan
    m.step(ev.GatheringClosed(0), time.time())
    m.registry.mark_lost(m.registry.processes["p38"])  # died without a notice (the watcher)
    order = [f"p{i}" for i in (7, 0, 21, 3, 37, 12, 30, 1)] + [
        f"p{i}" for i in range(38) if i not in (7, 0, 21, 3, 37, 12, 30, 1)
    ]
    for pid in order[:-1]:
        assert not of(report(m, pid), ev.AllReported), f"{order[-1]} has not reported yet"
    assert of(report(m, order[-1]), ev.AllReported) == [ev.AllReported(0)]
    assert not of(report(m, "p0"), ev.AllReported), "said once"


def test_a_drain_of_the_drivers_node_saves_the_whole_job_by_its_deadline(config):
    """The coordinator sits on the driver's node; drained, the job ends with it: every rank is
    ordered, each shard saved once, by that drain's deadline (no rank's node was drained)."""
    m = CycleMachine(config, "job-a", WarmRestarts(config, ("h", 1)), SparePool(), None, 0, "home")
    for rank in range(4):
        spec = RankSpec("g", rank, 4, str(rank % 2), True)
        m.step(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,)), time.time())
    deadline = time.time() + 30
    opened = m.step(ev.DrainsSeen({"home": int(deadline * 1000)}), time.time())
    assert of(opened, ev.CycleOpened) == [ev.CycleOpened(0)]
    assert {n.node_id for n in m.cycle.notices} == {"n0", "n1", "n2", "n3"}
    assert all("driver's node" in n.reason for n in m.cycle.notices)
    sooner = deadline - 10  # node n1 is drained on its own too, with an earlier deadline
    again = m.step(
        ev.DrainsSeen({"home": int(deadline * 1000), "n1": int(sooner * 1000)}), time.time()
    )
    assert not of(again, ev.Rejected) and len(m.cycle.notices) == 5, "home's drain taken once"
    ordered = m.step(ev.GatheringClosed(0), time.time())
    orders = {d.process_id: d.answer.order for d in of(ordered, ev.OrderOut)}
    assert len(orders) == 4 and all(o.deadline <= deadline + 0.001 for o in orders.values())
    assert orders["p1"].deadline <= sooner + 0.001, "n1's own, earlier deadline holds"
    orders = list(orders.values())
    assert sorted(s.shard_key for o in orders for s in o.saves if not s.is_backup) == ["g/0", "g/1"]


def test_a_group_registered_after_the_drivers_node_drain_began_is_still_saved(config):
    """The drain was seen before any rank registered: the next poll of it covers the group."""
    warm = WarmRestarts(config, ("h", 1))
    m = CycleMachine(config, "job-a", warm, SparePool(), None, 0, "home")
    deadline_ms = int((time.time() + 30) * 1000)
    assert not of(m.step(ev.DrainsSeen({"home": deadline_ms}), time.time()), ev.CycleOpened), (
        "no rank yet"
    )
    spec = RankSpec("g", 0, 1, "0", True)
    m.step(Register("p0", "n0", 0, "h", "job-a", (spec,)), time.time())
    assert of(m.step(ev.DrainsSeen({"home": deadline_ms}), time.time()), ev.CycleOpened) == [
        ev.CycleOpened(0)
    ]
    assert [n.node_id for n in m.cycle.notices] == ["n0"]


def test_a_lost_host_is_a_notice_for_each_of_its_ranks_and_none_of_them_saves(config):
    """The host watch's verdict: the ranks on the host are lost (no order, no report awaited)
    and a replica elsewhere saves their shard; a host with no rank of the job opens nothing."""
    m = registered(config, ranks=3)
    assert not m.step(ev.HostLost("elsewhere", "no heartbeat"), time.time()), (
        "no rank there: nothing"
    )
    took = m.step(ev.HostLost("n1", "no heartbeat for 0.50s; no answer in 0.5s"), time.time())
    assert of(took, ev.CycleOpened) == [ev.CycleOpened(0)]
    (notice,) = m.cycle.notices
    assert notice.source == "host_lost" and notice.rank == ("g", 1)
    assert "no answer in 0.5s" in notice.reason
    assert not m.step(ev.HostLost("n1", "again"), time.time()), "declared once"
    orders = {
        d.process_id: d.answer.order
        for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    assert not orders["p1"].saves, "the lost host's rank saves nothing"
    savers = [pid for pid, o in orders.items() for save in o.saves if not save.is_backup]
    assert len(savers) == 1 and savers[0] in ("p0", "p2"), orders


def test_a_drain_of_a_node_without_ranks_that_is_not_the_drivers_opens_nothing(config):
    m = CycleMachine(config, "job-a", WarmRestarts(config, ("h", 1)), SparePool(), None, 0, "home")
    spec = RankSpec("g", 0, 1, "0", True)
    m.step(Register("p0", "n0", 0, "h", "job-a", (spec,)), time.time())
    assert not of(
        m.step(ev.DrainsSeen({"elsewhere": int(time.time() * 1000)}), time.time()), ev.CycleOpened
    )


def test_a_large_plan_is_logged_as_one_line_of_counts_a_small_one_as_its_table(config):
    m = registered(config, ranks=2)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    m.step(ev.GatheringClosed(0), time.time())
    plan = m.cycle.plan
    assert plan.for_log() == plan.table(), "two ranks: the table"
    line = plan.for_log(max_rows=1)
    assert "\n" not in line and line.startswith("2 ranks on 2 nodes (1 evicted)")
    assert "1 backup" in line and "1 save" in line and "checkpoint 1 shard(s)" in line


def test_a_spare_that_cannot_load_ends_the_warm_restart_before_the_survivor_is_back(tmp_path):
    """The spare registered (under its process id, not its member id) and failed its load while
    the survivor was still re-forming: the failure's notice names the spare's slot and opens the
    cycle; the survivor registering during its gathering is taken in, and both are ordered out."""
    m = machine(fast_config(tmp_path, warm_restart=True))
    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "1", True), "n1", 101)}
    spare = SpareRecord("spare-x", "spare", "n2", 9)
    record = m.warm.decide(
        0, 7, True, {"p1": True}, {"g": {0: "0"}}, [spare], frozenset({"n0"}), now=time.time()
    )
    assert record is not None and set(record.members) == {"p1", "spare-x"}
    m.state.cycle = Cycle(record.cycle)  # cycle 0 concluded into this record
    slot = RankSpec("g", 0, 2, "0", True)
    m.step(Register("x", "n2", 9, "h", "job-a", (slot,)), time.time())

    bad = Rejoined("left", "spare-x", "g", 0, 2, 7, record.cycle, reason="no load_state_dict")
    opened = m.step(bad, time.time())
    assert of(opened, ev.CycleOpened) == [ev.CycleOpened(record.cycle)]
    assert [(n.source, n.rank) for n in m.cycle.notices] == [("rejoin", ("g", 0))]
    survivor = RankSpec("g", 1, 2, "1", True)
    back = m.step(Register("p1", "n1", 101, "h", "job-a", (survivor,)), time.time())
    assert ev.reply_of(back).accepted, "the survivor belongs to the group being ended"
    ordered = m.step(ev.GatheringClosed(record.cycle), time.time())
    assert {d.process_id for d in of(ordered, ev.OrderOut)} == {"x", "p1"}


def test_the_actor_hears_when_a_warm_restart_is_over_and_only_then(tmp_path):
    """``WarmFinished`` wakes the actor's waiters (``wait_rejoined``, the memory tier's persist):
    not while a member has not spoken, once the last one has, and at the join deadline."""
    m = machine(fast_config(tmp_path, warm_restart=True))
    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "1", True), "n1", 101)}
    spare = SpareRecord("spare-x", "spare", "n2", 9)
    record = m.warm.decide(
        0, 7, True, {"p1": True}, {"g": {0: "0"}}, [spare], frozenset({"n0"}), now=time.time()
    )
    assert record is not None
    m.state.cycle = Cycle(record.cycle)
    first = Rejoined("joined", "p1", "g", 1, 2, 7, record.cycle, loaded_from="own state")
    assert not of(m.step(first, time.time()), ev.WarmFinished), "the spare has not spoken"
    last = Rejoined("joined", "spare-x", "g", 0, 2, 7, record.cycle, loaded_from="disk")
    assert of(m.step(last, time.time()), ev.WarmFinished) == [ev.WarmFinished(record.cycle)]

    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "1", True), "n1", 101)}
    silent = m.warm.decide(
        1, 9, True, {"p1": True}, {"g": {0: "0"}}, [spare], frozenset(), now=time.time()
    )
    assert silent is not None and not silent.finished
    early = m.step(ev.JoinDeadline(silent.cycle), silent.join_by - 1)
    assert not of(early, ev.WarmFinished)
    late = m.step(ev.JoinDeadline(silent.cycle), silent.join_by)
    assert of(late, ev.WarmFinished) == [ev.WarmFinished(silent.cycle)]


def test_a_message_is_checked_once_at_the_door_and_a_bad_one_is_refused_with_its_reason(config):
    """The actor admits protocol messages (``ev.admitted``); the machine reads them by field."""
    good = Register("p0", "n0", 1, "h", "job-a", (RankSpec("g", 0, 1, "0", True),))
    assert ev.admitted(good, Register, "register") is good
    wrong = ev.admitted({"process_id": "p0"}, Register, "register", "malformed registration: ")
    assert isinstance(wrong, ev.Malformed)
    assert wrong.reason == "malformed registration: a register is a Register, not a dict"
    old = ev.admitted(Ack("p0", 0, "o", version=0), Ack, "ack")
    assert isinstance(old, ev.Malformed) and "version" in old.reason
    m = registered(config)
    refused = m.step(wrong, time.time())
    assert not ev.reply_of(refused).accepted and of(refused, ev.Rejected)
    assert set(m.registry.processes) == {"p0", "p1"}, "nothing registered from it"


def test_a_cycle_moves_only_where_its_table_goes():
    """``Cycle.move`` is the one place a phase changes; a move outside ``MOVES`` is a bug."""
    from ray_graceful.coordinator.cycle import MOVES, Phase, PhaseError

    cycle = Cycle(3)
    with pytest.raises(PhaseError, match="cannot go from idle to tearing down"):
        cycle.move(Phase.TEARING_DOWN, 1.0)
    cycle.move(Phase.GATHERING, 1.0)
    cycle.move(Phase.TEARING_DOWN, 2.0)
    assert (cycle.first_notice_at, cycle.plan_at) == (1.0, 2.0)
    cycle.move(Phase.CONCLUDED, 3.0)
    with pytest.raises(PhaseError):
        cycle.move(Phase.GATHERING, 4.0)
    assert all(Phase.CONCLUDED in MOVES[p] for p in Phase if p is not Phase.CONCLUDED), (
        "any cycle may conclude: a failure on the way concludes it as failed"
    )


def test_a_stale_or_unknown_poll_is_answered_never_held(config):
    m = registered(config)
    assert ev.reply_of(m.step(ev.Polled("nobody", 0, PollState()), time.time())).kind == "unknown"
    stale = m.step(ev.Polled("p0", 7, PollState()), time.time())
    assert ev.reply_of(stale).kind == "stale" and of(stale, ev.Rejected)


def test_a_lost_rank_opens_a_cycle_and_in_teardown_ends_the_wait_for_it(config):
    m = machine(config)
    for rank in range(2):
        spec = RankSpec("g", rank, 2, "0", True)
        register = Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,), f"a{rank}" * 16)
        m.step(register, time.time())
    assert m.watched_actors() == {"a0" * 16, "a1" * 16}
    lost = m.step(ev.RanksLost(frozenset({"a1" * 16, "not-ours"})), time.time())
    assert of(lost, ev.CycleOpened) and ev.reply_of(lost) is None, "its own event: no caller"
    assert m.watched_actors() == {"a0" * 16}, "a lost process is watched no more"
    m.step(ev.GatheringClosed(0), time.time())
    assert of(report(m, "p0"), ev.AllReported), "the lost process has no report coming"


def test_after_a_restart_a_rank_not_registered_again_is_lost_and_its_group_ordered_out(config):
    """A rank that died or left alone while the coordinator restarted never registers again;
    its peers, registered again, wait for an order. Once the restart settled, the missing rank
    is a "lost" notice naming it, and the plan orders the group's other ranks out (the group is
    incomplete: none saves for it). A group that came back whole opens nothing."""
    m = machine(config)
    for rank in (0, 2, 3):  # rank 1 of 4 never came back
        spec = RankSpec("g", rank, 4, str(rank % 2), True)
        m.step(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,)), time.time())
    whole = RankSpec("h", 0, 1, "0", True)
    m.step(Register("q0", "n0", 9, "h", "job-a", (whole,)), time.time())

    settled = m.step(ev.RestartSettled(5.0), time.time())
    assert of(settled, ev.CycleOpened) == [ev.CycleOpened(0)]
    assert ev.reply_of(settled) is None, "its own event: no caller"
    assert [(n.source, n.rank) for n in m.cycle.notices] == [("lost", ("g", 1))]
    assert "did not register again within 5s" in m.cycle.notices[0].reason

    ordered = {
        d.process_id: d.answer.order
        for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    assert set(ordered) == {"p0", "p2", "p3", "q0"}, "every process still here is ordered out"
    assert not any(ordered[p].saves for p in ("p0", "p2", "p3")), "an incomplete group saves none"
    assert "missing: 1" in m.cycle.plan.incomplete["g"]
    assert m.step(ev.RestartSettled(5.0), time.time()) == [], "orders out: nothing more to say"


def test_while_gathering_a_rank_missing_from_a_planned_group_is_let_in_and_ordered(config):
    """After a restart, one rank's SIGTERM reported again opens the cycle before its peers
    registered again: they belong to the group being planned (refused, they kept it incomplete
    and the cycle was abandoned). Anyone else still waits for the next cycle."""
    m = machine(config)

    def register(pid: str, group: str, rank: int, world: int = 4):
        spec = RankSpec(group, rank, world, str(rank % 2), True)
        return ev.reply_of(m.step(Register(pid, "n0", 1, "h", "job-a", (spec,)), time.time()))

    assert register("p1", "g", 1).accepted
    m.step(ev.NoticesIn((EvictionNotice("sigterm", "SIGTERM", 0, rank=("g", 1)),)), time.time())
    assert m.cycle.phase.value == "gathering"
    assert register("p0", "g", 0).accepted, "missing from the group being planned"
    refused = register("x0", "g", 1)
    assert not refused.accepted and refused.retry, "rank 1 is p1's"
    refused = register("y0", "other", 0, world=2)
    assert not refused.accepted and refused.retry, "a group this cycle does not plan for"
    refused = register("z0", "g", 2, world=8)
    assert not refused.accepted and refused.retry, "not the group's world size"
    assert register("p2", "g", 2).accepted and register("p3", "g", 3).accepted

    ordered = {
        d.process_id: d.answer.order
        for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    assert set(ordered) == {"p0", "p1", "p2", "p3"}
    assert not m.cycle.plan.incomplete and not m.cycle.plan.abandoned, m.cycle.plan.abandoned


def test_after_a_restart_every_group_back_whole_opens_nothing(config):
    m = registered(config, ranks=2)
    assert m.step(ev.RestartSettled(5.0), time.time()) == []
    assert m.cycle.phase.value == "idle"


def test_a_node_notice_is_taken_for_the_nodes_the_jobs_processes_registered_from(config):
    """A node-level notice names a node of the job's or is refused; a process that registers
    again from another node (its actor restarted elsewhere) moves its node with it."""
    m = registered(config)  # p0 on n0, p1 on n1

    def taken(node: str) -> bool:
        cycle = m.cycle.number
        notice = EvictionNotice("api", "x", cycle, time.time() + 60, node_id=node)
        return ev.reply_of(m.step(ev.NoticesIn((notice,)), time.time())).accepted

    assert not taken("n9")
    moved = Register("p1", "n5", 1, "h", "job-a", (RankSpec("g", 1, 2, "0", True),))
    m.step(moved, time.time())
    assert not taken("n1"), "p1 left n1: nobody of the job runs there"
    assert taken("n5")


def test_an_event_for_a_cycle_that_ended_changes_nothing(config):
    m = registered(config)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)), time.time())
    assert m.step(ev.ReportsClosed(0), time.time()) == [], "no plan yet: nothing to commit"
    assert m.step(ev.GatheringClosed(3), time.time()) == []
    m.step(ev.GatheringClosed(0), time.time())
    (commit,) = of(m.step(ev.ReportsClosed(0), time.time()), ev.Commit)
    assert m.step(ev.CommitDone(5, carry_out(commit.request)), time.time()) == []
    assert m.cycle.number == 0, "only its own cycle's commit concludes it"


def test_the_machine_runs_without_ray_or_an_event_loop():
    """Importing and stepping the machine loads no Ray module (the actor's shell does)."""
    code = (
        "import sys, ray_graceful.coordinator.machine as m, ray_graceful.coordinator.intake, "
        "ray_graceful.coordinator.orders, ray_graceful.coordinator.conclusion\n"
        "assert not [k for k in sys.modules if k == 'ray' or k.startswith('ray.')], "
        "sorted(k for k in sys.modules if k.startswith('ray'))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_spare_silent_past_the_join_deadline_ends_the_survivor_that_joined(tmp_path):
    """The survivor joined and registered; the spare never spoke (killed before it registered).
    At the join deadline the record fails and the survivor's slot is ordered out through a
    cycle of the new group - it is not left in a world whose other member is dead."""
    m = machine(fast_config(tmp_path, warm_restart=True, rejoin_timeout_s=5.0))
    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "1", True), "n1", 101)}
    spare = SpareRecord("spare-x", "spare", "n2", 9)
    record = m.warm.decide(
        0, 7, True, {"p1": True}, {"g": {0: "0"}}, [spare], frozenset({"n0"}), now=time.time()
    )
    m.state.cycle = Cycle(record.cycle)
    survivor = RankSpec("g", 1, 2, "1", True)
    m.step(Register("p1", "n1", 101, "h", "job-a", (survivor,)), time.time())
    m.step(Rejoined("joined", "p1", "g", 1, 2, 7, record.cycle), time.time())

    assert of(m.step(ev.JoinDeadline(record.cycle), record.join_by - 1), ev.CycleOpened) == []
    opened = m.step(ev.JoinDeadline(record.cycle), record.join_by)
    assert of(opened, ev.CycleOpened) == [ev.CycleOpened(record.cycle)]
    assert [(n.source, n.rank) for n in m.cycle.notices] == [("rejoin", ("g", 1))]
    assert "did not join" in m.cycle.notices[0].reason
    ordered = m.step(ev.GatheringClosed(record.cycle), time.time())
    assert {d.process_id for d in of(ordered, ev.OrderOut)} == {"p1"}


def test_a_spare_signalled_once_a_warm_restart_names_it_is_kept_and_others_leave(tmp_path):
    """``leave_spare``: a spare the decided warm restart names is refused, naming the cycle - it
    joins, and its signal is the new group's first notice - rather than leave the survivor
    waiting in the rendezvous until the join deadline. A spare nothing names leaves the pool,
    as does the named one once it said what it did."""
    m = machine(fast_config(tmp_path, warm_restart=True, rejoin_timeout_s=5.0))
    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "1", True), "n1", 101)}
    for spare_id, node, pid in (("spare-x", "n2", 9), ("spare-y", "n3", 10)):
        m.step(ev.SpareArrived(spare_id, "spare", node, pid), time.time())
    named = m.spares.spares["spare-x"]
    record = m.warm.decide(
        0, 7, True, {"p1": True}, {"g": {0: "0"}}, [named], frozenset({"n0"}), now=time.time()
    )
    assert "spare-x" in record.members

    kept = ev.reply_of(m.step(ev.SpareLeaving("spare-x", "SIGTERM"), time.time()))
    assert (kept.accepted, kept.cycle) == (False, record.cycle), kept
    assert record.result == "rejoining" and "spare-x" in m.spares.spares
    left = ev.reply_of(m.step(ev.SpareLeaving("spare-y", "SIGTERM"), time.time()))
    assert left.accepted and "spare-y" not in m.spares.spares

    m.step(Rejoined("joined", "spare-x", "g", 0, 2, 7, record.cycle), time.time())
    after = ev.reply_of(m.step(ev.SpareLeaving("spare-x", "SIGTERM"), time.time()))
    assert after.cycle is None, "it said what it did: nothing waits for it any more"


def test_a_member_lost_on_its_way_in_ends_the_warm_restart_with_its_cycle_not_the_next(tmp_path):
    """The spare registered and died in its load (Ray Train's new worker, killed there): its
    death is a notice of the new group's cycle, which concludes. The warm restart into that
    cycle is over then - failed, superseded by the cycle's own plan, its waiters woken - and its
    join deadline, later, no longer ends the ranks of the group after it."""
    config = fast_config(tmp_path, warm_restart=True, rejoin_timeout_s=5.0)
    m = machine(config)
    m.warm.survivors = {"p1": Survivor("p1", RankSpec("g", 1, 2, "0", True), "n1", 101)}
    spare = SpareRecord("spare-x", "spare", "n2", 9)
    record = m.warm.decide(
        0, 7, True, {"p1": True}, {"g": {0: "0"}}, [spare], frozenset({"n0"}), now=time.time()
    )
    cycle = record.cycle
    m.state.cycle = Cycle(cycle)
    m.step(Register("p1", "n1", 101, "h", "job-a", (RankSpec("g", 1, 2, "0", True),)), time.time())
    m.step(Register("x", "n2", 9, "h", "job-a", (RankSpec("g", 0, 2, "0", True),)), time.time())
    m.step(Rejoined("joined", "p1", "g", 1, 2, 7, cycle, loaded_from="own state"), time.time())
    lost = EvictionNotice("lost", "its actor died", cycle, rank=("g", 0))
    m.step(ev.NoticesIn((lost,)), time.time())
    m.step(ev.GatheringClosed(cycle), time.time())
    saved = write_shard(
        config.checkpoint_dir, 7, "g/0", lambda p, s: save_state_dict({"s": s}, p), group="g"
    )
    report(m, "p1", [saved])
    (commit,) = of(m.step(ev.ReportsClosed(cycle), time.time()), ev.Commit)
    concluded = m.step(ev.CommitDone(cycle, carry_out(commit.request)), time.time())

    assert of(concluded, ev.Concluded) and ev.WarmFinished(cycle) in concluded
    assert record.result == "failed" and "ended before 1 member(s) joined" in record.reason
    m.step(Register("p1", "n1", 101, "h", "job-a", (RankSpec("g", 1, 2, "0", True),)), time.time())
    after = m.step(ev.JoinDeadline(cycle), record.join_by)
    assert of(after, ev.CycleOpened) == [], "the next group's ranks are not ended by it"


def test_a_group_name_with_a_slash_is_refused_at_registration_and_at_setup(config):
    """'/' separates a group from its shard in a checkpoint's keys: "team/actor" and
    "team/critic" were committed as one DCP checkpoint "team". Refused where it enters, with
    the rule - on the coordinator (any client) and in ``graceful_setup`` (before any I/O)."""
    from ray_graceful.worker.process_groups import SetupError, resolve_group

    m = machine(config)
    spec = RankSpec("team/actor", 0, 1, "0", True)
    at_the_door = ev.admitted(Register("p0", "n0", 1, "h", "job-a", (spec,)), Register, "register")
    assert isinstance(at_the_door, ev.Malformed), "checked once, where the actor takes it"
    reply = ev.reply_of(m.step(at_the_door, time.time()))
    assert not reply.accepted and "without '/'" in reply.reason, reply
    assert m.registry.processes == {}
    with pytest.raises(SetupError, match=r"'/' separates a group from its shard.*'team-actor'"):
        resolve_group("team/actor")


def _saved_and_concluded(m, config, saver: str, reporters=("p0", "p1", "p2")):
    """Cycle 0 of replicas of g/0: ``saver`` saved step 5, every one of ``reporters`` (default
    three) reported, the commit ran - the machine's ``Concluded``."""
    record = write_shard(
        config.checkpoint_dir, 5, "g/0", lambda p, s: save_state_dict({"s": s}, p), group="g"
    )
    for pid in reporters:
        report(m, pid, [record] if pid == saver else [])
    (commit,) = of(m.step(ev.ReportsClosed(0), time.time()), ev.Commit)
    (done,) = of(m.step(ev.CommitDone(0, carry_out(commit.request)), time.time()), ev.Concluded)
    return done


def test_a_survivor_found_faulty_after_a_drain_was_planned_leaves_and_a_spare_takes_its_slot(
    tmp_path,
):
    """Three replicas of shard g/0 on n0, n1, n2; Ray drains n2 and the plan goes out at once
    (a drain, its node counted: nothing to wait for). Then n1's GPU is found FAULTY. Its save
    goes to its backup, and it is not kept as a survivor: the warm restart tells it to leave
    with the verdict and hands its slot to a spare - a rank on faulty hardware never trains on."""
    from ray_graceful.health import FAULTY, HealthReport, Reason

    config = fast_config(tmp_path, warm_restart=True, notice_gather_s=5.0)
    m = registered(config, ranks=3)
    m.spares.add("spare-x", "spare", "n3", 9)
    m.spares.add("spare-y", "spare", "n3", 10)
    drain = EvictionNotice("drain", "Ray is draining the node", 0, time.time() + 30, node_id="n2")
    assert of(m.step(ev.NoticesIn((drain,)), time.time()), ev.Gathered) == [ev.Gathered(0)], (
        "at once"
    )
    out = {
        d.process_id: d.answer.order
        for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    saver = next(pid for pid, order in out.items() if order.saves and not order.saves[0].is_backup)
    faulty = "p1" if saver != "p1" else "p0"

    xid = Reason(FAULTY, "xid_79", "XID 79: GPU has fallen off the bus")
    polled = m.step(
        ev.Polled(faulty, 0, PollState(5, HealthReport(FAULTY, (xid,), "scripted"))), time.time()
    )
    assert m.cycle.late_faulty.keys() == {faulty}
    assert [n.source for n in m.cycle.late_notices] == ["health"]
    if faulty == saver:
        assert of(polled, ev.SaveResolved)[0].saved is False, "its backup saves now"
    done = _saved_and_concluded(m, config, saver)

    assert done.outcome.result == "committed" and done.outcome.committed["step"] == 5
    warm = done.outcome.warm
    assert "FAULTY after the plan" in warm["told_to_leave"][faulty]
    was = {(m["rank"], m["was"].split(" ")[0]) for m in warm["members"]}
    faulty_rank, drained_rank = int(faulty[1:]), 2
    assert {(faulty_rank, "spare"), (drained_rank, "spare")} <= was, was


def _n2_drained_with_two_spares(tmp_path):
    """Three replicas of g/0, two spares on n3; n2 is drained and the plan goes out at once.
    The machine, its config, the saver, and a survivor that is not the saver."""
    config = fast_config(tmp_path, warm_restart=True, notice_gather_s=5.0)
    m = registered(config, ranks=3)
    m.spares.add("spare-x", "spare", "n3", 9)
    m.spares.add("spare-y", "spare", "n3", 10)
    drain = EvictionNotice("drain", "Ray is draining the node", 0, time.time() + 30, node_id="n2")
    m.step(ev.NoticesIn((drain,)), time.time())
    out = {
        d.process_id: d.answer.order
        for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    }
    saver = next(pid for pid, order in out.items() if order.saves and not order.saves[0].is_backup)
    survivor = "p1" if saver != "p1" else "p0"
    assert out[survivor].rejoin
    return m, config, saver, survivor


def test_a_survivor_signalled_after_the_plan_leaves_and_a_spare_takes_its_slot(tmp_path):
    """Three replicas of g/0; n2 is drained and the plan goes out at once. Then the rank on n1
    is SIGTERMed (its report arrives after the plan: the order already says rejoin). Its process
    is going too: the warm restart tells it to leave and hands its slot to a spare."""
    m, config, saver, late = _n2_drained_with_two_spares(tmp_path)
    sigterm = EvictionNotice("sigterm", "SIGTERM", 0, time.time() + 30, rank=("g", int(late[1:])))
    m.step(ev.NoticesIn((sigterm,)), time.time())
    assert [n.source for n in m.cycle.late_notices] == ["sigterm"]
    done = _saved_and_concluded(m, config, saver)

    warm = done.outcome.warm
    assert "a notice after the plan named it (sigterm: SIGTERM)" in warm["told_to_leave"][late]
    was = {(m["rank"], m["was"].split(" ")[0]) for m in warm["members"]}
    assert {(int(late[1:]), "spare"), (2, "spare")} <= was, was


def test_a_survivor_that_left_before_the_decision_is_no_member_and_a_spare_takes_its_slot(
    tmp_path,
):
    """Three replicas of g/0; n2 is drained. The survivor on n1 leaves before the cycle
    concluded (SIGTERMed in its teardown: its machine holds the signal and says it left, as it
    has no answer yet). The decision counts it out: a spare takes its rank, and it is told to
    leave - never is a member named that will not come."""
    m, config, saver, gone = _n2_drained_with_two_spares(tmp_path)
    said = m.step(Rejoined("left", gone, reason="signal 15 before its rejoin"), time.time())
    assert ev.reply_of(said).accepted and not of(said, ev.WarmFinished)
    done = _saved_and_concluded(m, config, saver)

    warm = done.outcome.warm
    assert "left before it had its rendezvous: signal 15" in warm["told_to_leave"][gone]
    was = {(m["rank"], m["was"].split(" ")[0]) for m in warm["members"]}
    assert {(int(gone[1:]), "spare"), (2, "spare")} <= was, was


def test_a_survivor_that_left_after_the_decision_ends_the_warm_restart_and_its_waiters_hear(
    tmp_path,
):
    """A hand-built group's survivor leaves once the warm restart was decided, before it had
    its answer (its word names no cycle): the record fails now, and the actor's waiters hear
    that the warm restart is over - they would have waited until its join deadline."""
    m = machine(fast_config(tmp_path, warm_restart=True))
    m.warm.survivors = {
        f"p{r}": Survivor(f"p{r}", RankSpec("g", r, 3, "0", True), "n1", 100 + r) for r in (1, 2)
    }
    spare = SpareRecord("spare-x", "spare", "n2", 9)
    record = m.warm.decide(
        0, 7, True, {"p1": True, "p2": True}, {"g": {0: "0"}}, [spare], frozenset({"n0"}),
        now=time.time(),
    )  # fmt: skip
    said = m.step(Rejoined("left", "p2", reason="SIGTERM while waiting to rejoin"), time.time())
    assert record.result == "failed" and "survivor of rank 2: it left" in record.reason
    assert ev.WarmFinished(record.cycle) in said


def test_every_train_worker_gone_hands_every_slot_to_trains_next_workers(tmp_path):
    """Every worker of a Ray Train group is SIGTERMed at once: nobody survives, but Train may
    see their failures one poll at a time and replace them one by one. Its new workers join a
    record that names every slot and loads the committed step - asked during the cycle, they
    wait for it. Where Train restarted the whole group instead (its workers register without
    asking), the record ends nobody at its join deadline."""
    config = fast_config(tmp_path, warm_restart=True)
    m = machine(config)
    for rank in range(2):
        spec = RankSpec("g", rank, 2, "0", True, replaced_by="ray-train-slot")
        m.step(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,)), time.time())
    sigterms = tuple(EvictionNotice("sigterm", "SIGTERM", 0, rank=("g", r)) for r in range(2))
    m.step(ev.NoticesIn(sigterms), time.time())
    orders = of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    assert not any(o.answer.order.rejoin for o in orders), "nobody survives"
    slot = train_slot_member("g", 1)
    assert m.warm.answer(slot) is None, "asked during the cycle: it waits for the decision"
    saver = next(o.process_id for o in orders if o.answer.order.saves)
    record = _saved_and_concluded(m, config, saver, ("p0", "p1")).warm
    assert record.result == "rejoining" and record.anew, record
    assert sorted(record.members) == [train_slot_member("g", 0), slot]
    answer = m.warm.answer(slot)
    assert (answer.action, answer.rank, answer.world_size, answer.step) == ("join", 1, 2, 5)
    # Train restarted the whole group instead: its workers register, nobody joins the record
    for rank in range(2):
        spec = RankSpec("g", rank, 2, "0", True, replaced_by="ray-train-slot")
        m.step(Register(f"q{rank}", f"n{rank}", 10 + rank, "h", "job-a", (spec,)), time.time())
    after = m.step(ev.JoinDeadline(record.cycle), record.join_by)
    assert record.result == "failed" and of(after, ev.CycleOpened) == [], "nobody is ended"


def test_a_hand_built_group_whose_every_rank_left_gets_no_record(config):
    m = registered(config.replace(warm_restart=True), ranks=2)
    sigterms = tuple(EvictionNotice("sigterm", "SIGTERM", 0, rank=("g", r)) for r in range(2))
    m.step(ev.NoticesIn(sigterms), time.time())
    orders = of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)
    saver = next(o.process_id for o in orders if o.answer.order.saves)
    concluded = _saved_and_concluded(m, m.state.config, saver, ("p0", "p1"))
    assert concluded.warm is None, "no spare comes, and Ray Train refills no slot"


def test_a_spare_poll_held_until_its_word_and_one_that_left_is_not_told_to_register(config):
    m = machine(config)
    m.step(ev.SpareArrived("s1", "spare", "n3", 9), time.time())
    assert m.step(ev.SparePolled("s1"), time.time()) == [ev.HoldSparePoll("s1")]
    assert m.step(ev.SparePolled("s1", held=True), time.time()) == [], "no word: it polls again"
    left = m.step(ev.SpareLeaving("s1", "SIGTERM"), time.time())
    assert ev.reply_of(left).accepted and m.spares.spares == {}
    assert m.step(ev.SparePolled("s1", held=True), time.time()) == [], "gone: not re-registered"
    (word,) = of(m.step(ev.SparePolled("s1"), time.time()), ev.Replied)
    assert word.answer.action == "register", "a fresh poll from a spare we do not know"


def test_ranks_agree_on_their_stop_step_only_where_every_one_answers_and_a_survivor_holds(
    tmp_path,
):
    """A drain with spares and the held path: every order says to agree on the stop step
    (``worker/stop_step.py``), so no survivor is released from inside a step it cannot hold. A
    lost host's ranks never answer (the others would wait out the agreement for nothing), and
    with ``warm_restart_holds=False`` nobody holds: no agreement then."""
    m, *_ = _n2_drained_with_two_spares(tmp_path)
    assert all(p.order.agree_stop_step for p in m.state.registry.processes.values()), "drain"

    def orders_after(notice_for, **settings) -> list:
        config = fast_config(tmp_path, warm_restart=True, notice_gather_s=5.0, **settings)
        m = registered(config, ranks=3)
        m.spares.add("spare-x", "spare", "n3", 9)
        m.step(notice_for(m), time.time())
        return [d.answer.order for d in of(m.step(ev.GatheringClosed(0), time.time()), ev.OrderOut)]

    lost = orders_after(lambda m: ev.HostLost("n2", "no heartbeat"))
    assert lost and not any(o.agree_stop_step for o in lost), "a lost host's rank never says"
    drain = EvictionNotice("drain", "draining", 0, time.time() + 30, node_id="n2")
    no_hold = orders_after(lambda m: ev.NoticesIn((drain,)), warm_restart_holds=False)
    assert no_hold and not any(o.agree_stop_step for o in no_hold), "nobody holds"
