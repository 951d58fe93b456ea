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


class KeeperPool:
    """The surviving keeper nodes of one plan, sorted once.

    A plan places every shard: at 16,384 ranks over 2,048 keeper nodes, sorting and scanning
    the survivors for each shard took 9.7 s. Built once per plan, each choice costs
    O(replicas) instead.
    """

    def __init__(self, survivors: Sequence[str]) -> None:
        self.nodes = tuple(sorted(set(survivors)))
        self.position = {node: i for i, node in enumerate(self.nodes)}

    def choose(
        self, shard_key: str, saver_node: str, replicas: int, preferred: Sequence[str] = ()
    ) -> tuple[str, ...]:
        """``replicas`` distinct nodes for ``shard_key``, or () if there are too few.

        ``preferred``: nodes that should hold it first (the spares that will load it), in order;
        those that are not surviving are skipped. Then the saver's node, if it survives; then
        the other survivors from a point the shard key picks, in order (a spread over nodes).
        """
        if replicas <= 0 or len(self.nodes) < replicas:
            return ()
        wanted = (*preferred, saver_node)
        chosen = list(dict.fromkeys(n for n in wanted if n in self.position))[:replicas]
        others = len(self.nodes) - len(chosen)  # the survivors not chosen yet, in order
        if len(chosen) == replicas or others == 0:
            return tuple(chosen)
        taken = sorted(self.position[n] for n in chosen)
        start = zlib.crc32(shard_key.encode()) % others
        for step in range(min(replicas - len(chosen), others)):
            index = (start + step) % others  # the index among the others: skip what is taken
            for position in taken:
                if position <= index:
                    index += 1
            chosen.append(self.nodes[index])
        return tuple(chosen)


def choose_holders(
    shard_key: str,
    saver_node: str,
    survivors: Sequence[str],
    replicas: int,
    preferred: Sequence[str] = (),
) -> tuple[str, ...]:
    """``replicas`` distinct surviving nodes for ``shard_key``, or () if there are too few
    (``KeeperPool.choose``, for one shard; a plan builds the pool once)."""
    return KeeperPool(survivors).choose(shard_key, saver_node, replicas, preferred)
