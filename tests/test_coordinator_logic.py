"""The coordinator's logic, without a cluster: the actor class driven directly on an event loop.

Ray's drain state and actor table come in through the injected sources (as Ray Train's
``PreemptionWatcher`` takes a ``DrainSource``); checkpoints are real files in a temp dir.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import time

import pytest

from ray_graceful import TeardownReport, latest_committed
from ray_graceful.checkpoint import (
    load_state_dict,
    save_state_dict,
    shard_file_name,
    step_dir,
    write_shard,
)
from ray_graceful.coordinator import CoordinatorActor, outcomes
from ray_graceful.protocol import (
    Ack,
    PollState,
    RankSpec,
    Register,
    SaveResult,
    SaveTurn,
    SigtermSeen,
)
from tests.helpers import fast_config, until

RANK = RankSpec("g", 0, 1, "0", True)
# A group of two replicas of shard "0" (world size 2): rank 0 on n0, rank 1 on n1.
PRIMARY = RankSpec("g", 0, 2, "0", True)
REPLICA = RankSpec("g", 1, 2, "0", True)
# Their actors, as Ray names them (32 hexadecimal characters).
A0, A1 = "a0" * 16, "a1" * 16


class Drains:
    """A drain source the test scripts; it can also fail or answer nonsense."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.error: BaseException | None = None
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return dict(self.state)


class Dead:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __call__(self, watched: set[str]) -> set[str]:
        return watched & self.ids


@pytest.fixture
def config(tmp_path):
    return fast_config(tmp_path)


def make(config, job_id="job-a"):
    drains, dead = Drains(), Dead()
    return CoordinatorActor(config, job_id, drain_source=drains, lost_source=dead), drains, dead


async def register(coord, pid="p0", node="n0", job_id="job-a", actor_id="", ranks=(RANK,)):
    return await coord.register(Register(pid, node, 1, "h", job_id, tuple(ranks), actor_id))


def report(cycle: int, saved: list | None = None) -> TeardownReport:
    return TeardownReport(
        1, "h", "n0", "job-a", [], "test", cycle, time.time(), time.time() + 5, saved=saved or []
    )


def saved_report(root: str, cycle: int, step: int) -> TeardownReport:
    record = write_shard(root, step, "g/0", lambda p, s: save_state_dict({"s": s}, p), group="g")
    return report(cycle, [record])


IDLE = PollState()


def ordered(coord, *pids: str):
    """Every one of ``pids`` has its order (the plan is made and the orders are out)."""
    processes = coord.machine.registry.processes
    return lambda: all(processes[p].order is not None for p in pids)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def order_after_a_notice(coord):
    """Register p0 (one rank on n0), notice n0, and return the answer to p0's poll."""
    assert (await register(coord)).accepted
    poll = asyncio.create_task(coord.poll("p0", 0, IDLE, 10))
    await asyncio.sleep(0)
    assert (await coord.notify({"node_id": "n0", "reason": "test"})).accepted
    return await poll


def test_a_notice_plans_orders_and_commits(config):
    async def scenario():
        coord, *_ = make(config)
        answer = await order_after_a_notice(coord)
        assert answer.kind == "order" and answer.order.job_id == "job-a"
        assert [s.shard_key for s in answer.order.saves] == ["g/0"]
        await coord.report_teardown("p0", saved_report(config.checkpoint_dir, 0, 7))
        return await coord.wait_outcome(None, 10), coord

    outcome, coord = run(scenario())
    assert outcome.result == "committed" and outcome.committed["step"] == 7
    assert latest_committed(config.checkpoint_dir).step == 7
    assert coord.machine.cycle.number == 1


@pytest.mark.parametrize("where", ["a checkpoint directory", "nowhere"])
def test_an_order_says_whether_anyone_of_the_cycle_needs_a_step_boundary(config, where):
    """A step boundary serves a save: with nowhere to save, nobody waits for one, and a rank
    inside a collective releases its peers at once."""
    if where == "nowhere":
        config = config.replace(checkpoint_dir=None)

    async def scenario():
        coord, *_ = make(config)
        return (await order_after_a_notice(coord)).order

    order = run(scenario())
    if where == "nowhere":
        assert not order.saves and not order.boundary_needed, order
    else:
        assert order.saves and order.boundary_needed, order


