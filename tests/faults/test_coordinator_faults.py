"""The coordinator's own loss: its process SIGKILLed (an OOM kill, a segfault) at four points.

Ray restarts it (``coordinator_max_restarts``); the ranks register with the new one on their
own, and a cycle the old one left open is concluded from the disk - committed only if every
shard was saved at one step, else abandoned with the reason. With no restart left, a rank that
gets SIGTERM releases its peers through the process group's store, and they leave too. Same
four gloo ranks (two shards, two replicas each) as ``test_faults.py``; same bookkeeping.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ray_graceful import latest_committed
from ray_graceful.coordinator import Coordinator
from ray_graceful.protocol import Result
from tests.faults.test_faults import (
    DEADLINE_S,
    checkpoint_state,
    fault_config,
    seed_committed,
    settle,
    start,
)
from tests.helpers import kill_actors, report_for, wait_for


@pytest.fixture
def config(tmp_path):
    return fault_config(tmp_path)


@pytest.fixture
def coordinator(ray_cluster, config):
    coord = Coordinator.start(config)
    yield coord
    coord.shutdown()


@pytest.fixture
def coordinator_with(ray_cluster):
    """Start a coordinator with the scenario's own config; each is shut down after the test."""
    started = []

    def start_one(config):
        started.append(Coordinator.start(config))
        return started[-1]

    yield start_one
    for coord in started:
        coord.shutdown()


def kill_coordinator(coordinator) -> int:
    """SIGKILL the coordinator's process (not ray.kill: Ray restarts it as after a crash)."""
    pid = coordinator.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def restarted_with_ranks(coordinator, old_pid: int, ranks: int = 4) -> bool:
    try:
        stats, status = coordinator.stats(timeout=3), coordinator.status(timeout=3)
    except Exception:
        return False  # still restarting
    return stats["pid"] != old_pid and status["restarted"] and len(status["ranks"]) == ranks


def shard_files(config) -> list[str]:
    root = config.checkpoint_dir
    return [
        name
        for base, _dirs, files in os.walk(root)
        for name in files
        if name.startswith("shard-") and "step-00000001" not in base
    ]


def record(fault_log, exit_recorder, name, config, outcome, pids, ranks, killed=()):
    """Every rank out by its deadline, and the checkpoint as the outcome says (or untouched)."""
    released, hangs = settle(exit_recorder, pids)
    state = checkpoint_state(outcome, config) if outcome is not None else "n/a"
    fault_log.record(name, len(pids), released, hangs, state, pids, killed)
    kill_actors(*ranks)
    assert hangs == 0, f"{hangs} rank(s) still alive past their deadline"
    return released


def test_killed_before_a_notice(rep, fault_log, config, coordinator, exit_recorder):
    """The ranks register again within seconds, and the next eviction is handled as ever."""
    ranks, pids = start(config, exit_recorder)
    old = kill_coordinator(coordinator)
    killed_at = time.monotonic()
    wait_for(lambda: restarted_with_ranks(coordinator, old), 30, "the ranks to register again")
    back_in = time.monotonic() - killed_at
    os.kill(pids[1], signal.SIGTERM)
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 10, cycle=0)
    assert outcome is not None and outcome.result == Result.COMMITTED, outcome
    record(
        fault_log, exit_recorder, "coordinator killed before a notice", config, outcome, pids, ranks
    )
    assert back_in < 10, f"the ranks took {back_in:.1f}s to register again"


def test_killed_while_gathering(rep, fault_log, coordinator_with, config, exit_recorder):
    """The SIGTERM reached the old coordinator only: the rank tells the new one, or leaves
    alone and its peers see it go; either way every rank is out and nothing torn is kept."""
    # A gathering window long enough to kill the coordinator inside it (the default is 0.2 s).
    coordinator = coordinator_with(config.replace(notice_gather_s=3.0))
    ranks, pids = start(config, exit_recorder)
    os.kill(pids[1], signal.SIGTERM)
    wait_for(lambda: coordinator.status()["phase"] == "gathering", 10, "the gathering")
    kill_coordinator(coordinator)
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 10, cycle=0)
    name = "coordinator killed while gathering"
    record(fault_log, exit_recorder, name, config, outcome, pids, ranks)


