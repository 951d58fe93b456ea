"""Which nodes' keepers hold a shard: a pure function, so it is tested without a cluster.

A holder must be a node that is not being evicted and not FAULTY. Where a warm restart will
hand the shard's evicted slot to a spare, the spare's node comes first: the spare then loads
from its own node's keeper (a zero-copy read) instead of across the network. Otherwise the
saver's own node comes first when it qualifies (a local hand-off is a copy in shared memory,
not a transfer); the others are taken in an order that spreads shards over the surviving
nodes, so one node's budget is not spent first. Fewer qualifying nodes than ``replicas``: no
memory tier for that shard (the saver writes to disk) - a memory checkpoint is committed only
when every shard is held by ``replicas`` survivors.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence


def choose_holders(
    shard_key: str,
    saver_node: str,
    survivors: Sequence[str],
    replicas: int,
    preferred: Sequence[str] = (),
) -> tuple[str, ...]:
    """``replicas`` distinct surviving nodes for ``shard_key``, or () if there are too few.

    ``preferred``: nodes that should hold it first (the spares that will load it), in order;
    those that are not surviving are skipped.
    """
    if replicas <= 0:
        return ()
    pool = sorted(set(survivors))
    if len(pool) < replicas:
        return ()
    chosen = list(dict.fromkeys(n for n in (*preferred, saver_node) if n in pool))[:replicas]
    others = [n for n in pool if n not in chosen]
    if others:
        start = zlib.crc32(shard_key.encode()) % len(others)
        others = others[start:] + others[:start]
    chosen += others[: replicas - len(chosen)]
    return tuple(chosen)
