"""A warm restart's survivor: its held shard copied to the keepers after it trains on.

The survivor's save order said ``hold`` (``coordinator/held.py``): its teardown took a snapshot
of the shard - a copy in this process's memory, the training state free to move on - and
reported it held. What is left is the copy to the keepers its order named, and a word to the
coordinator, which commits the step once every held shard's copy landed (``LateSave``).

That copy waits until the group trains again - ``go()``, at the first ``should_stop`` after the
rejoin, once the new group's first step is done - so that it takes no CPU or memory bandwidth
from the re-formation, the other members' loads or that first step; it starts anyway after
``wait_s``. A process that leaves first finishes it before it goes (``finish``), within what is
left of its deadline: the step the group held must not vanish with its last holder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..checkpoint import ShardRecord
from ..memory.handoff import Snapshot
from .exit_path import write_stderr

# How the coordinator is told: (cycle, records of the copies, shard keys that failed, why)
Tell = Callable[[int, list[ShardRecord], list[str], str], None]


@dataclass(frozen=True)
class HeldShard:
    """One shard held by snapshot: what to copy, where, and the record it was reported with."""

    snapshot: Snapshot  # the state at the held step, copied out of the live state
    record: ShardRecord  # tier "held"
    keepers: tuple[str, ...]
    namespace: str
    budget_s: float


class LateCopies:
    """This process's held shards on their way to the keepers (one cycle's at a time)."""

    def __init__(self, hand_off: Callable[..., ShardRecord] | None = None) -> None:
        # ``memory.handoff.hand_off_snapshot`` unless given (a unit test's keepers)
        self._hand_off = hand_off
        self._go = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._taken = -1  # the newest cycle whose shards were taken
        self.waiting = False  # a copy waits for ``go()``: read on every ``should_stop``

    def take(self, cycle: int, shards: list[HeldShard], tell: Tell | None, wait_s: float) -> None:
        """Copy ``shards`` once ``go()`` is called or ``wait_s`` passed; then ``tell``. Once per
        cycle: the survivor's ask to rejoin and its leaving both hand them over, whichever
        comes first (a leave that found nothing taken yet would otherwise not wait for it)."""
        with self._lock:
            if not shards or cycle <= self._taken:
                return
            self._taken = cycle
            self._start(cycle, shards, tell, wait_s)

    def _start(self, cycle: int, shards: list[HeldShard], tell: Tell | None, wait_s: float) -> None:
        self.finish(0.0)  # an earlier cycle's copy still running: it goes on, unwaited
        self._go = go = threading.Event()
        self.waiting = True
        if self._hand_off is None:
            from ..memory.handoff import hand_off_snapshot

            self._hand_off = hand_off_snapshot
        self._thread = threading.Thread(
            target=self._copy,
            args=(self._hand_off, cycle, shards, tell, go, wait_s),
            name="ray_graceful-late-copy",
            daemon=True,
        )
        self._thread.start()

    def go(self) -> None:
        """The group trains again (or this process leaves): copy now."""
        self.waiting = False
        self._go.set()

    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self, timeout: float) -> bool:
        """Copy now and wait at most ``timeout``; True if no copy is left running."""
        self.go()
        thread = self._thread
        if thread is not None and timeout > 0:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    @staticmethod
    def _copy(
        hand_off: Callable[..., ShardRecord],
        cycle: int,
        shards: list[HeldShard],
        tell: Tell | None,
        go: threading.Event,
        wait_s: float,
    ) -> None:
        go.wait(wait_s)
        saved: list[ShardRecord] = []
        failed: list[str] = []
        why: list[str] = []
        for shard in shards:
            held = shard.record
            started = time.monotonic()
            try:
                record = hand_off(
                    shard.snapshot,
                    held.shard,
                    shard.keepers,
                    shard.namespace,
                    cycle,
                    shard.budget_s,
                    held.group,
                    held.rank,
                )
                saved.append(record)
            except Exception as exc:
                failed.append(held.shard)
                why.append(f"{held.shard}: {type(exc).__name__}: {exc}"[:300])
                write_stderr(
                    f"ray_graceful: the held shard {held.shard!r} of step {held.step} did not "
                    f"reach the keepers after {time.monotonic() - started:.1f}s: {exc!r}\n"
                )
        if tell is None:
            return
        try:
            tell(cycle, saved, failed, "; ".join(why))
        except Exception as exc:  # the coordinator then loses the step at its deadline
            write_stderr(f"ray_graceful: could not report the late copy: {exc!r}\n")
