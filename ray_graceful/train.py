"""Ray Train (V2): one callback, and two calls in the training function.

::

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

The callback (also loadable with ``RAY_TRAIN_CALLBACKS=ray_graceful.train.GracefulTrainCallback``)
starts the run's coordinator on the controller, installs the SIGTERM listener on each Train
worker's main thread (the training function's own thread is not the main thread), and registers each
rank once the process group is up. When a notice comes, ``should_stop`` turns true; the rank the
plan chose for each shard writes it in ``emergency_checkpoint``, every rank calls
``ray.train.report`` (Ray Train needs all of them), and the function raises ``EmergencyStop``:
Ray Train restarts the run (``FailureConfig.max_failures``) and ``ray.train.get_checkpoint()``
hands it the emergency checkpoint. If the function never reaches ``should_stop`` (a rank is stuck
in a collective), the rank's teardown still runs before its deadline: peers are released, the
process leaves, and Ray Train restarts from its last checkpoint.

How this fits Ray Train's own preemption API: ``ray.train.get_preemption_info()`` tells every
rank that a node is being drained; ray_graceful adds the sources Ray Train does not watch (a
worker's SIGTERM, a GPU turning FAULTY, ``ray-graceful notify``), decides which replica saves
(never one on FAULTY hardware), and bounds the end when a collective hangs. Both can be on:
``FailureConfig(max_preemption_failures=...)`` still counts preemptions Ray Train detects.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import ray_adapter
from .config import GracefulConfig
from .protocol import shard_key
from .worker.process_groups import SetupError
from .worker.process_runtime import process_runtime
from .worker.setup import install_signal_handling, register_rank
from .worker.setup import should_stop as rank_should_stop

logger = logging.getLogger(__name__)

MARKER = "ray_graceful.json"
# At most this long for Ray Train's controller to take an emergency report (it polls each
# worker about once a second) before the rank raises and leaves.
REPORT_WAIT_S = 5.0
GROUP = "train"

__all__ = [
    "EmergencyStop",
    "GracefulTrainCallback",
    "emergency_checkpoint",
    "resume_step",
    "shard_dir",
    "should_stop",
]


def should_stop(step: int, every: int = 1) -> bool:
    """Whether the training function should save and stop at this step - agreed by all ranks.

    Orders reach ranks a few milliseconds apart; a rank that stopped at step 8 while its peer
    went on to step 9 would leave both stuck (the peer's all-reduce waits for it, it waits in
    ``ray.train.report`` for the peer). So the ranks agree: one all-reduce of a flag on the
    run's process group, every ``every`` steps (all ranks must pass the same ``step`` and
    ``every``). On GPUs that is one tiny NCCL all-reduce and a sync; raise ``every`` if a step
    is short.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise SetupError(f"should_stop: every={every!r} must be an int >= 1")
    local = rank_should_stop(step)
    if step % every:
        return False
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class EmergencyStop(RuntimeError):
    """Raised by ``emergency_checkpoint`` once the checkpoint is reported: Ray Train restarts."""


def _register_train_rank(config: GracefulConfig) -> str:
    """Runs on each Train worker (main thread) once the process group is up."""
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    shard = _train_shard(config, rank)
    status = register_rank(
        GROUP, None, rank, ctx.get_world_size(), shard, None, config, train_fn_saves=True
    )
    return str(status)


def _train_shard(config: GracefulConfig, rank: int) -> str:
    return "model" if config.train_shards == "replicated" else str(rank)


class GracefulTrainCallback(*ray_adapter.train_callback_bases()):  # type: ignore[misc]
    """Turns ray_graceful on for a Ray Train V2 run (``RunConfig(callbacks=[...])``)."""

    def __init__(self, config: GracefulConfig | None = None) -> None:
        self.config = config or GracefulConfig.from_env()
        self._coordinator: Any = None
        self.statuses: list[str] = []

    # --- on the controller -----------------------------------------------------------------

    def after_controller_start(self, train_run_context: Any) -> None:
        from .coordinator import Coordinator, CoordinatorExists

        try:
            self._coordinator = Coordinator.start(self.config)
        except CoordinatorExists:
            # This job's driver started it already (coordinators are per job): theirs to end.
            self._coordinator = None

    def after_worker_group_training_start(self, worker_group: Any) -> None:
        # The process group is up by now (Ray Train's backend set it up when the group
        # started), whichever order the callbacks run in.
        self.statuses = worker_group.execute(_register_train_rank, self.config)

    def after_controller_finish(self, result: Any) -> None:
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            try:
                coordinator.job_finished(success=getattr(result, "error", None) is None)
            finally:
                coordinator.shutdown()

    # --- on each worker --------------------------------------------------------------------

    def after_init_train_context(self) -> None:
        # This runs on the Train worker's main thread: the one place signal handling can be
        # installed (the training function runs on its own thread).
        install_signal_handling(self.config)


