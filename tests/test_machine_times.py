"""The coordinator's machine on explicit times: no clock, no threads, no Ray.

As ``test_lifecycle.py`` drives the rank's machine, this drives the coordinator's: every event
goes in with the time it happened, and every time the machine writes down - when the cycle
gathered and planned, each order's deadline, when a message was refused, the outcome's
timings, when a held step is due and when it was lost - is one of those times. The clock is
made to fail while the machine steps, so a deciding module that reads it fails here.
"""

from __future__ import annotations

import time

import pytest

from ray_graceful import TeardownReport
from ray_graceful.checkpoint import ShardRecord
from ray_graceful.coordinator import events as ev
from ray_graceful.coordinator.conclusion import CommitResult
from ray_graceful.coordinator.machine import CycleMachine
from ray_graceful.coordinator.spare_pool import SparePool
from ray_graceful.coordinator.warm_restarts import WarmRestarts
from ray_graceful.notices import EvictionNotice
from ray_graceful.protocol import LateSave, RankSpec, Register, Result
from tests.helpers import fast_config

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # the events' times: a day long past, so no clock could produce them


@pytest.fixture
def no_clock(monkeypatch):
    """``time.time`` and ``time.monotonic`` raise while the machine steps."""

    def read(*_: object) -> float:
        raise AssertionError("the coordinator's machine read the clock")

    monkeypatch.setattr(time, "time", read)
    monkeypatch.setattr(time, "monotonic", read)


def machine(tmp_path) -> CycleMachine:
    config = fast_config(tmp_path, memory_replicas=1, warm_restart=True)
    return CycleMachine(config, "job-a", WarmRestarts(config, ("h", 1)), SparePool())


def of(decisions, kind):
    return [d for d in decisions if isinstance(d, kind)]


def report(cycle: int, at: float, *saved: ShardRecord) -> TeardownReport:
    told = TeardownReport(1, "h", "n", "job-a", [], "t", cycle, at, at)
    told.saved.extend(saved)
    return told


def test_a_cycle_and_its_held_step_run_on_the_events_times(tmp_path, no_clock):
    m = machine(tmp_path)
    for rank in range(2):
        spec = RankSpec("g", rank, 2, str(rank), True)
        m.step(Register(f"p{rank}", f"n{rank}", rank, "h", "job-a", (spec,)), T0)
    assert m.registry.processes["p0"].last_seen == T0

    notice = EvictionNotice("api", "x", 0, T0 + 31, node_id="n1", received_at=T0 + 1)
    m.step(ev.NoticesIn((notice,)), T0 + 1)
    refused = m.step(ev.Malformed({"notice": "?"}, "a notice is a mapping"), T0 + 1.5)
    assert of(refused, ev.Rejected) and m.cycle.rejected[-1]["at"] == T0 + 1.5

    ordered = m.step(ev.GatheringClosed(0), T0 + 2)
    assert m.cycle.plan is not None and m.cycle.plan.created_at == m.cycle.plan_at == T0 + 2
    assert m.cycle.orders_at == T0 + 2
    deadlines = {d.process_id: d.answer.order.deadline for d in of(ordered, ev.OrderOut)}
    assert deadlines["p1"] <= T0 + 31, "the evicted rank's order keeps the notice's deadline"

    held = ShardRecord("g/0", 9, "f0", 10, 0, "g", 0, tier="held", holders=("n0",))
    saved = ShardRecord("g/1", 9, "f1", 10, 0, "g", 1, tier="memory", holders=("n0",))
    m.step(ev.ReportIn("p0", report(0, T0 + 3, held)), T0 + 3)
    m.step(ev.ReportIn("p1", report(0, T0 + 3, saved)), T0 + 3)
    (commit,) = of(m.step(ev.ReportsClosed(0), T0 + 4), ev.Commit)
    landed = CommitResult(Result.HELD, "held", {"tier": "held", "step": 9})
    concluded = m.step(ev.CommitDone(0, landed), T0 + 5)

    (done,) = of(concluded, ev.Concluded)
    assert done.outcome.timings["outcome"] == pytest.approx(4.0), "T0+5 less the notice's T0+1"
    config = m.state.config
    due = T0 + 5 + config.rejoin_timeout_s + config.save_budget_s + 2.0
    assert of(concluded, ev.HeldTimer) == [ev.HeldTimer(0, due)]
    assert m.held.steps[0].held_at == T0 + 5 and commit.request.cycle == 0

    assert m.step(ev.HeldDue(0), due - 0.001) == [], "not due yet"
    copy = ShardRecord("g/0", 9, "f0", 10, 0, "g", 0, tier="memory", holders=("n1",))
    assert of(m.step(LateSave("p0", 0, (copy,)), T0 + 6), ev.CommitHeld), "every copy in"
    assert m.held.steps[0].at["committing"] == T0 + 6
    assert m.step(ev.HeldDue(0), due) == [], "committing: no longer due"


def one_rank_held_at_t0_plus_2(tmp_path) -> CycleMachine:
    """One rank of one group, evicted at T0 and planned at T0+1; at T0+2 it reported its shard
    of step 9 held: the cycle is open, its reports not closed yet."""
    m = machine(tmp_path)
    m.step(Register("p0", "n0", 0, "h", "job-a", (RankSpec("g", 0, 1, "0", True),)), T0)
    m.step(ev.NoticesIn((EvictionNotice("api", "x", 0, T0 + 31, "n0", received_at=T0),)), T0)
    m.step(ev.GatheringClosed(0), T0 + 1)
    held = ShardRecord("g/0", 9, "f0", 10, 0, "g", 0, tier="held", holders=("n0",))
    m.step(ev.ReportIn("p0", report(0, T0 + 2, held)), T0 + 2)
    return m


def test_a_copy_that_came_before_the_cycle_concluded_commits_the_step_at_its_conclusion(
    tmp_path, no_clock
):
    """A holder that left before the decision copies its shard as it goes: its ``LateSave``
    comes while the cycle is still open. It is kept, and taken at the conclusion."""
    m = one_rank_held_at_t0_plus_2(tmp_path)
    copy = ShardRecord("g/0", 9, "f0", 10, 0, "g", 0, tier="memory", holders=("n1",))
    (kept,) = of(m.step(LateSave("p0", 0, (copy,)), T0 + 2.5), ev.Replied)
    assert kept.answer.accepted
    m.step(ev.ReportsClosed(0), T0 + 3)
    concluded = m.step(ev.CommitDone(0, CommitResult(Result.HELD, "held")), T0 + 4)
    assert of(concluded, ev.CommitHeld) and m.held.steps[0].at["committing"] == T0 + 4


def test_a_held_step_whose_copy_never_came_is_lost_at_its_due_time(tmp_path, no_clock):
    m = one_rank_held_at_t0_plus_2(tmp_path)
    m.step(ev.ReportsClosed(0), T0 + 3)
    concluded = m.step(ev.CommitDone(0, CommitResult(Result.HELD, "held")), T0 + 4)
    (timer,) = of(concluded, ev.HeldTimer)

    lost = m.step(ev.HeldDue(0), timer.until)
    assert [type(d) for d in lost] == [ev.HeldLost, ev.HeldChanged]
    assert "g/0" in lost[0].reason and m.held.steps[0].at["lost"] == timer.until
