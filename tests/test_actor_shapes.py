"""Every actor kind of RAY_FACTS' table, and SkyRL-, OpenRLHF- and verl-shaped workers.

For each: ranks blocked in a gloo all-reduce, SIGTERM to one, and that rank exits with status 0
within 2 s, leaves its report, and Ray records an intended exit. Adopting the mixin must not
change which thread any method runs on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class Shape:
    name: str
    make: Callable[[int, int, dict, dict], Any]  # (rank, port, options, env) -> handle
    setup: Callable[[Any, int, int, GracefulConfig], Any]
    train: Callable[[Any], Any]
    hook: bool = False
    listener_from: str = "graceful_setup on the main thread"


def _trainer(cls):
    def make(rank, port, options, env):
        return ray.remote(cls).options(**options).remote()

    return make


def _trainer_setup(actor, rank, port, config):
    return actor.setup.remote(rank, WORLD, "127.0.0.1", port, config)


SHAPES = [
    Shape(
        "plain sync",
        _trainer(actors.GracefulTrainer),
        _trainer_setup,
        lambda a: a.train.remote(1000),
    ),
    Shape(
        "concurrency groups",
        lambda r, p, o, e: (
            ray.remote(concurrency_groups={"io": 2})(actors.GracefulTrainer)
            .options(**o)
            .remote(install_in_init=True)
        ),
        _trainer_setup,
        lambda a: a.train.remote(1000),
        listener_from="install_signal_handling",
    ),
    Shape(
        "threaded",
        lambda r, p, o, e: (
            ray.remote(max_concurrency=4)(actors.GracefulTrainer)
            .options(**o)
            .remote(install_in_init=True)
        ),
        _trainer_setup,
        lambda a: a.train.remote(1000),
        listener_from="install_signal_handling",
    ),
    Shape(
        "async with the setup hook",
        _trainer(actors.AsyncGracefulTrainer),
        _trainer_setup,
        lambda a: a.train.remote(1000),
        hook=True,
        listener_from="the job's setup hook",
    ),
    Shape(
        "SkyRL DistributedTorchRayActor (async)",
        lambda r, p, o, e: (
            ray.remote(actors.PolicyWorker).options(**o).remote(WORLD, r, "127.0.0.1", p)
        ),
        lambda a, r, p, c: a.init_worker_process_group.remote(c),
        lambda a: a.train_batch.remote(1000),
        hook=True,
        listener_from="the job's setup hook",
    ),
    Shape(
        "OpenRLHF BaseDistributedActor (sync, decorated subclass)",
        lambda r, p, o, e: actors.ActorModelRayActor.options(**o).remote(WORLD, r, "127.0.0.1", p),
        lambda a, r, p, c: a.init_model_from_pretrained.remote(c),
        lambda a: a.fit.remote(1000),
    ),
    Shape(
        "verl Worker (async, env-driven rank)",
        lambda r, p, o, e: ray.remote(actors.ActorRolloutRefWorker).options(**o).remote(),
        lambda a, r, p, c: a.init_model.remote(c),
        lambda a: a.update_actor.remote(1000),
        hook=True,
        listener_from="the job's setup hook",
    ),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_sigterm_in_collective(shape, ray_cluster, exit_recorder, tmp_path):
    config = GracefulConfig(report_dir=str(tmp_path), teardown_timeout_s=10.0, save_budget_s=4.0)
    port = free_port()
    ranks = []
    for rank in range(WORLD):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        options = {"num_cpus": 0, "runtime_env": exit_recorder.runtime_env(shape.hook, env)}
        ranks.append(shape.make(rank, port, options, env))
    try:
        statuses = ray.get(
            [shape.setup(a, i, port, config) for i, a in enumerate(ranks)], timeout=120
        )
        assert f"SIGTERM listener: installed ({shape.listener_from}" in statuses[0], statuses[0]
        pids = ray.get([a.pid.remote() for a in ranks], timeout=30)
        training = [shape.train(a) for a in ranks[:-1]]  # the last rank never joins
        wait_in_collective(pids[:-1])
        assert not ray.wait(training, timeout=0)[0], "the all-reduce should be blocked"

        sent = time.monotonic()
        os.kill(pids[0], signal.SIGTERM)
        code = exit_recorder.wait(pids[0], timeout=10)
        elapsed = time.monotonic() - sent
        assert code == 0, f"exit status {code}"
        assert elapsed < 2.0, f"{elapsed:.2f}s to exit"
        report = wait_for(lambda: report_for(str(tmp_path), pids[0]), 5, "the report")
        assert report["exit_path"] == "ray_intended", report
        assert report["ranks"][0]["rank"] == 0
        exit_type, detail = wait_for(lambda: worker_exit(pids[0]), 10, "the GCS record")
        assert exit_type == "INTENDED_SYSTEM_EXIT", (exit_type, detail)
    finally:
        kill_actors(*ranks)


THREAD_MODEL = [
    ("plain sync", {}, actors.Trainer, actors.GracefulTrainer, False),
    (
        "concurrency groups",
        {"concurrency_groups": {"io": 2}},
        actors.Trainer,
        actors.GracefulTrainer,
        False,
    ),
    ("threaded", {"max_concurrency": 4}, actors.Trainer, actors.GracefulTrainer, False),
    ("async", {}, actors.AsyncTrainer, actors.AsyncGracefulTrainer, True),
]


@pytest.mark.parametrize(
    "kind,ray_kw,before,after,hook", THREAD_MODEL, ids=[t[0] for t in THREAD_MODEL]
)
def test_mixin_keeps_thread_model(
    kind, ray_kw, before, after, hook, ray_cluster, exit_recorder, tmp_path
):
    """The same class with and without the mixin runs every method on the same kind of thread."""
    config = GracefulConfig(report_dir=str(tmp_path))
    plain = ray.remote(num_cpus=0, **ray_kw)(before).remote()
    adopted = (
        ray.remote(num_cpus=0, **ray_kw)(after)
        .options(runtime_env=exit_recorder.runtime_env(hook))
        .remote()
    )
    try:
        expected = ray.get(plain.where.remote(), timeout=60)
        assert ray.get(adopted.where.remote(), timeout=60)["main"] == expected["main"]
        ray.get(adopted.setup.remote(0, 1, "127.0.0.1", free_port(), config), timeout=60)
        after_setup = ray.get(adopted.where.remote(), timeout=30)
        assert after_setup["main"] == expected["main"], (kind, expected, after_setup)
    finally:
        kill_actors(plain, adopted)
