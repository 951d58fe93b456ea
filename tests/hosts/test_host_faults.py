"""The plugin on real hosts: a host lost without a word, with the ranks on it.

Four gloo ranks with the plugin (two shards, two replicas each): ranks 0 and 1 on host A, their
replicas 2 and 3 on host B, the coordinator on the head. Host A fails; the checkpoint must be
committed from host B's replicas, and host B's ranks released, with no notice from anyone.

This is today's detection - the coordinator's lost-rank watcher, which learns of the loss only
when Ray declares host A's actors dead - and the row a detector of the plugin's own must beat
(the issue on lost hosts). The time it took is printed, not asserted.
"""

from __future__ import annotations

import random
import time

import pytest
import ray

from ray_graceful import GracefulConfig, latest_committed
from ray_graceful.coordinator import Coordinator
from tests import actors
from tests.hosts_cluster import HostCluster

pytestmark = pytest.mark.timeout(180)
SHARDS = ["0", "1", "0", "1"]
ON = ["hostA", "hostA", "hostB", "hostB"]


def test_a_crashed_host_is_noticed_and_committed_from_the_replicas_on_the_other(
    hosts: HostCluster, tmp_path
):
    a = hosts.add_host(num_cpus=2, resources={"hostA": 1})
    b = hosts.add_host(num_cpus=2, resources={"hostB": 1})
    config = GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        teardown_timeout_s=60.0,  # past Ray's verdict on a crashed host (13-15 s here)
        save_budget_s=10.0,
    )
    coordinator = Coordinator.start(config)
    trainer = ray.remote(actors.GracefulTrainer)
    env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}}  # each host's own link
    ranks = [
        trainer.options(num_cpus=0, resources={on: 0.1}, runtime_env=env).remote() for on in ON
    ]
    try:
        port = random.randint(20000, 40000)  # on host A's own address: nothing else binds there
        setups = [
            r.setup.remote(i, 4, a.ip, port, config, shard=SHARDS[i]) for i, r in enumerate(ranks)
        ]
        ray.get(setups, timeout=120)
        assert ray.get([r.train.remote(3) for r in ranks], timeout=60) == [3] * 4
        training = [r.train.remote(10**6, 0.01) for r in ranks]
        assert not ray.wait(training, timeout=1.0)[0], "all four are training"
        started = time.monotonic()
        hosts.crash(a)
        outcome = coordinator.wait_outcome(timeout=90, cycle=0)
        noticed = time.monotonic() - started
        released, _ = ray.wait(training[2:], num_returns=2, timeout=30)
        print(f"host crash: outcome {noticed:.1f} s after the crash ({outcome and outcome.result})")
        assert outcome is not None, "no outcome: the loss of host A was never noticed"
        assert outcome.notices[0]["source"] == "lost", outcome.notices
        assert outcome.result == "committed", outcome.summary()
        latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert latest is not None and sorted(latest.shards) == ["trainer/0", "trainer/1"]
        assert len(released) == 2, "host B's ranks are out of their loop"
        assert b.pids(), "host B lives on"
    finally:
        for rank in ranks:
            ray.kill(rank)
        coordinator.shutdown()
