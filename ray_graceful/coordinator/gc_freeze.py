"""What the coordinator holds during a teardown, kept out of Python's cyclic collector.

From a cycle's orders to its outcome the coordinator keeps everything the orders were made of -
the registry of every rank, the plan, one order per process - while it allocates fast: packed
replies, acknowledgements, reports. Every few hundred allocations start a young collection, and
every so often one grows into a full collection that rescans all that is held. Measured through
Ray at 16,384 ranks (``python -m benchmarks fanout``): one full collection in every fan-out,
0.14-0.28 s of the coordinator's time between the notice and the last order delivered; frozen,
none, and 0.03-0.08 s of young collections (``docs/benchmarks.md``).

So once the orders are out, what the coordinator holds is frozen (``gc.freeze``: moved to the
collector's permanent generation, which no collection scans), and when the cycle ends it is
thawed (``gc.unfreeze``: back to the oldest generation), so whatever the cycle left as garbage
is collected after the outcome, when no rank waits on the coordinator. Objects made meanwhile
are collected as always. Ray Serve's proxy freezes its start-up objects the same way. Both
calls are the process's: the coordinator actor has its process to itself, and each is harmless
to repeat.

After the cycle, the heap's free pages go back to the system (``give_back_freed``), so that
serving cycle after cycle does not grow the coordinator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any


def freeze_held() -> None:
    """The orders are out: what the coordinator holds now stays until the cycle ends."""
    gc.freeze()


def thaw_held() -> None:
    """The cycle ended: what it held is the collector's again."""
    gc.unfreeze()


def give_back_freed() -> bool:
    """The cycle's garbage is freed: hand the heap's free pages back to the system.

    glibc keeps what Python frees in its heaps for reuse, and the pages between live
    allocations stay in the process; a coordinator that serves cycle after cycle at thousands
    of ranks grew about 1 MB a cycle that way, with the same live objects every cycle
    (``docs/benchmarks.md``). ``malloc_trim(0)`` releases every heap's free pages. False where
    the C library has none (musl, macOS): nothing to do there.
    """
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
