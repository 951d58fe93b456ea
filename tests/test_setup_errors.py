"""Calls made in the wrong place get an error that says what to do instead."""

from __future__ import annotations

import pytest
import ray

from ray_graceful import GracefulConfig
from tests import actors
from tests.helpers import free_port, kill_actors


def _error_of(ref) -> str:
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(ref, timeout=60)
    return str(info.value)


def test_setup_before_init_process_group(ray_cluster, tmp_path):
    actor = ray.remote(actors.GracefulTrainer).options(num_cpus=0).remote()
    message = _error_of(actor.setup_before_init.remote(GracefulConfig(report_dir=str(tmp_path))))
    assert "SetupError" in message
    assert "before torch.distributed.init_process_group()" in message
    kill_actors(actor)


def test_threaded_actor_without_listener_warns_or_fails_strict(ray_cluster, tmp_path):
    """Off the main thread with no __init__ install and no hook: say so, name the fix."""
    Threaded = ray.remote(max_concurrency=2)(actors.GracefulTrainer)
    lax = Threaded.options(num_cpus=0).remote()
    status = ray.get(
        lax.setup.remote(0, 1, "127.0.0.1", free_port(), GracefulConfig(report_dir=str(tmp_path))),
        timeout=60,
    )
    assert "SIGTERM listener: not installed" in status
    assert "install_signal_handling()" in status and "ray_graceful.hooks.setup" in status

    strict = Threaded.options(num_cpus=0).remote()
    message = _error_of(
        strict.setup.remote(
            0, 1, "127.0.0.1", free_port(), GracefulConfig(report_dir=str(tmp_path), strict=True)
        )
    )
    assert "SIGTERM listener not installed" in message
    kill_actors(lax, strict)


def test_attribute_shadowing_should_stop_is_refused(ray_cluster, tmp_path):
    actor = ray.remote(actors.ShadowingTrainer).options(num_cpus=0).remote()
    message = _error_of(
        actor.setup.remote(0, 1, "127.0.0.1", free_port(), GracefulConfig(report_dir=str(tmp_path)))
    )
    assert "ShadowingTrainer.should_stop is False, not a method" in message
    kill_actors(actor)


def test_rank_mismatch_is_refused(ray_cluster, tmp_path):
    """A rank passed in that disagrees with torch.distributed is an error, not a guess."""
    actor = (
        ray.remote(actors.PolicyWorker).options(num_cpus=0).remote(1, 0, "127.0.0.1", free_port())
    )
    ray.get(
        actor.init_worker_process_group.remote(GracefulConfig(report_dir=str(tmp_path))), timeout=60
    )
    message = _error_of(actor.register_as.remote(3))
    assert "rank=3 was passed, but torch.distributed says this process is rank 0" in message
    kill_actors(actor)


def test_a_checkpoint_dir_that_cannot_take_checkpoints_is_refused_at_setup(ray_cluster, tmp_path):
    """A regular file as checkpoint_dir passed setup and failed every save at the eviction."""
    not_a_dir = tmp_path / "ckpt"
    not_a_dir.write_text("a file")
    config = GracefulConfig(report_dir=str(tmp_path), checkpoint_dir=str(not_a_dir))
    actor = ray.remote(actors.GracefulTrainer).options(num_cpus=0).remote()
    message = _error_of(actor.setup.remote(0, 1, "127.0.0.1", free_port(), config))
    assert "SetupError" in message and "graceful_setup: checkpoint_dir" in message, message
    assert "it exists and is not a directory" in message
    kill_actors(actor)
