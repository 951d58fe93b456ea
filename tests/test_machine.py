"""The cycle machine on its own: typed events in, typed decisions out - no Ray, no event loop.

What the actor does with the decisions is ``test_coordinator_logic.py``'s; here each rule is
read straight off the decisions: who is woken with which order, when the cycle may conclude,
what is to be committed, and that the outcome is the one record of the cycle.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ray_graceful import TeardownReport
from ray_graceful.checkpoint import save_state_dict, write_shard
from ray_graceful.coordinator import events as ev
from ray_graceful.coordinator.conclusion import carry_out
from ray_graceful.coordinator.machine import CycleMachine
from ray_graceful.coordinator.spares import SparePool
from ray_graceful.coordinator.warm import WarmRestarts
from ray_graceful.notices import EvictionNotice
from ray_graceful.protocol import Ack, PollState, RankSpec, Register
from tests.helpers import fast_config

pytestmark = pytest.mark.unit


@pytest.fixture
def config(tmp_path):
    return fast_config(tmp_path)


def machine(config) -> CycleMachine:
    return CycleMachine(config, "job-a", WarmRestarts(config, lambda: ("h", 1)), SparePool())


def registered(config, ranks=2) -> CycleMachine:
    """A machine with group "g" of ``ranks`` replicas of shard "0", one process per node."""
    m = machine(config)
    for rank in range(ranks):
        spec = RankSpec("g", rank, ranks, "0", True)
        m.step(ev.Registration(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,))))
    return m


def of(decisions, kind):
    return [d for d in decisions if isinstance(d, kind)]


def report(m: CycleMachine, pid: str, saved: list | None = None) -> list:
    rep = TeardownReport(1, "h", "n", "job-a", [], "t", m.cycle.number, time.time(), time.time())
    rep.saved.extend(saved or [])
    return m.step(ev.ReportIn(pid, rep))


def test_a_notice_opens_the_cycle_and_closing_the_gathering_orders_every_process(config):
    m = registered(config)
    opened = m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)))
    assert of(opened, ev.CycleOpened) == [ev.CycleOpened(0)]
    assert ev.reply_of(opened).accepted
    held = m.step(ev.Polled("p0", 0, PollState()))
    assert of(held, ev.HoldPoll) == [ev.HoldPoll("p0")], "no order before the plan"

    ordered = m.step(ev.GatheringClosed(0))
    out = {d.process_id: d.answer.order for d in of(ordered, ev.OrderOut)}
    assert set(out) == {"p0", "p1"}
    # The survivor saves (rank 0 on n0); the evicted replica on n1 is its backup.
    assert [s.shard_key for s in out["p0"].saves] == ["g/0"] and not out["p0"].saves[0].is_backup
    assert out["p1"].saves[0].backup_for == 0
    assert ev.NodeLeaving("n1", pytest.approx(out["p1"].deadline, abs=0.5)) in ordered
    # Unacknowledged, the order is the answer to every poll; acknowledged, polls are held.
    again = m.step(ev.Polled("p0", 0, PollState()))
    assert ev.reply_of(again).order == out["p0"]
    m.step(ev.Acked(Ack("p0", 0, out["p0"].order_id)))
    assert of(m.step(ev.Polled("p0", 0, PollState())), ev.HoldPoll)


def test_the_cycle_concludes_once_every_ordered_process_reported_and_commits(config, tmp_path):
    m = registered(config)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)))
    m.step(ev.GatheringClosed(0))
    record = write_shard(
        config.checkpoint_dir, 5, "g/0", lambda p, s: save_state_dict({"s": s}, p), group="g"
    )
    first = report(m, "p0", [record.to_dict()])
    assert of(first, ev.SaveResolved) == [ev.SaveResolved(0, "g/0", True, "h:0 saved it")]
    assert not of(first, ev.AllReported), "p1 has not reported yet"
    assert of(report(m, "p1"), ev.AllReported) == [ev.AllReported(0)]

    (commit,) = of(m.step(ev.ReportsClosed(0)), ev.Commit)
    assert (commit.request.tier, commit.request.expected) == ("disk", ("g/0",))
    landed = carry_out(commit.request)  # the actor runs this on a thread: the disk only
    concluded = m.step(ev.CommitDone(0, landed))
    (done,) = of(concluded, ev.Concluded)
    assert done.outcome.result == "committed" and done.outcome.committed["step"] == 5
    assert m.cycle.number == 1 and m.registry.processes == {}, "the next cycle is open, empty"
    with pytest.raises(AttributeError):
        done.outcome.result = "abandoned"  # an outcome is a record: written once


def test_a_stale_or_unknown_poll_is_answered_never_held(config):
    m = registered(config)
    assert ev.reply_of(m.step(ev.Polled("nobody", 0, PollState()))).kind == "unknown"
    stale = m.step(ev.Polled("p0", 7, PollState()))
    assert ev.reply_of(stale).kind == "stale" and of(stale, ev.Rejected)


def test_a_lost_rank_opens_a_cycle_and_in_teardown_ends_the_wait_for_it(config):
    m = machine(config)
    for rank in range(2):
        spec = RankSpec("g", rank, 2, "0", True)
        register = Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,), f"a{rank}")
        m.step(ev.Registration(register))
    assert m.watched_actors() == {"a0", "a1"}
    lost = m.step(ev.RanksLost(frozenset({"a1", "not-ours"})))
    assert of(lost, ev.CycleOpened) and ev.reply_of(lost) is None, "its own event: no caller"
    m.step(ev.GatheringClosed(0))
    assert of(report(m, "p0"), ev.AllReported), "the lost process has no report coming"


def test_an_event_for_a_cycle_that_ended_changes_nothing(config):
    m = registered(config)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, node_id="n1"),)))
    assert m.step(ev.ReportsClosed(0)) == [], "no plan yet: nothing to commit"
    assert m.step(ev.GatheringClosed(3)) == []
    m.step(ev.GatheringClosed(0))
    (commit,) = of(m.step(ev.ReportsClosed(0)), ev.Commit)
    assert m.step(ev.CommitDone(5, carry_out(commit.request))) == []
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