def test_another_jobs_ranks_and_orders_are_refused(config):
    async def scenario():
        coord, *_ = make(config)
        return await register(coord, job_id="job-b")

    answer = run(scenario())
    assert not answer.accepted
    assert "belongs to job job-a, not to job job-b" in answer.reason


def test_a_cycle_that_fails_to_conclude_still_concludes_and_the_next_accepts(config):
    """An error while concluding used to leave the cycle open forever and every later
    registration refused: now the outcome says "failed" and why. Here the manifest's path is
    taken by a directory, so its write fails as ENOSPC or EIO would."""

    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        poll = asyncio.create_task(coord.poll("p0", 0, IDLE, 10))
        await asyncio.sleep(0)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await poll
        saved = saved_report(config.checkpoint_dir, 0, 7)
        os.makedirs(os.path.join(step_dir(config.checkpoint_dir, 7), "MANIFEST.json", "taken"))
        await coord.report_teardown("p0", saved)
        outcome = await coord.wait_outcome(0, 10)
        again = await register(coord, pid="p1")
        return outcome, again

    outcome, again = run(scenario())
    assert outcome.result == "failed" and "failed while concluding" in outcome.reason
    assert again.accepted and again.cycle == 1


def test_the_drain_watcher_survives_bad_answers_and_errors(config):
    async def scenario():
        coord, drains, _ = make(config)
        await register(coord)
        rejected = coord.machine.cycle.rejected
        drains.state = {"n0": "soon"}  # nonsense from the source
        await until(lambda: any("not milliseconds" in r["reason"] for r in rejected), 5, "nonsense")
        drains.state, drains.error = {}, KeyError("moved")  # an unexpected error type
        await until(lambda: any("KeyError" in r["reason"] for r in rejected), 5, "the error")
        drains.error = None
        calls = drains.calls
        drains.state = {"n0": int((time.time() + 2) * 1000)}
        sources = lambda: [n.source for n in coord.machine.cycle.notices]  # noqa: E731
        await until(lambda: "drain" in sources(), 5, "the good drain as a notice")
        return coord, drains, calls

    coord, drains, calls = run(scenario())
    assert drains.calls > calls, "the watcher kept polling after an error"
    rejected = coord.machine.cycle.rejected
    assert any("not milliseconds" in r["reason"] for r in rejected), rejected
    assert any("KeyError" in r["reason"] for r in rejected), "the error is on record"
    assert "drain" in [n.source for n in coord.machine.cycle.notices], (
        "the good drain became a notice"
    )


def test_a_rank_lost_mid_teardown_ends_the_wait(config):
    async def scenario():
        coord, _drains, dead = make(config.replace(teardown_timeout_s=20.0, save_budget_s=5.0))
        await register(coord, pid="p0", actor_id=A0, ranks=(PRIMARY,))
        await register(coord, pid="p1", actor_id=A1, ranks=(REPLICA,))
        polls = [asyncio.create_task(coord.poll(p, 0, IDLE, 10)) for p in ("p0", "p1")]
        await asyncio.sleep(0)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await asyncio.gather(*polls)
        await coord.report_teardown("p0", report(0))
        started = time.monotonic()
        dead.ids = {A1}  # p1 is killed mid-teardown: no report will come
        outcome = await coord.wait_outcome(0, 15)
        return outcome, time.monotonic() - started

    outcome, waited = run(scenario())
    assert waited < 5, f"waited {waited:.1f}s for a rank that died (deadline 20 s)"
    assert outcome.missing == ["h:1 (died without a notice)"]


def test_wait_outcome_without_a_cycle_returns_the_one_just_concluded(config):
    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await coord.report_teardown("p0", report(0))
        first = await coord.wait_outcome(None, 10)
        late = await coord.wait_outcome(None, 0.1)  # asked after it concluded
        return first, late

    first, late = run(scenario())
    assert first is not None and late is not None and late.cycle == first.cycle == 0


