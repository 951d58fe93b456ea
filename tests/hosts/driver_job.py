"""A job whose driver, and with it the coordinator, lives on one host of a ``HostCluster``.

``tests/hosts/test_coordinator_host.py`` starts this inside host A's namespace
(``HostCluster.start_process``) and then fails host A: the driver and the coordinator go with it.
The driver connects as any driver on that host would, starts the coordinator on its own node
(the default: next to the driver), and four ranks with the plugin on hosts B and C - ranks 0
and 1 on B, their replicas 2 and 3 on C - with ``host_watch=True``. Once all four train and
both hosts' agents beat, it writes what the test needs to ``ready``, and trains until it dies.

    python -m tests.hosts.driver_job HOST_IP TAG B_RESOURCE C_RESOURCE MASTER_IP READY_PATH
"""

from __future__ import annotations

import json
import os
import random
import sys

import ray

from benchmarks.host_loss import wait_watched
from ray_graceful import GracefulConfig
from ray_graceful.coordinator import Coordinator
from tests import actors

SHARDS = ["0", "1", "0", "1"]


def main(host_ip: str, tag: str, on_b: str, on_c: str, master_ip: str, ready: str) -> None:
    ray.init(_node_ip_address=host_ip, logging_level="WARNING", log_to_driver=False)
    config = GracefulConfig(
        checkpoint_dir=os.path.join(os.path.dirname(ready), "ckpt"),
        report_dir=os.path.join(os.path.dirname(ready), "reports"),
        health_probe="none",
        host_watch=True,
        coordinator_namespace=f"rg-{tag}",
    )
    coordinator = Coordinator.start(config)
    trainer = ray.remote(actors.GracefulTrainer)
    env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}}  # each host's own link
    ranks = [
        trainer.options(num_cpus=0, resources={r: 0.1}, runtime_env=env).remote()
        for r in (on_b, on_b, on_c, on_c)
    ]
    port = random.randint(20000, 40000)  # on host B's own address: nothing else binds there
    setups = [
        r.setup.remote(i, 4, master_ip, port, config, shard=SHARDS[i]) for i, r in enumerate(ranks)
    ]
    ray.get(setups, timeout=120)
    ray.get([r.train.remote(3) for r in ranks], timeout=60)
    wait_watched(coordinator, 2)
    pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
    training = [r.train.remote(10**6, 0.01) for r in ranks]
    where = ray.get(coordinator.handle.stats.remote(), timeout=30)
    with open(ready + ".tmp", "w") as f:
        json.dump({"pids": pids, "coordinator_node": where["node_id"]}, f)
    os.replace(ready + ".tmp", ready)
    ray.get(training)


if __name__ == "__main__":
    main(*sys.argv[1:])
