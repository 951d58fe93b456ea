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
"""

from __future__ import annotations

import gc


def freeze_held() -> None:
    """The orders are out: what the coordinator holds now stays until the cycle ends."""
    gc.freeze()


def thaw_held() -> None:
    """The cycle ended: what it held is the collector's again."""
    gc.unfreeze()