def test_a_spare_is_handed_one_slot_only(config):
    async def scenario():
        coord, *_ = make(config)
        await coord.register_spare("s1", "spare", "n0", 5)
        first = await coord.assign_spare("g", 0)
        second = await coord.assign_spare("g", 1)
        order = await coord.poll_spare("s1", 1)
        return first, second, order, coord

    first, second, order, coord = run(scenario())
    assert first.spare_id == "s1" and first.assigned
    assert second.spare_id is None, "the second order would go where nobody polls"
    assert second.reason == "no spare is waiting"
    assert order.action == "assigned" and order.rank == 0
    assert "s1" not in coord.spares.spares


def test_malformed_notices_and_receipt_times_are_rejected_not_raised(config):
    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        return (
            await coord.notify(["not", "a", "mapping"]),
            await coord.notify({"node_id": "n0", "reason": "x", "deadline": 30}),
            await coord.report_sigterm(SigtermSeen("p0", 0, float("nan"))),
        )

    not_a_mapping, past, nan = run(scenario())
    assert not not_a_mapping.accepted and "mapping" in not_a_mapping.reason
    assert not past.accepted and "--deadline-in" in past.reason
    assert not nan.accepted and "received_at nan" in nan.reason


def test_a_sigterm_from_a_process_it_does_not_know_is_refused_for_now_only(config):
    """A coordinator Ray restarted hears a SIGTERM through a node agent that reconnected first:
    the process has not registered again yet. Refused for now (``retry``), so that the rank
    reports again once registered instead of going alone; a stale cycle is refused for good."""

    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        unknown = await coord.report_sigterm(SigtermSeen("p-new", 0, time.time()))
        stale = await coord.report_sigterm(SigtermSeen("p0", 7, time.time()))
        return unknown, stale

    unknown, stale = run(scenario())
    assert not unknown.accepted and unknown.retry and "not registered" in unknown.reason
    assert not stale.accepted and not stale.retry and "stale" in stale.reason


def test_outcome_is_published_where_the_config_says(config):
    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await coord.report_teardown("p0", report(0))
        return await coord.wait_outcome(0, 10)

    outcome = run(scenario())
    with open(os.path.join(config.report_dir, "job-a", "outcome-cycle-0.json")) as f:
        assert json.load(f) == json.loads(outcome.to_json()), "the file says what the API returns"


def test_an_order_is_delivered_until_it_is_acknowledged(config):
    """A poll whose answer is lost on the way (a client-side timeout) loses nothing: the next
    poll gets the same order, until the process acknowledges it."""

    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await until(ordered(coord, "p0"), 5, "the plan (nobody was polling)")
        first = await coord.poll("p0", 0, IDLE, 1)
        again = await coord.poll("p0", 0, IDLE, 1)  # the first answer never arrived
        assert (await coord.ack(Ack("p0", 0, again.order.order_id))).accepted
        after = await coord.poll("p0", 0, IDLE, 0.1)
        return first, again, after

    first, again, after = run(scenario())
    assert first.kind == again.kind == "order"
    assert first.order.order_id == again.order.order_id, "the same order, handled once"
    assert after.kind == "idle", "acknowledged: not sent again"


def test_a_message_of_another_protocol_version_is_refused_with_a_reason(config):
    async def scenario():
        coord, *_ = make(config)
        message = Register("p0", "n0", 1, "h", "job-a", (RANK,), version=99)
        refused = await coord.register(message)
        await register(coord)
        await coord.notify({"node_id": "n0", "reason": "test"})
        await until(ordered(coord, "p0"), 5, "the order")
        order = coord.machine.registry.processes["p0"].order
        old_ack = await coord.ack(Ack("p0", 0, order.order_id, version=99))
        return refused, old_ack, coord.machine.registry.processes["p0"].acked

    refused, old_ack, acked = run(scenario())
    assert not refused.accepted and "protocol version 99" in refused.reason
    assert not old_ack.accepted and "protocol version 99" in old_ack.reason
    assert not acked, "an acknowledgement of another version does not stop the re-sends"


