"""The coordinator's memory between cycles (``coordinator/gc_freeze.py``): what a cycle held is
kept out of the cyclic collector while the orders go out, and the heap's free pages go back to
the system once the cycle is over."""

from __future__ import annotations

import ctypes.util
import gc
import os
import sys

import pytest

from ray_graceful.coordinator import gc_freeze

pytestmark = pytest.mark.unit


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_what_is_held_is_frozen_during_the_cycle_and_thawed_after():
    held = [[i] for i in range(1000)]
    before = gc.get_freeze_count()
    gc_freeze.freeze_held()
    try:
        assert gc.get_freeze_count() >= before + len(held), "held objects out of the collector"
    finally:
        gc_freeze.thaw_held()
    assert gc.get_freeze_count() == 0, "back to the collector once the cycle ended"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
    reason="malloc_trim is glibc's",
)
def test_freed_pages_go_back_to_the_system_after_a_cycle():
    """A heap left full of holes (what thousands of replies and reports leave) shrinks."""
    kept, freed = [], []
    for i in range(200_000):  # ~240 MB of 600-1,800 byte buffers, one in eight kept
        (kept if i % 8 == 0 else freed).append(bytes(600 + (i % 1200)))
    del freed
    holding = rss_bytes()
    assert gc_freeze.give_back_freed(), "glibc has malloc_trim"
    given_back = holding - rss_bytes()
    assert given_back > 50 << 20, f"only {given_back >> 20} MB given back"
    assert len(kept) == 25_000
