"""A rank blocked in a gloo all-reduce gets SIGTERM: it leaves cleanly, fast, and says so.

Real Ray actors, real gloo groups, real signals; the exit status is the one the kernel
reported for the worker process (see ``exit_recorder`` in conftest.py).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from ray_graceful import GracefulConfig
from tests import actors
from tests.helpers import (
    free_port,
    kill_actors,
    report_for,
    wait_for,
    wait_in_collective,
    worker_exit,
)

WORLD = 3


def start_group(cls, exit_recorder, config, options=None, hook=False, **setup_kw):
    """WORLD ranks of ``cls``; ranks 0..WORLD-2 enter ``train`` and block on the last one."""
    port = free_port()
    opts = {"num_cpus": 0, "runtime_env": exit_recorder.runtime_env(hook=hook)}
    opts.update(options or {})
    ranks = [cls.options(**opts).remote() for _ in range(WORLD)]
    statuses = ray.get(
        [
            r.setup.remote(i, WORLD, "127.0.0.1", port, config, **setup_kw)
            for i, r in enumerate(ranks)
        ],
        timeout=120,
    )
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    return ranks, pids, statuses


@pytest.fixture
def config(tmp_path):
    return GracefulConfig(
        report_dir=str(tmp_path / "reports"), teardown_timeout_s=10.0, save_budget_s=4.0
    )


def test_blocked_rank_exits_zero_fast_with_report(ray_cluster, exit_recorder, config):
    Actor = ray.remote(actors.GracefulTrainer)
    ranks, pids, statuses = start_group(Actor, exit_recorder, config)
    assert "SIGTERM listener: installed" in statuses[0], statuses[0]
    training = [r.train.remote(1000) for r in ranks[:-1]]  # the last rank never joins
    wait_in_collective(pids[:-1])  # ranks 0 and 1 are in the all-reduce
    ready, _ = ray.wait(training, timeout=0)
    assert not ready, "the all-reduce should be blocked on the absent rank"

    sent = time.monotonic()
    os.kill(pids[0], signal.SIGTERM)
    code = exit_recorder.wait(pids[0], timeout=10)
    elapsed = time.monotonic() - sent
    assert code == 0, f"exit status {code}"
    assert elapsed < 2.0, f"took {elapsed:.2f}s to exit"

    report = wait_for(lambda: report_for(config.report_dir, pids[0]), 5, "the report JSON")
    steps = {s["name"]: s for s in report["phases"]}
    assert list(steps) == [
        "stop",
        "quiesce",
        "release_peers",  # inside a collective: abort first, then drain the device
        "drain_device",
        "save",
        "destroy_process_group",
        "exit",
    ]
    assert steps["release_peers"]["status"] == "ran", steps["release_peers"]
    assert "gloo connections" in steps["release_peers"]["detail"]
    assert steps["drain_device"]["status"] == "skipped"
    assert report["exit_path"] == "ray_intended"

    exit_type, detail = wait_for(lambda: worker_exit(pids[0]), 10, "the GCS worker record")
    assert exit_type == "INTENDED_SYSTEM_EXIT", (exit_type, detail)
    kill_actors(*ranks)


def test_previous_handler_still_runs(ray_cluster, exit_recorder, config, tmp_path):
    """A SIGTERM handler the worker had before adopting the mixin is chained, on its thread."""
    marker = tmp_path / "user-handler"
    Actor = ray.remote(actors.GracefulTrainer)
    port = free_port()
    ranks = [
        Actor.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote(
            marker=str(marker) if i == 0 else None
        )
        for i in range(2)
    ]
    ray.get(
        [r.setup.remote(i, 2, "127.0.0.1", port, config) for i, r in enumerate(ranks)], timeout=120
    )
    pid = ray.get(ranks[0].pid.remote())
    ranks[0].train.remote(1000)  # rank 1 never joins: rank 0 blocks in the all-reduce
    wait_in_collective([pid])
    os.kill(pid, signal.SIGTERM)
    assert exit_recorder.wait(pid, timeout=10) == 0
    assert marker.read_text() == f"user handler ran in {pid}\n"
    kill_actors(*ranks)


def test_second_sigterm_exits_at_once(ray_cluster, exit_recorder, tmp_path):
    """A teardown stuck in a long save is cut short by a second SIGTERM."""
    config = GracefulConfig(
        report_dir=str(tmp_path / "r"),
        checkpoint_dir=str(tmp_path / "c"),
        teardown_timeout_s=60.0,
        save_budget_s=50.0,
        exit_code=3,
    )
    Actor = ray.remote(actors.GracefulTrainer)
    actor = Actor.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
    started = tmp_path / "save-started"
    ray.get(
        actor.setup.remote(0, 1, "127.0.0.1", free_port(), config, hang_save=str(started)),
        timeout=120,
    )
    ray.get(actor.train.remote(2), timeout=30)  # a step boundary is known: the save starts
    pid = ray.get(actor.pid.remote())
    os.kill(pid, signal.SIGTERM)
    wait_for(started.exists, 10, "the save to start")  # it now hangs, with a 50 s budget
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert exit_recorder.wait(pid, timeout=10) == 3
    assert time.monotonic() - sent < 1.0
    report = wait_for(lambda: report_for(config.report_dir, pid), 5, "the report")
    assert report["exit_path"] == "second-signal"
    assert report["phases"][-1]["name"] == "save" and report["phases"][-1]["status"] == "running"
    assert not list((tmp_path / "c").rglob("shard-*")), "an unfinished save must not land"


def test_hanging_save_cannot_pass_the_deadline(ray_cluster, exit_recorder, tmp_path):
    config = GracefulConfig(
        report_dir=str(tmp_path / "r"),
        checkpoint_dir=str(tmp_path / "c"),
        teardown_timeout_s=4.0,
        watchdog_margin_s=0.5,
        save_budget_s=3.0,
        destroy_timeout_s=0.5,
    )
    Actor = ray.remote(actors.GracefulTrainer)
    actor = Actor.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
    ray.get(
        actor.setup.remote(
            0, 1, "127.0.0.1", free_port(), config, hang_save=str(tmp_path / "started")
        ),
        timeout=120,
    )
    ray.get(actor.train.remote(2), timeout=30)
    pid = ray.get(actor.pid.remote())
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    code = exit_recorder.wait(pid, timeout=15)
    elapsed = time.monotonic() - sent
    assert code == 0
    assert elapsed < config.teardown_timeout_s, f"{elapsed:.2f}s"
    report = wait_for(lambda: report_for(config.report_dir, pid), 5, "the report")
    save = next(s for s in report["phases"] if s["name"] == "save")
    assert save["status"] == "failed" and "exceeded its budget" in save["detail"], save
    assert report["saved"] == []
    assert not list((tmp_path / "c").rglob("shard-*")), "an abandoned save must not land"


def test_rank_stuck_in_a_collective_after_release_exits_without_waiting(
    ray_cluster, exit_recorder, tmp_path
):
    """A collective the release cannot end (here: a group nobody registered) does not return,
    so waiting ``exit_grace_s`` for Ray's exit is pointless: the rank leaves at once, says so,
    and Ray records the exit as intended (its own kill of the actor), not as a worker crash."""
    config = GracefulConfig(report_dir=str(tmp_path / "r"), exit_grace_s=8.0)
    Actor = ray.remote(actors.GracefulTrainer)
    port, opts = free_port(), {"num_cpus": 0, "runtime_env": exit_recorder.runtime_env()}
    ranks = [Actor.options(**opts).remote() for _ in range(WORLD)]
    # Only rank 0 uses the plugin: peers that did would see it leave through the group's store
    # and leave too, which would end the collective this test needs to stay stuck.
    ray.get(
        [ranks[0].setup.remote(0, WORLD, "127.0.0.1", port, config)]
        + [r.init.remote(i, WORLD, "127.0.0.1", port) for i, r in enumerate(ranks) if i],
        timeout=120,
    )
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    ray.get([r.make_extra_group.remote() for r in ranks], timeout=60)
    blocked = [r.all_reduce_on_extra_group.remote() for r in ranks[:-1]]  # the last never joins
    wait_in_collective(pids[:-1])
    assert not ray.wait(blocked, timeout=0)[0]

    sent = time.monotonic()
    os.kill(pids[0], signal.SIGTERM)
    code = exit_recorder.wait(pids[0], timeout=15)
    elapsed = time.monotonic() - sent
    assert code == 1, "Ray's forced exit (QuickExit) ends the process with status 1"
    assert elapsed < config.exit_grace_s / 2, f"waited {elapsed:.2f}s for a task that cannot return"
    report = wait_for(lambda: report_for(config.report_dir, pids[0]), 5, "the report")
    exit_step = next(s for s in report["phases"] if s["name"] == "exit")
    assert report["exit_path"] == "ray_kill", report
    assert "still alive" in exit_step["detail"] and "all_reduce" in exit_step["detail"], exit_step
    assert "still in a collective" in exit_step["detail"], exit_step
    exit_type, detail = wait_for(lambda: worker_exit(pids[0]), 10, "the GCS worker record")
    assert exit_type == "INTENDED_SYSTEM_EXIT", (exit_type, detail)
    kill_actors(*ranks)


def test_forked_child_does_not_run_the_teardown(ray_cluster, exit_recorder, config):
    Actor = ray.remote(actors.GracefulTrainer)
    actor = Actor.options(num_cpus=0, runtime_env=exit_recorder.runtime_env()).remote()
    ray.get(actor.setup.remote(0, 1, "127.0.0.1", free_port(), config), timeout=120)
    pid = ray.get(actor.pid.remote())
    child = ray.get(actor.fork_sleeper.remote(), timeout=30)
    os.kill(child, signal.SIGTERM)
    status = ray.get(actor.reap_child.remote(), timeout=30)
    assert status is not None, "the child should have ended on SIGTERM as it would without us"
    assert ray.get(actor.alive.remote(), timeout=10), "the parent must not tear down"
    assert report_for(config.report_dir, pid) is None
    assert report_for(config.report_dir, child) is None
    kill_actors(actor)


@ray.remote(num_cpus=0)
def _core_worker_stopped_here() -> bool | None:
    from ray_graceful import ray_adapter

    check = ray_adapter.core_worker_stopped_check()
    return None if check is None else check()


def test_a_worker_can_tell_when_rays_core_worker_has_stopped(ray_cluster):
    """A teardown leaves the moment Ray's core worker is down, instead of waiting while Ray's
    destructor joins gRPC poll threads (up to 250 ms each exit, measured on Ray 2.60). That
    needs the core worker's io thread to be found on the installed Ray, and a running worker
    not to read as stopped; without it every exit takes the slow way again."""
    assert ray.get(_core_worker_stopped_here.remote(), timeout=60) is False


class _Event:
    """A CUDA event stand-in whose queue finishes after ``polls`` queries (never, for None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.recorded = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        assert self.recorded, "queried before it was recorded"
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls <= 0


def _torch_with(event: _Event):
    from types import SimpleNamespace

    return SimpleNamespace(cuda=SimpleNamespace(Event=lambda: event))


def test_a_device_queue_that_finishes_is_seen_without_a_synchronize():
    from ray_graceful.worker.device import device_queue_finished

    assert device_queue_finished(_torch_with(_Event(polls=3)), timeout=5.0)


def test_a_device_queue_that_never_finishes_is_given_up_at_its_bound():
    """A collective a departed peer never joins: the drain says so at its bound, not later."""
    from ray_graceful.worker.device import device_queue_finished

    started = time.monotonic()
    assert not device_queue_finished(_torch_with(_Event(polls=None)), timeout=0.2)
    assert time.monotonic() - started < 2.0