async def evict_groups(coord, cycles: int, ranks: int) -> None:
    """``cycles`` times: a group of ``ranks`` on node n0 registers, n0 gets a notice, every
    rank reports; until the cycle's outcome."""
    for cycle in range(cycles):
        for i in range(ranks):
            spec = RankSpec("g", i, ranks, str(i), True)
            await coord.register(Register(f"p{cycle}-{i}", "n0", i, "h", "job-a", (spec,)))
        await coord.notify({"node_id": "n0", "reason": "test"})
        await until(ordered(coord, *(f"p{cycle}-{i}" for i in range(ranks))), 5, "the orders")
        for i in range(ranks):
            await coord.report_teardown(f"p{cycle}-{i}", report(cycle))
        await coord.wait_outcome(cycle, 10)


def test_nothing_of_a_concluded_cycle_stays_but_its_outcome(config):
    """Memory does not grow with the number of cycles: old processes and ranks are dropped."""

    async def scenario():
        coord, *_ = make(config)
        await evict_groups(coord, cycles=3, ranks=20)
        return coord

    coord = run(scenario())
    assert coord.machine.cycle.number == 3
    assert coord.machine.registry.processes == {} and coord.machine.registry.ranks == {}
    assert sorted(coord.outcomes.outcomes) == [0, 1, 2]


def test_big_outcomes_are_kept_on_disk_and_still_answered(config, monkeypatch):
    """Issue 22: each outcome holds every rank's report and order; 16 of them kept in memory
    grew the coordinator by 5 MB a cycle at 4,096 ranks. Past ``KEEP_RECORDS`` only the newest
    stays in memory, and an older one is read back from its file, the same answer."""
    monkeypatch.setattr(outcomes, "KEEP_RECORDS", 30)  # 20 ranks: 20 reports + 20 orders each

    async def scenario():
        coord, *_ = make(config)
        await evict_groups(coord, cycles=3, ranks=20)
        first = await coord.wait_outcome(0, 1)
        return coord, first

    coord, first = run(scenario())
    assert sorted(coord.outcomes.outcomes) == [2], "only the newest is held in memory"
    assert first is not None and first.cycle == 0 and len(first.reports) == 20
    with open(os.path.join(config.report_dir, "job-a", "outcome-cycle-0.json")) as f:
        assert first.to_dict() == json.load(f), "read back: what the file says"


@pytest.mark.parametrize("saver_fate", ["failed", "saved", "died", "silent"])
def test_a_backup_saves_exactly_when_the_saver_cannot(config, saver_fate):
    """Drain n1: rank 0 (survivor) saves shard g/0, rank 1 (drained) is its backup. The backup
    saves only if the saver failed or died - never both, so a shard has one writer."""

    async def scenario():
        coord, _drains, dead = make(config.replace(teardown_timeout_s=20.0, save_budget_s=5.0))
        await register(coord, pid="p0", actor_id=A0, ranks=(PRIMARY,))
        await register(coord, pid="p1", node="n1", actor_id=A1, ranks=(REPLICA,))
        polls = [asyncio.create_task(coord.poll(p, 0, IDLE, 10)) for p in ("p0", "p1")]
        await asyncio.sleep(0)
        await coord.notify({"node_id": "n1", "reason": "test"})
        saver, backup = [(await p).order for p in polls]
        assert [s.is_backup for s in saver.saves] == [False]
        assert backup.saves[0].backup_for == 0 and backup.saves[0].shard_key == "g/0"
        turn = asyncio.create_task(
            coord.save_turn(SaveTurn("p1", 0, "g/0"), 0.5 if saver_fate == "silent" else 10)
        )
        await until(lambda: (0, "g/0") in coord.backups.events, 5, "the backup's turn held")
        assert not turn.done(), "the backup waits for the saver's word"
        if saver_fate == "failed":
            why = "save failed: not quiescent"
            await coord.save_result(SaveResult("p0", 0, failed=("g/0",), reason=why))
        elif saver_fate == "saved":
            await coord.save_result(SaveResult("p0", 0, saved=("g/0",)))
        elif saver_fate == "died":
            dead.ids = {A0}
        answer = await turn
        if answer.save:
            await coord.report_teardown("p1", saved_report(config.checkpoint_dir, 0, 9))
        else:
            await coord.report_teardown("p1", report(0))
        if saver_fate != "died":
            saved = saver_fate == "saved"
            await coord.report_teardown(
                "p0", saved_report(config.checkpoint_dir, 0, 9) if saved else report(0)
            )
        return answer, await coord.wait_outcome(0, 15)

    answer, outcome = run(scenario())
    must_save = saver_fate in ("failed", "died")
    assert answer.accepted and answer.save is must_save, answer
    if saver_fate == "failed":
        assert "not quiescent" in answer.why
    if saver_fate == "silent":
        assert "had not reported" in answer.why
        assert outcome.result == "abandoned"  # nobody saved: nothing committed
    else:
        assert outcome.result == "committed" and outcome.committed["step"] == 9
    assert [f["shard"] for f in outcome.fallbacks] == (["g/0"] if must_save else [])


