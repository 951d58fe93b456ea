"""Ray Train's warm path on real hosts: a worker's host lost without a word.

A ``TorchTrainer`` (``GracefulTorchConfig``, the callback, the host watch on by default) runs
three gloo workers on three hosts, a fourth host free. Rank 1's host crashes (every process
killed at once). The host watch declares it lost, the plan commits the step from the survivors,
and ranks 0 and 2 park at that step in their processes (``step_guard`` ends the step their
all-reduce failed in). Train then replaces rank 1 alone: its new worker joins the survivors'
group at the committed step. No step is lost or run twice.

Times are printed, not asserted (docs/reliability.md keeps them): the host watch's verdict
comes within a second, but Train places the new worker in rank 1's placement-group bundle,
which Ray moves to the free host only once it declared the crashed host dead (12-15 s).
"""

from __future__ import annotations

import time

import pytest

from benchmarks.hosts import HostCluster
from ray_graceful import Coordinator
from tests.test_train_warm import (
    _config,
    _each_rank_ran_every_step_once,
    _first_pids_past_step_5,
    _lines,
    _start,
    needs_replica_groups,
)

pytestmark = pytest.mark.timeout(300)


@needs_replica_groups
def test_a_workers_host_crashes_and_train_replaces_it_alone(hosts: HostCluster, tmp_path):
    added = [hosts.add_host(num_cpus=2, resources={"train_slot": 1}) for _ in range(4)]
    try:
        config = _config(tmp_path, memory_replicas=0)
        fit, box, files = _start(
            tmp_path, config, total=40, worker_env={"GLOO_SOCKET_IFNAME": "eth0"}
        )
        first = _first_pids_past_step_5(files, fit)
        nodes = {int(a[0]): a[5] for a in _lines(files["attempts"])}
        victim = next(h for h in added if str(h.node_id()) == nodes[1])
        coordinator = Coordinator.connect(config)
        crashed_at = time.time()
        hosts.crash(victim)
        outcome = coordinator.wait_outcome(timeout=60, cycle=0)
        noticed = time.time() - crashed_at
        fit.join(240)
        assert not fit.is_alive(), "the run did not finish"
        assert box["result"].error is None, box["result"].error

        assert outcome is not None and outcome.result == "committed", outcome
        assert {n["source"] for n in outcome.notices} == {"host_lost"}, outcome.notices
        attempts = _lines(files["attempts"])
        assert [int(a[0]) for a in attempts[3:]] == [1], "Train replaced rank 1 alone"
        again = attempts[3]
        assert int(again[2]) >= 5, "the new worker joined at the committed step, not from 0"
        progress = _lines(files["progress"])
        for rank in (0, 2):
            assert {int(p[3]) for p in progress if int(p[0]) == rank} == {first[rank]}
        _each_rank_ran_every_step_once(files, 40)
        began = [float(b[2]) for b in _lines(files["began"]) if int(b[1]) == int(again[4])]
        trained = min(float(p[2]) for p in progress if int(p[3]) == int(again[4]))
        print(
            f"host crash under Train: outcome {noticed:.2f} s (host_lost), new worker began "
            f"{began[0] - crashed_at:.2f} s, joined {float(again[3]) - crashed_at:.2f} s, "
            f"training again {trained - crashed_at:.2f} s after the crash"
        )
    finally:
        for host in added:
            hosts.remove_host(host)
