"""Where a restarted rank gets its state: ``load_latest`` - memory first, disk last.

One call for every tier, so training code does not branch on where the last emergency
checkpoint ended up: the keeper on this node (no copy), a keeper on another node (one transfer),
or the newest committed checkpoint in ``checkpoint_dir`` (``memory/handoff.py`` does the work).
"""

from __future__ import annotations

from ..config import GracefulConfig
from ..memory.handoff import LoadedShard, load_shard
from ..protocol import shard_key
from .control import find_coordinator
from .mixin import _process_runtime


def load_latest(
    group: str, shard: str | int, config: GracefulConfig | None = None
) -> LoadedShard | None:
    """The newest committed ``{"step", "state"}`` of shard ``shard`` of group ``group``.

    ``None`` when nothing was ever committed for it. ``.tier`` says where it came from
    ("memory-local", "memory-peer", "disk"), ``.state`` is what ``state_dict=`` returned.
    Every rank of a restarted group gets the same step; ``MemoryTierError`` when this rank
    could not get that step from any keeper and disk holds only an older one (restart again).
    """
    config = config or _process_runtime().config_or_default()
    return load_shard(
        shard_key(group, str(shard)),
        find_coordinator(config),
        config.checkpoint_dir,
        config.coordinator_namespace,
    )
