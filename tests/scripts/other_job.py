"""A second Ray job on the same cluster: its own coordinator, one rank on this node.

argv: ADDRESS WORKDIR. Prints "ready" once its rank is registered, then the outcome of its
first cycle as one JSON line (or {"outcome": null} after 60 s) and exits.
"""

from __future__ import annotations

import json
import os
import sys

import ray

address, workdir = sys.argv[1:3]
ray.init(address=address, logging_level="WARNING")

from ray_graceful import Coordinator, GracefulConfig  # noqa: E402
from ray_graceful.worker.process_groups import free_port  # noqa: E402
from tests import actors  # noqa: E402

config = GracefulConfig(
    report_dir=os.path.join(workdir, "reports"),
    checkpoint_dir=os.path.join(workdir, "ckpt"),
    teardown_timeout_s=10.0,
    save_budget_s=5.0,
    expected_save_s=1.0,
)
coordinator = Coordinator.start(config)
rank = ray.remote(actors.GracefulTrainer).options(num_cpus=0, resources={"head": 1}).remote()
ray.get(rank.setup.remote(0, 1, "127.0.0.1", free_port(), config), timeout=120)
ray.get(rank.train.remote(2), timeout=60)
print("ready", flush=True)
outcome = coordinator.wait_outcome(timeout=60, cycle=0)
print(json.dumps({"outcome": outcome.to_dict() if outcome else None}), flush=True)
coordinator.shutdown()
