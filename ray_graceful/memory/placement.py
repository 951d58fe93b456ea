"""Which nodes' keepers hold a shard: a pure function, so it is tested without a cluster.

A holder must be a node that is not being evicted and not FAULTY. The saver's own node comes
first when it qualifies (a local hand-off is a copy in shared memory, not a transfer); the
others are taken in an order that spreads shards over the surviving nodes, so one node's
budget is not spent first. Fewer qualifying nodes than ``replicas``: no memory tier for that
shard (the saver writes to disk) - a memory checkpoint is committed only when every shard is
held by ``replicas`` survivors.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence


def choose_holders(
    shard_key: str, saver_node: str, survivors: Sequence[str], replicas: int
) -> tuple[str, ...]:
    """``replicas`` distinct surviving nodes for ``shard_key``, or () if there are too few."""
    if replicas <= 0:
        return ()
    pool = sorted(set(survivors))
    if len(pool) < replicas:
        return ()
    chosen = [saver_node] if saver_node in pool else []
    others = [n for n in pool if n != saver_node]
    if others:
        start = zlib.crc32(shard_key.encode()) % len(others)
        others = others[start:] + others[:start]
    chosen += others[: replicas - len(chosen)]
    return tuple(chosen)