def test_only_a_named_backup_may_ask_for_a_turn(config):
    async def scenario():
        coord, *_ = make(config.replace(teardown_timeout_s=20.0, save_budget_s=5.0))
        await register(coord, pid="p0", ranks=(PRIMARY,))
        await register(coord, pid="p1", node="n1", ranks=(REPLICA,))
        await coord.notify({"node_id": "n1", "reason": "test"})
        await until(ordered(coord, "p0", "p1"), 5, "the orders")
        return (
            await coord.save_turn(SaveTurn("p0", 0, "g/0"), 1),  # the saver itself
            await coord.save_turn(SaveTurn("p1", 3, "g/0"), 1),  # another cycle
            await coord.save_turn(SaveTurn("p1", 0, "g/0", version=99), 1),
        )

    own, stale, version = run(scenario())
    assert not own.accepted and not own.save and "no backup of g/0" in own.why
    assert not stale.accepted and "stale" in stale.why
    assert not version.accepted and "protocol version 99" in version.why


def test_gathering_ends_as_soon_as_every_touched_node_is_covered(config):
    """A window of 5 s: a SIGTERM to one of two processes on a node waits for the other (or
    the window) and plans the moment it comes; Ray's drain of a node plans at once; a notice
    of another kind (here the API's) keeps the whole window."""

    async def scenario():
        coord, *_ = make(config.replace(notice_gather_s=5.0, teardown_timeout_s=20.0))
        three = [RankSpec("g", i, 3, "0", True) for i in range(3)]
        await register(coord, pid="p0", ranks=three[:1])
        await register(coord, pid="p1", ranks=three[1:2])
        await register(coord, pid="p2", node="n1", ranks=three[2:])
        started = time.monotonic()
        await coord.report_sigterm(SigtermSeen("p0", 0, time.time()))
        await asyncio.sleep(0.3)  # a window in which nothing may happen: still gathering
        after_one = coord.machine.cycle.phase
        await coord.report_sigterm(SigtermSeen("p1", 0, time.time()))
        await until(lambda: coord.machine.cycle.phase.value == "tearing down", 5, "the plan")
        return (
            after_one,
            coord.machine.cycle.phase,
            time.monotonic() - started,
            coord.machine.cycle.notices,
        )

    after_one, after_both, took, notices = run(scenario())
    assert after_one.value == "gathering", "p1 on the same node has no notice yet"
    assert after_both.value == "tearing down" and took < 1.0
    assert {n.rank for n in notices} == {("g", 0), ("g", 1)}

    async def noticed(source: str):
        coord, drains, _ = make(config.replace(notice_gather_s=5.0, teardown_timeout_s=20.0))
        await register(coord, pid="p0", ranks=(PRIMARY,))
        await register(coord, pid="p2", node="n1", ranks=(REPLICA,))
        if source == "drain":
            drains.state = {"n1": int((time.time() + 30) * 1000)}
        else:
            await coord.notify({"node_id": "n1", "reason": "test"})
        await until(lambda: coord.machine.cycle.notices, 5, "the notice")
        await asyncio.sleep(0.3)  # a window in which nothing may happen: still gathering
        return coord.machine.cycle.phase

    assert run(noticed("api")).value == "gathering", "a notice from the API keeps the window"
    assert run(noticed("drain")).value == "tearing down", "a drained node, all counted: planned"


