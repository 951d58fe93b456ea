"""What the warm path tells Ray Train: the step the new group joined at, and a held step once
it is on disk.

Every member of the new group reports the step it joined at (``report_joined``): Train's
report is a barrier, and Train cleared the survivors' unreported results when it replaced the
evicted workers, so no report mixes generations. Rank 0 attaches the committed step's directory
where it is on disk, uploaded behind the training.

Where the memory tier held that step, it is not on disk yet: that report carries no
checkpoint, and Train's own records (``result.checkpoint``, what a later ``fit`` of the same run
restores) would stay at an older step. The step reaches disk behind the training, and is
reported again then. As the report is a barrier, every rank must make it at the same step:
``loop.should_stop`` already all-reduces a flag at each agreed step, and the held step rides in
that all-reduce - rank 0 looks (at most once a second) whether the held step's manifest is on
disk, and once it is, every rank learns so at the same step and reports it, rank 0 with the
committed directory. Until then nothing more is reported.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ..checkpoint import MANIFEST, latest_committed, step_dir
from ..checkpoint.read import read_committed

logger = logging.getLogger(__name__)

LOOK_EVERY_S = 1.0  # rank 0's look at the checkpoint directory, while a held step waits
NOT_YET = -1  # what a rank contributes to the all-reduce while nothing is on disk


@dataclass
class HeldReport:
    """This process's held step waiting for its disk copy, once ``expect`` named one."""

    step: int | None = None
    cycle: int = 0
    checkpoint_dir: str | None = None
    looked_at: float = 0.0

    def expect(self, step: int, cycle: int, checkpoint_dir: str | None) -> None:
        """The step joined at was reported without its checkpoint: report it once on disk."""
        self.step = step if checkpoint_dir is not None else None
        self.cycle, self.checkpoint_dir, self.looked_at = cycle, checkpoint_dir, 0.0

    def forget(self) -> None:
        self.step = None

    def on_disk(self, rank: int) -> int:
        """Rank 0's part of the all-reduce: the held step if its manifest is on disk now, else
        ``NOT_YET`` (every other rank, and between two looks)."""
        if self.step is None or self.checkpoint_dir is None or rank != 0:
            return NOT_YET
        now = time.monotonic()
        if now - self.looked_at < LOOK_EVERY_S:
            return NOT_YET
        self.looked_at = now
        directory = step_dir(self.checkpoint_dir, self.step)
        if not os.path.exists(os.path.join(directory, MANIFEST)):
            return NOT_YET
        committed, why = read_committed(self.step, directory, False)  # names and sizes, no reads
        if committed is None:
            logger.warning("ray_graceful: held step %s on disk is not whole: %s", self.step, why)
            return NOT_YET
        return self.step

    def report(self, agreed: int, rank: int) -> None:
        """Every rank, at the same step: report the agreed step to Train, rank 0 with its
        committed directory (a rank that joined after the step was held reports it too: the
        report is Train's barrier)."""
        directory = None
        if rank == 0 and self.checkpoint_dir is not None:
            directory = step_dir(self.checkpoint_dir, agreed)
        _report({"step": agreed, "ray_graceful_warm_restart": self.cycle,
                 "ray_graceful_durable": 1}, directory)  # fmt: skip
        self.forget()


held_report = HeldReport()  # this process's (a Train worker runs one training function)


def report_joined(step: int, cycle: int, checkpoint_dir: str | None) -> None:
    """Every member of the new group, at once: the step it holds (see the module docstring)."""
    import ray.train

    directory = None
    held_report.expect(step, cycle, checkpoint_dir)  # reported again once on disk (rank 0 looks)
    if checkpoint_dir is not None and ray.train.get_context().get_world_rank() == 0:
        committed = latest_committed(checkpoint_dir, verify_checksums=False)
        if committed is not None and committed.step == step:
            directory = committed.path
            held_report.forget()
    _report({"step": step, "ray_graceful_warm_restart": cycle}, directory)


def _report(metrics: dict[str, int], directory: str | None) -> None:
    import ray.train
    from ray.train import CheckpointUploadMode

    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(directory) if directory else None,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        delete_local_checkpoint_after_upload=False,  # the plugin's committed step stays
    )
