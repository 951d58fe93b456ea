"""Where the memory tier puts a shard's copies (``memory/placement.py``), without a cluster."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_graceful.memory.placement import KeeperPool, choose_holders

pytestmark = pytest.mark.unit


def _choose_holders_as_before(shard_key, saver_node, survivors, replicas, preferred=()):
    """The placement before ``KeeperPool`` (sorted and scanned the survivors per shard): the
    reference the pool must agree with, shard for shard."""
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


@settings(max_examples=300, deadline=None)
@given(
    survivors=st.lists(st.sampled_from("abcdefghij"), max_size=10),
    saver=st.sampled_from("abcdefghijxyz"),
    preferred=st.lists(st.sampled_from("abcdefghijxyz"), max_size=4),
    replicas=st.integers(0, 6),
    shard=st.integers(0, 10_000),
)
def test_a_pool_built_once_places_every_shard_as_before(
    survivors, saver, preferred, replicas, shard
):
    pool = KeeperPool(survivors)
    key = f"g/{shard}"
    expected = _choose_holders_as_before(key, saver, survivors, replicas, preferred)
    assert pool.choose(key, saver, replicas, preferred) == expected


def test_at_2048_keeper_nodes_each_shard_gets_its_savers_node_then_a_spread():
    nodes = [f"node-{i:05d}" for i in range(2048)]
    pool = KeeperPool(nodes)
    placed = [pool.choose(f"g/{i}", nodes[i // 8], 2) for i in range(16384)]
    assert all(p[0] == nodes[i // 8] and p[1] != p[0] for i, p in enumerate(placed))
    assert len({p[1] for p in placed}) > 1500, "second copies spread over the nodes"
    assert choose_holders("g/0", "node-00000", nodes, 1) == ("node-00000",)
