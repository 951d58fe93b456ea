"""Ray Train V2: a real TorchTrainer (two CPU workers, gloo DDP) with the callback.

A node is drained mid-run: the ranks agree to stop, the chosen replica's emergency checkpoint is
reported to Ray Train, the run restarts and resumes from it without losing a step.
"""

from __future__ import annotations

import threading
import time

import pytest
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from benchmarks.train_job import train_func
from ray_graceful import GracefulConfig
from ray_graceful.ray_adapter import available_resources_per_node, drain_node
from ray_graceful.train import GracefulTrainCallback, resume_step


@pytest.fixture
def three_nodes(ray_cluster):
    added = [ray_cluster.add_node(num_cpus=2, resources={"train_slot": 1}) for _ in range(3)]
    ray_cluster.wait_for_nodes()
    yield added
    for node in added:
        ray_cluster.remove_node(node)


def _progress(path):
    try:
        with open(path) as f:
            return [line.split()[:2] for line in f]  # rank, step (then a timestamp)
    except FileNotFoundError:
        return []


@pytest.mark.timeout(400)
def test_drain_mid_run_resumes_from_the_emergency_checkpoint(three_nodes, tmp_path):
    config = GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        train_shards="replicated",
        expected_save_s=1.0,
    )
    progress, attempts = str(tmp_path / "progress"), str(tmp_path / "attempts")
    callback = GracefulTrainCallback(config)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "total": 20,
            "step_s": 0.3,
            "every": 5,
            "progress": progress,
            "attempt_file": attempts,
        },
        scaling_config=ScalingConfig(
            num_workers=2, resources_per_worker={"train_slot": 1, "CPU": 0}
        ),
        run_config=RunConfig(
            storage_path=str(tmp_path / "storage"),
            name="graceful",
            callbacks=[callback],
            failure_config=FailureConfig(max_failures=2),
        ),
    )
    box: dict = {}
    fit = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    fit.start()
    deadline = time.monotonic() + 180
    while len(_progress(progress)) < 14:  # both ranks past step 7: after the step-5 checkpoint
        assert time.monotonic() < deadline and fit.is_alive(), "the run did not get going"
        time.sleep(0.1)
    workers_node = _a_worker_node(three_nodes)
    drained_at_step = max(int(step) for _rank, step in _progress(progress))
    drain_node(workers_node, time.time() + 20)
    fit.join(240)
    result = box["result"]
    assert result.error is None, result.error

    with open(attempts) as f:
        starts = [line.split() for line in f]
    assert [s[2] for s in starts[:2]] == ["0", "0"]
    resumed = {int(s[2]) for s in starts[2:]}
    assert len(resumed) == 1, starts
    resumed_at = resumed.pop()
    assert resumed_at >= drained_at_step, "resumed from the emergency checkpoint, not step 5"
    emergency = [c for c, m in result.best_checkpoints if m.get("ray_graceful_emergency")]
    assert len(emergency) == 1
    with emergency[0].as_directory() as d:
        assert resume_step(d) == resumed_at
    # No step was lost and none ran twice: each rank executed every step exactly once.
    for rank in ("0", "1"):
        steps = sorted(int(s) for r, s in _progress(progress) if r == rank)
        assert steps == list(range(1, 21)), (rank, steps)


def _a_worker_node(nodes) -> str:
    """The id of an added node that runs one of the Train workers."""
    for node in nodes:
        resources = available_resources_per_node().get(node.node_id, {})
        if resources.get("train_slot", 0) == 0:  # its slot is taken
            return node.node_id
    raise AssertionError("no Train worker found on the added nodes")
