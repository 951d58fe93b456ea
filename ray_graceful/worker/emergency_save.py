"""A teardown's save step: this rank's own shards, then those it backs up.

Within the order's budget and the deadline, labelled with the step the training thread parked
at, each shard by the first of its save ways that takes it (``save_ways.py``: hold, hand off to
the keepers, write to disk). The coordinator is told how the own shards went as soon
as they are done, because a backup of a shard not saved starts on that answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..checkpoint import ShardRecord
from ..config import GracefulConfig
from .exit_path import write_stderr
from .late_copy import HeldShard
from .report_file import Skip
from .save_ways import SaveRun, ShardSave, save_shard


class EmergencySave:
    """Runs a rank's ``ShardSave``s once its training thread is quiescent; keeps what it saved."""

    def __init__(
        self,
        config: GracefulConfig,
        orders: list[ShardSave],
        until: float,
        cycle: int = 0,
        on_saved: Callable[[list[str], list[str], str], None] | None = None,
    ) -> None:
        self.config = config
        self.orders = orders
        # When the teardown's watchdog fires (time.monotonic()). A number, not the teardown's
        # own method: a reference back would keep the teardown, and the process groups it
        # holds (gloo's threads), alive past the cycle until the garbage collector runs.
        self.on_saved = on_saved
        self.saved: list[ShardRecord] = []
        # What the save ways share (``save_ways.py``): the deadline, the snapshots held.
        self.ways = SaveRun(config, until, cycle)
        self._told = False

    @property
    def held(self) -> list[HeldShard]:
        """Snapshots of shards reported held, to copy once the group trains again."""
        return self.ways.held

    @property
    def abandon(self) -> threading.Event:
        """Set: a save past its budget must never be renamed into place."""
        return self.ways.abandon

    def remaining(self) -> float:
        """Seconds left before the watchdog fires."""
        return self.ways.remaining()

    def run(self, step: int, may_hold: bool = True) -> str:
        """Save every ordered shard as the state of ``step``; what was done, in words.

        ``may_hold``: the training thread parked at ``step`` (its state provably is that step,
        so the rank trains on from it); else an order to hold is a save."""
        self.ways.may_hold = may_hold
        done = [f"state of step {step}"]
        own = [o for o in self.orders if o.turn is None]
        backups = [o for o in self.orders if o.turn is not None]
        for order in own:
            self._save_one(order, step, done)
        # Before any backup turn of this rank's: another process's backup may wait on this.
        self.tell_saved("; ".join(done))
        for order in backups:
            assert order.turn is not None
            wait_s = min(
                order.start_by - time.time(), self.remaining() - self.config.destroy_timeout_s
            )
            must_save, why = order.turn(max(wait_s, 0.0))
            if not must_save:
                done.append(f"backup of shard {order.shard!r}: not saving ({why})")
                continue
            done.append(f"backup of shard {order.shard!r}: saving ({why})")
            self._save_one(order, step, done)
        if not own and not any(o.shard in {r.shard for r in self.saved} for o in backups):
            raise Skip("; ".join(done))
        return "; ".join(done)

    def _save_one(self, order: ShardSave, step: int, done: list[str]) -> None:
        self.saved.append(save_shard(self.ways, order, step, done))

    def tell_saved(self, why: str) -> None:
        """Tell the coordinator, once, which of its own shards this process saved (``why``:
        how the save went): a backup of a shard not saved may start at once."""
        own = [o.shard for o in self.orders if o.turn is None]
        if self._told or self.on_saved is None or not own:
            return
        self._told = True
        saved = {r.shard for r in self.saved}
        try:
            self.on_saved([s for s in own if s in saved], [s for s in own if s not in saved], why)
        except Exception as exc:  # the backup then waits for the report, or its own limit
            write_stderr(f"ray_graceful: could not tell the coordinator the save result: {exc!r}\n")