def _my_shards() -> list[str]:
    """The shard keys this rank saves: the plan's choice, or all its own without an order."""
    runtime = process_runtime()
    order = runtime.order
    if order is not None:
        return [s.shard_key for s in order.saves if s.key in runtime.registrations]
    # No coordinator order (SIGTERM with no coordinator reachable): every rank saves its own.
    return [
        shard_key(g, reg.shard)
        for (g, _r), reg in runtime.registrations.items()
        if reg.train_fn_saves
    ]


def emergency_checkpoint(
    save: Callable[[str], None], step: int, metrics: dict[str, Any] | None = None
) -> None:
    """Save (if the plan picked this rank), report to Ray Train, raise ``EmergencyStop``.

    ``save(directory)`` writes this rank's state into ``directory``. Every rank must call this
    (``ray.train.report`` waits for all of them); only the chosen replica of each shard saves.
    """
    import ray.train

    if not callable(save):
        raise SetupError(f"emergency_checkpoint: save={save!r} is not callable")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise SetupError(f"emergency_checkpoint: step={step!r} must be an int >= 0")
    runtime = process_runtime()
    if runtime.order is None and runtime.control is not None and runtime.control.alive:
        # A peer saw the order first (should_stop agreed on it): ours is on its way.
        runtime.control.order_received.wait(runtime.config_or_default().order_wait_s)
    shards = _my_shards()
    checkpoint = None
    if shards:
        root = tempfile.mkdtemp(prefix="ray_graceful-")
        for shard in shards:
            directory = os.path.join(root, _shard_dir_name(shard))
            os.makedirs(directory)
            save(directory)
        with open(os.path.join(root, MARKER), "w") as f:
            json.dump({"step": step, "shards": shards, "emergency": True}, f)
        checkpoint = ray.train.Checkpoint.from_directory(root)
    ray.train.report(
        {**(metrics or {}), "step": step, "ray_graceful_emergency": 1}, checkpoint=checkpoint
    )
    # The report is only queued: leave once Ray Train's controller took it, or it is lost
    # with this process (bounded by the order's deadline, less the time to leave).
    left = REPORT_WAIT_S
    if runtime.order is not None:
        left = min(
            left,
            runtime.order.deadline - time.time() - runtime.config_or_default().destroy_timeout_s,
        )
    if not ray_adapter.wait_train_reports_collected(left):
        logger.warning(
            "ray_graceful: Ray Train had not taken this rank's report within %.1fs", left
        )
    raise EmergencyStop(
        f"ray_graceful: stopped at step {step} for an eviction"
        + ("; this rank's shard was reported to Ray Train" if shards else "")
    )


def _shard_dir_name(shard: str) -> str:
    return "shard-" + shard.replace("/", "-")


def _local_path(checkpoint: Any) -> str:
    return str(getattr(checkpoint, "path", checkpoint))


def shard_dir(checkpoint: Any, shard: str | None = None) -> str | None:
    """Where a shard lies in an emergency checkpoint (default: this rank's shard).

    ``checkpoint`` is a local directory (``with ckpt.as_directory() as d``) or a Checkpoint on
    local storage. Returns None when it is not an emergency checkpoint or lacks that shard.
    """
    if checkpoint is None:
        return None
    if shard is None:
        import ray.train

        shard = _train_shard(
            process_runtime().config_or_default(), ray.train.get_context().get_world_rank()
        )
    directory = os.path.join(_local_path(checkpoint), _shard_dir_name(f"{GROUP}/{shard}"))
    return directory if os.path.isdir(directory) else None


def resume_step(checkpoint: Any) -> int | None:
    """The step an emergency checkpoint was saved at, or None if it is not one."""
    if checkpoint is None:
        return None
    try:
        with open(os.path.join(_local_path(checkpoint), MARKER)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return None
