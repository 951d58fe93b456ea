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
from tests.helpers import free_port, kill_actors, report_for, wait_for, worker_exit

WORLD = 3


def start_group(cls, exit_recorder, config, options=None, hook=False, **setup_kw):
    """WORLD ranks of ``cls``; ranks 0..WORLD-2 enter ``train`` and block on the last one."""
    port = free_port()
    opts = {"num_cpus": 0, "runtime_env": exit_recorder.runtime_env(hook=hook)}
    opts.update(options or {})
    ranks = [cls.options(**opts).remote() for _ in range(WORLD)]
    statuses = ray.get(
        [r.setup.remote(i, WORLD, "127.0.0.1", port, config, **setup_kw) for i, r in enumerate(ranks)],
        timeout=120,
    )
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    return ranks, pids, statuses


@pytest.fixture
def config(tmp_path):
    return GracefulConfig(report_dir=str(tmp_path / "reports"), teardown_timeout_s=10.0,
                          save_budget_s=4.0)


def test_blocked_rank_exits_zero_fast_with_report(ray_cluster, exit_recorder, config):
    Actor = ray.remote(actors.GracefulTrainer)
    ranks, pids, statuses = start_group(Actor, exit_recorder, config)
    assert "SIGTERM listener: installed" in statuses[0], statuses[0]
    training = [r.train.remote(1000) for r in ranks[:-1]]  # the last rank never joins
    time.sleep(1.0)  # let ranks 0 and 1 enter the all-reduce
    ready, _ = ray.wait(training, timeout=0)
    assert not ready, "the all-reduce should be blocked on the absent rank"

    sent = time.monotonic()
    os.kill(pids[0], signal.SIGTERM)
    code = exit_recorder.wait(pids[0], timeout=10)
    elapsed = time.monotonic() - sent
    assert code == 0, f"exit status {code}"
    assert elapsed < 2.0, f"took {elapsed:.2f}s to exit"

    report = wait_for(lambda: report_for(config.report_dir, pids[0]), 5, "the report JSON")
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["stop", "release_peers", "drain_device", "save",
                           "destroy_process_group", "exit"]
    assert steps["release_peers"]["status"] == "ran", steps["release_peers"]
    assert "gloo connections" in steps["release_peers"]["detail"]
    assert steps["drain_device"]["status"] == "skipped"
    assert report["exit_path"] == "ray_intended"

    exit_type, detail = wait_for(lambda: worker_exit(pids[0]), 10, "the GCS worker record")
    assert exit_type == "INTENDED_SYSTEM_EXIT", (exit_type, detail)
    kill_actors(*ranks)