@pytest.mark.parametrize("faulty_lands", ["first", "last"])
def test_a_saver_found_faulty_after_a_drain_was_planned_hands_its_save_to_its_backup(
    config, faulty_lands
):
    """Ray drains n1; the plan goes out at once: rank 0 on n0 saves shard g/0, rank 1 (on the
    drained n1) is its backup. Then n0's GPU is found FAULTY. A rank on faulty hardware never
    saves: the backup is told to save, and the commit keeps the backup's save, not the faulty
    rank's, which still reports one. Both rename into one file name: where the faulty rank's
    file landed last, the file on disk is not the save kept, and nothing is committed."""
    from ray_graceful.health import FAULTY, HealthReport, Reason

    def save(pid: str, step: int):
        def write(path, s):
            return save_state_dict({"s": s, "by": pid}, path)

        return write_shard(config.checkpoint_dir, step, "g/0", write, group="g")

    async def scenario():
        coord, drains, _ = make(
            config.replace(notice_gather_s=5.0, teardown_timeout_s=20.0, save_budget_s=5.0)
        )
        await register(coord, pid="p0", actor_id=A0, ranks=(PRIMARY,))
        await register(coord, pid="p1", node="n1", actor_id=A1, ranks=(REPLICA,))
        polls = [asyncio.create_task(coord.poll(p, 0, IDLE, 10)) for p in ("p0", "p1")]
        drains.state = {"n1": int((time.time() + 30) * 1000)}
        saver, backup = [(await p).order for p in polls]
        assert not saver.saves[0].is_backup and backup.saves[0].backup_for == 0
        turn = asyncio.create_task(coord.save_turn(SaveTurn("p1", 0, "g/0"), 10))
        await until(lambda: (0, "g/0") in coord.backups.events, 5, "the backup's turn held")
        assert not turn.done(), "the backup waits for the saver's word"
        xid = Reason(FAULTY, "xid_79", "XID 79: GPU has fallen off the bus")
        health = PollState(9, HealthReport(FAULTY, (xid,), "scripted"))
        await coord.poll("p0", 0, health, 0.1)
        answer = await turn
        faulty = report(0, [save("p0", 9)]) if faulty_lands == "first" else None
        await coord.report_teardown("p1", report(0, [save("p1", 9)]))
        await coord.report_teardown("p0", faulty or report(0, [save("p0", 9)]))
        return answer, await coord.wait_outcome(0, 15)

    answer, outcome = run(scenario())
    assert answer.accepted and answer.save and "FAULTY after the plan" in answer.why, answer
    assert [f["shard"] for f in outcome.fallbacks] == ["g/0"]
    assert [n["source"] for n in outcome.notices] == ["drain", "health"]
    if faulty_lands == "first":
        assert outcome.result == "committed" and outcome.committed["step"] == 9
        path = os.path.join(outcome.committed["path"], shard_file_name("g/0"))
        loaded = load_state_dict(path)
        assert loaded["by"] == "p1", "the backup's save is the one committed"
    else:
        assert outcome.result == "abandoned", outcome.reason
        assert "is not the save kept" in outcome.reason
        assert latest_committed(config.checkpoint_dir) is None


def test_a_group_with_a_rank_never_registered_commits_nothing(config):
    """The review's defect: world size 2, only rank 0 registered; an eviction committed step
    28 with one shard, and the restarted rank 1 found nothing to load."""

    async def scenario():
        coord, *_ = make(config)
        assert (await register(coord, ranks=(RankSpec("g", 0, 2, "0", True),))).accepted
        status = await coord.status()
        assert status["incomplete_groups"] == {"g": "1 of 2 ranks registered (missing: 1)"}
        poll = asyncio.create_task(coord.poll("p0", 0, IDLE, 10))
        await asyncio.sleep(0)
        assert (await coord.notify({"node_id": "n0", "reason": "test"})).accepted
        answer = await poll
        assert answer.order.saves == ()  # nobody is told to save
        await coord.report_teardown("p0", saved_report(config.checkpoint_dir, 0, 28))
        return await coord.wait_outcome(None, 10)

    outcome = run(scenario())
    assert outcome.result == "abandoned"
    assert "group g: 1 of 2 ranks registered (missing: 1)" in outcome.reason
    assert outcome.plan["incomplete"] == {"g": "1 of 2 ranks registered (missing: 1)"}
    assert latest_committed(config.checkpoint_dir) is None


