"""Ray Train (V2): one callback, and a few calls in the training function.

The cold path - Train restarts the whole worker group from the emergency checkpoint::

    from ray_graceful.train import GracefulTrainCallback, should_stop, emergency_checkpoint

    def train_func(config):
        start = resume_step(ray.train.get_checkpoint())      # 0, or where the last run stopped
        for step in range(start, total):
            train_one_step()
            if should_stop(step + 1):
                emergency_checkpoint(lambda d: torch.save(model.state_dict(), f"{d}/model.pt"),
                                     step + 1)                # reports, then raises EmergencyStop

    trainer = TorchTrainer(train_func, run_config=RunConfig(
        callbacks=[GracefulTrainCallback()], failure_config=FailureConfig(max_failures=3)))

The warm path - the survivors keep their processes, Train replaces only the evicted workers
(Ray >= 2.56): ``torch_config=GracefulTorchConfig()``, and ``setup``/``carry_on`` in the
training function (``warm.py``), and ``step_guard`` around each step where a worker may crash.

The callback (also loadable with ``RAY_TRAIN_CALLBACKS=ray_graceful.train.GracefulTrainCallback``)
starts the run's coordinator on the controller, installs the SIGTERM listener on each Train
worker's main thread, and on the cold path registers each rank once the process group is up
(``callback.py``). How this fits Ray Train's own preemption API: ``ray.train.get_preemption_info()``
tells every rank that a node is being drained; ray_graceful adds the sources Ray Train does not
watch (a worker's SIGTERM, a GPU turning FAULTY, ``ray-graceful notify``), decides which replica
saves (never one on FAULTY hardware), and bounds the end when a collective hangs. Both can be
on: ``FailureConfig(max_preemption_failures=...)`` still counts preemptions Ray Train detects.
"""

from __future__ import annotations

from .backend import GracefulTorchConfig
from .callback import GracefulTrainCallback
from .emergency import emergency_checkpoint, resume_step, shard_dir
from .loop import EmergencyStop, should_stop
from .warm import carry_on, setup, step_guard

__all__ = [
    "EmergencyStop",
    "GracefulTorchConfig",
    "GracefulTrainCallback",
    "carry_on",
    "emergency_checkpoint",
    "resume_step",
    "setup",
    "shard_dir",
    "should_stop",
    "step_guard",
]