@pytest.mark.parametrize("watch", [False, True], ids=["direct", "through-agents"])
def test_a_sigterm_while_it_restarts_is_planned_by_the_new_one(
    rep, fault_log, coordinator_with, config, exit_recorder, watch
):
    """A SIGTERM that reaches a rank while Ray restarts the coordinator waits for the new one
    (for as long as going alone would still leave its own save): its control channel reports
    it again, and the new coordinator plans the cycle - a replica saves each shard, committed.
    Going alone at once, the cycle was abandoned (and unseen: nobody was left registered).
    Through the node agents (the host watch on), the agent may reach the new coordinator
    before the rank registered again: the report is refused for now only, and made again."""
    # The default 25 s of teardown: the wait may last until 25 - 1 - 2 - 6 = 16 s after the
    # signal, far more than a restart needs even on a loaded machine.
    config = config.replace(teardown_timeout_s=25.0, host_watch=watch)
    coordinator = coordinator_with(config)
    ranks, pids = start(config, exit_recorder)
    kill_coordinator(coordinator)
    os.kill(pids[1], signal.SIGTERM)
    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome is not None, "the restarted coordinator never heard of the SIGTERM"
    assert outcome.result == Result.COMMITTED, outcome.summary()
    assert [n["source"] for n in outcome.notices] == ["sigterm"], outcome.notices
    name = "SIGTERM while the coordinator restarts"
    record(fault_log, exit_recorder, name, config, outcome, pids, ranks)


def test_a_rank_killed_while_it_restarts_is_taken_as_lost(
    rep, fault_log, config, coordinator, exit_recorder
):
    """A rank that dies while no coordinator answers never registers again, no lost-rank watch
    knows its actor, and its peers stop watching their store once they are back: the restarted
    coordinator takes a rank still missing after its settling time as lost and orders the rest
    of its group out (abandoned: an incomplete group saves nothing)."""
    ranks, pids = start(config, exit_recorder)
    old = kill_coordinator(coordinator)
    os.kill(pids[1], signal.SIGKILL)  # before the new coordinator can know it
    wait_for(lambda: restarted_with_ranks(coordinator, old, ranks=3), 30, "the others back")
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 10, cycle=0)
    assert outcome is not None, "the restarted coordinator never noticed the missing rank"
    assert [(n["source"], n["rank"]) for n in outcome.notices] == [("lost", ["trainer", 1])]
    assert outcome.result == Result.ABANDONED and "missing: 1" in outcome.reason, outcome.reason
    name = "rank killed while the coordinator restarts"
    record(fault_log, exit_recorder, name, config, outcome, pids, ranks, killed=[pids[1]])


def test_killed_during_teardown(rep, fault_log, config, coordinator, exit_recorder, tmp_path):
    """Killed while the savers save: the new coordinator commits the cycle from the disk."""
    seed_committed(config)
    slow = {i: 2.0 for i in range(4)}
    ranks, pids = start(config, exit_recorder, save_seconds=slow)
    os.kill(pids[1], signal.SIGTERM)
    wait_for(lambda: coordinator.status()["plan_table"], 10, "the plan")
    kill_coordinator(coordinator)
    assert not shard_files(config), "the kill must land before the saves end"
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 20, cycle=0)
    assert outcome is not None, "the restarted coordinator concluded nothing"
    assert outcome.result == Result.COMMITTED, outcome.summary()
    assert "restarted" in outcome.reason
    record(
        fault_log, exit_recorder, "coordinator killed during teardown", config, outcome, pids, ranks
    )