def test_a_second_group_under_another_name_is_left_out_and_said(config):
    """graceful_setup called again under another name on one rank only: that group is not in
    the checkpoint; the complete one is, and the outcome says which was left out."""

    async def scenario():
        coord, *_ = make(config)
        ranks = (RankSpec("g", 0, 1, "0", True), RankSpec("h", 0, 2, "0", True))
        assert (await register(coord, ranks=ranks)).accepted
        poll = asyncio.create_task(coord.poll("p0", 0, IDLE, 10))
        await asyncio.sleep(0)
        assert (await coord.notify({"node_id": "n0", "reason": "test"})).accepted
        answer = await poll
        assert [s.shard_key for s in answer.order.saves] == ["g/0"]
        await coord.report_teardown("p0", saved_report(config.checkpoint_dir, 0, 28))
        return await coord.wait_outcome(None, 10)

    outcome = run(scenario())
    assert outcome.result == "committed"
    assert "group h not in the checkpoint: 1 of 2 ranks registered" in outcome.reason
    assert sorted(latest_committed(config.checkpoint_dir).shards) == ["g/0"]


def test_a_rank_beyond_its_world_size_is_refused_at_registration(config):
    async def scenario():
        coord, *_ = make(config)
        return await register(coord, ranks=(RankSpec("g", 2, 2, "0", True),))

    answer = run(scenario())
    assert not answer.accepted and "rank 2 is not below world_size 2" in answer.reason


def test_an_actor_id_that_is_not_rays_is_refused_at_registration(config):
    """The coordinator looks every registered actor up in the GCS actor table; an id that is not
    one (a framework passing its own name) is refused with what is allowed, not watched."""

    async def scenario():
        coord, *_ = make(config)
        bad = await register(coord, actor_id="trainer-0")
        good = await register(coord, pid="p1", actor_id=A0)
        return coord, bad, good

    coord, bad, good = run(scenario())
    assert not bad.accepted and "actor_id 'trainer-0' is not a Ray actor id" in bad.reason
    assert "32 hexadecimal characters" in bad.reason
    assert good.accepted and coord.machine.watched_actors() == {A0}


def test_rejected_notices_are_kept_small_whatever_they_were(config):
    """Review defect 6: ten rejected 20 MB notices took the coordinator from 127 to 968 MB,
    made status() a 400 MB answer and echoed each 20 MB value back in the reason."""
    huge = "n" * 20_000_000

    async def scenario():
        coord, *_ = make(config)
        await register(coord)
        replies = [await coord.notify({"node_id": huge, "reason": "x"}) for _ in range(5)]
        replies += [await coord.notify({"rank": [huge, 0], "reason": "x"}) for _ in range(3)]
        replies.append(await coord.notify({"rank": ["g", 1 << 40], "reason": "x"}))
        replies.append(await coord.notify({huge: 1, "reason": "x", "node_id": "n0"}))
        return coord, replies, await coord.status()

    coord, replies, status = run(scenario())
    assert not any(r.accepted for r in replies)
    assert all(len(r.reason) <= 500 for r in replies), [len(r.reason) for r in replies]
    assert "node_id 'nnnnn" in replies[0].reason and "at most 200 characters" in replies[0].reason
    assert "the rank from 0 to 16777215" in replies[8].reason
    assert len(pickle.dumps(coord.machine.cycle.rejected)) < 50_000
    assert len(pickle.dumps(status)) < 50_000
    assert coord.machine.cycle.notices == []
