"""A gloo group of ``GracefulTrainer`` ranks on named nodes, for the memory tier's tests.

Placement names a node per rank: "head", "a" or "b" (the ``nodes`` fixture's raylets).
"""

from __future__ import annotations

import time

import ray

from ray_graceful.ray_adapter import drain_node
from tests import actors
from tests.helpers import free_port, wait_in_collective


def place(actor_class, placement, exit_recorder):
    """One actor of ``actor_class`` per entry of ``placement`` (a node name), exits recorded."""
    actor = ray.remote(actor_class)
    return [
        actor.options(
            num_cpus=0,
            resources={"head": 1} if n == "head" else {f"node_{n}": 1},
            runtime_env=exit_recorder.runtime_env(),
        ).remote()
        for n in placement
    ]


def start_group(config, exit_recorder, placement, shards, ballast_mb=0, save_seconds=0.0):
    port = free_port()
    ranks = place(actors.GracefulTrainer, placement, exit_recorder)
    ray.get(
        [
            r.setup.remote(
                i,
                len(ranks),
                "127.0.0.1",
                port,
                config,
                shard=shards[i],
                ballast_mb=ballast_mb,
                save_seconds=save_seconds,
            )
            for i, r in enumerate(ranks)
        ],
        timeout=120,
    )
    return ranks, ray.get([r.pid.remote() for r in ranks], timeout=30)


def train_then_block(ranks, steps=3):
    """Train ``steps`` steps; return rank 0's weights; leave all but the last rank blocked."""
    assert ray.get([r.train.remote(steps) for r in ranks], timeout=60) == [steps] * len(ranks)
    weights = ray.get(ranks[0].weights_sum.remote(), timeout=30)
    pids = ray.get([r.pid.remote() for r in ranks[:-1]], timeout=30)
    [r.train.remote(1000) for r in ranks[:-1]]  # blocked on the idle last rank
    wait_in_collective(pids)
    return weights


def drain_b_and_conclude(nodes, coordinator, exit_recorder, pids):
    """Drain node b (12 s): every rank must exit 0 and the cycle commit; its outcome."""
    drain_node(nodes["b"], time.time() + 12)
    codes = {pid: exit_recorder.wait(pid, 20) for pid in pids}
    assert set(codes.values()) == {0}, codes
    outcome = coordinator.wait_outcome(timeout=30, cycle=0)
    assert outcome.result == "committed", outcome.summary()
    return outcome