def test_killed_between_last_save_and_commit(rep, fault_log, config, coordinator, exit_recorder):
    """Frozen before the reports land, killed once every shard is on disk: committed from it."""
    seed_committed(config)
    ranks, pids = start(config, exit_recorder, save_seconds={i: 1.0 for i in range(4)})
    os.kill(pids[1], signal.SIGTERM)
    wait_for(lambda: coordinator.status()["plan_table"], 10, "the plan")
    pid = coordinator.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)  # no report can land, no manifest be written
    try:
        wait_for(lambda: len(shard_files(config)) == 2, DEADLINE_S, "both shards on disk")
        assert latest_committed(config.checkpoint_dir).step == 1, "nothing new committed yet"
    finally:
        os.kill(pid, signal.SIGKILL)
    outcome = coordinator.wait_outcome(timeout=DEADLINE_S + 20, cycle=0)
    assert outcome is not None and outcome.result == Result.COMMITTED, outcome
    assert latest_committed(config.checkpoint_dir).step == outcome.committed["step"] > 1
    name = "coordinator killed between last save and commit"
    record(fault_log, exit_recorder, name, config, outcome, pids, ranks)


def test_gone_for_good_one_sigterm_releases_every_peer(
    rep, fault_log, ray_cluster, config, exit_recorder
):
    """The issue's run: no restart left, one rank SIGTERMed 6 s later - every peer leaves too."""
    coord = Coordinator.start(config.replace(coordinator_max_restarts=0))
    try:
        ranks, pids = start(config, exit_recorder)
        kill_coordinator(coord)
        time.sleep(2)  # the scenario: the ranks have seen the coordinator go before the SIGTERM
        os.kill(pids[1], signal.SIGTERM)
        name = "coordinator gone for good, SIGTERM to one rank"
        record(fault_log, exit_recorder, name, config, None, pids, ranks)
        for pid in pids[:1] + pids[2:]:
            report = wait_for(lambda p=pid: report_for(config.report_dir, p), 5, "a report")
            assert report["trigger"].startswith("released by a peer"), report["trigger"]
    finally:
        kill_actors(coord.handle)


def test_spares_waiting_ride_out_a_restart_and_are_pooled_again(
    rep, fault_log, coordinator, config, exit_recorder
):
    """Two spares wait; the coordinator's process is SIGKILLed and Ray restarts it. Neither
    spare leaves (a restarting coordinator is unavailable, not gone), each registers again
    when the new one does not know it, and both are listed and told when the job is over."""
    import ray

    from tests import actors

    worker = ray.remote(actors.SpareWorker).options(
        num_cpus=0, runtime_env=exit_recorder.runtime_env()
    )
    spares = [worker.remote() for _ in range(2)]
    pids = ray.get([s.pid.remote() for s in spares], timeout=60)
    waits = [s.wait.remote("spare", config) for s in spares]
    wait_for(lambda: len(coordinator.status()["spares"]) == 2, 30, "both spares to register")
    old_pid = kill_coordinator(coordinator)

    def pooled_again() -> bool:
        try:
            stats, status = coordinator.stats(timeout=3), coordinator.status(timeout=3)
        except Exception:
            return False  # still restarting
        return stats["pid"] != old_pid and sorted(s["pid"] for s in status["spares"]) == sorted(
            pids
        )

    wait_for(pooled_again, 40, "the restarted coordinator to list both spares again", every=0.2)
    ready, _ = ray.wait(waits, timeout=0)
    assert not ready, [ray.get(r) for r in ready]
    assert coordinator.job_finished(success=True).spares_told == 2
    words = ray.get(waits, timeout=30)
    assert [w["action"] for w in words] == ["exit", "exit"], words
    codes = [exit_recorder.wait(pid, 15) for pid in pids]
    fault_log.record(
        "spares waiting while the coordinator restarts",
        2,
        sum(c == 0 for c in codes),
        0,
        "n/a",
        pids,
    )
    assert codes == [0, 0], codes
