"""Ray Train's cold path: the chosen replica saves, every rank reports, Train restarts.

``emergency_checkpoint(save, step)`` after ``should_stop(step)``: the rank the plan chose for
each shard writes it with ``save(directory)``, every rank calls ``ray.train.report`` (Train
needs all of them), and the function raises ``EmergencyStop``. Train restarts the run
(``FailureConfig.max_failures``) and ``ray.train.get_checkpoint()`` hands it the emergency
checkpoint; ``resume_step`` and ``shard_dir`` read it back.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .. import ray_adapter
from ..protocol import shard_key
from ..worker.process_groups import SetupError
from ..worker.process_runtime import process_runtime
from .loop import GROUP, EmergencyStop, train_shard

logger = logging.getLogger(__name__)

MARKER = "ray_graceful.json"
# At most this long for Ray Train's controller to take an emergency report (it polls each
# worker about once a second) before the rank raises and leaves.
REPORT_WAIT_S = 5.0


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

        rank = ray.train.get_context().get_world_rank()
        shard = train_shard(process_runtime().config_or_default(), rank)
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
