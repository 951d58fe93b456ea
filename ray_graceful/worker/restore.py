"""Where a restarted rank gets its state: ``load_latest`` - memory first, disk last.

One call for every tier, so training code does not branch on where the last emergency
checkpoint ended up: the keeper on this node (no copy), a keeper on another node (one transfer),
or the newest committed checkpoint in ``checkpoint_dir`` (``memory/handoff.py`` does the work).
"""

from __future__ import annotations

import logging
from typing import Any

from ..bounded import NoAnswer, call
from ..config import GracefulConfig
from ..memory.handoff import LoadedShard, load_shard
from ..protocol import shard_key
from .control import find_coordinator
from .process_runtime import process_runtime

logger = logging.getLogger(__name__)


def load_latest(
    group: str, shard: str | int, config: GracefulConfig | None = None
) -> LoadedShard | None:
    """The newest committed ``{"step", "state"}`` of shard ``shard`` of group ``group``.

    ``None`` when nothing was ever committed for it. ``.tier`` says where it came from
    ("memory-local", "memory-peer", "disk"), ``.state`` is what ``state_dict=`` returned.
    Every rank of a restarted group gets the same step; ``MemoryTierError`` when this rank
    could not get that step from any keeper and disk holds only an older one (restart again).
    """
    config = config or process_runtime().config_or_default()
    coordinator = find_coordinator(config)
    checkpoint_dir = config.checkpoint_dir
    if checkpoint_dir is None and coordinator is not None:
        # The README's setup gives checkpoint_dir to the coordinator alone (its orders tell
        # savers where to write): the restart reads where the coordinator commits.
        checkpoint_dir = coordinator_checkpoint_dir(coordinator)
    return load_shard(
        shard_key(group, str(shard)), coordinator, checkpoint_dir, config.coordinator_namespace
    )


def coordinator_checkpoint_dir(coordinator: Any, timeout_s: float = 30.0) -> str | None:
    """The coordinator's ``checkpoint_dir``; None (with a log line) if it does not answer."""
    answer = call(coordinator.checkpoint_dir, timeout=timeout_s)
    if isinstance(answer, NoAnswer):
        logger.warning("ray_graceful: could not ask the coordinator for checkpoint_dir: %s", answer)
        return None
    return answer
