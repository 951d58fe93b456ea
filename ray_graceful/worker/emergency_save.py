"""A teardown's save step: this rank's own shards, then those it backs up.

Within the order's budget and the deadline, atomically (``checkpoint.write_shard``), labelled
with the step the training thread parked at. The memory tier hands the state to keepers
instead, and saves to disk when they refuse - unless the state itself never came, which a
disk save would only wait for again. The coordinator is told how the own shards went as soon
as they are done, because a backup of a shard not saved starts on that answer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from ..checkpoint import ShardRecord, Tier, shard_file_name, write_shard
from ..config import GracefulConfig
from .exit_path import write_stderr
from .late_copy import HeldShard
from .report_file import Skip, ray_identity
from .threads import run_bounded

# How a rank writes one shard: ``saver(path, step)``, returning (bytes, crc32) or None.
Saver = Callable[[str, int], "tuple[int, int] | None"]


@dataclasses.dataclass
class ShardSave:
    """Save shard ``shard`` under ``root`` with ``saver``, within ``budget_s``.

    No step: the step is the one the training thread parked at (or last reported), read once
    it is quiescent - never when the order arrives, when the thread may still finish a step.
    """

    root: str
    shard: str
    budget_s: float
    saver: Saver
    group: str = ""
    rank: int = -1
    # A backup saver: ``turn(wait_s)`` asks the coordinator whether to save (True, why), waiting
    # at most ``wait_s``; asked no later than ``start_by``, when the save still fits.
    turn: Callable[[float], tuple[bool, str]] | None = None
    start_by: float = 0.0
    # Memory tier: hand ``state()`` to these keepers (in ``namespace``) instead of writing a
    # file; on refusal, save to ``root`` as before and say so.
    keepers: tuple[str, ...] = ()
    state: Callable[[], Any] | None = None
    namespace: str = ""
    # A warm restart's survivor: snapshot ``state()`` and report it held; the copy to
    # ``keepers`` follows once the group trains again (``late_copy.py``)
    hold: bool = False


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
        self.until = until
        self.cycle = cycle
        self.on_saved = on_saved
        self.saved: list[ShardRecord] = []
        self.held: list[HeldShard] = []  # snapshots of shards reported held, to copy later
        self.may_hold = True  # ``run``'s word for this run: see there
        self.abandon = threading.Event()  # set: a save past its budget must never be renamed
        self._told = False

    def remaining(self) -> float:
        """Seconds left before the watchdog fires."""
        return self.until - time.monotonic()

    def run(self, step: int, may_hold: bool = True) -> str:
        """Save every ordered shard as the state of ``step``; what was done, in words.

        ``may_hold``: the training thread parked at ``step`` (its state provably is that step,
        so the rank trains on from it); else an order to hold is a save."""
        self.may_hold = may_hold
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

    def _budget(self, order: ShardSave, done: list[str]) -> float:
        budget = min(order.budget_s, self.remaining() - self.config.destroy_timeout_s)
        if budget <= 0:
            raise RuntimeError(
                f"no time left before the deadline to save shard {order.shard!r} "
                f"({'; '.join(done)})"
            )
        return budget

    def _hand_off(self, order: ShardSave, step: int, done: list[str]) -> bool:
        """Memory tier: True once every keeper named holds the shard; False: save to disk."""
        from ..memory.handoff import hand_off

        assert order.state is not None
        budget = self._budget(order, done)
        state = order.state
        captured = threading.Event()

        def give() -> ShardRecord:
            value = state()
            captured.set()
            return hand_off(
                value,
                step,
                order.shard,
                order.keepers,
                order.namespace,
                self.cycle,
                budget,
                order.group,
                order.rank,
            )

        try:
            record: ShardRecord = run_bounded(give, budget, "memory-hand-off")
        except Exception as exc:
            if isinstance(exc, TimeoutError) and not captured.is_set():
                # The state itself never came: a disk save would call state() again and hang
                # again, and a backup of this shard waits on this save's failure to start.
                raise TimeoutError(
                    f"the state of shard {order.shard!r} was not captured within its budget "
                    f"of {budget:.1f}s (state_dict() did not return); not tried again on disk"
                ) from None
            done.append(f"memory tier: shard {order.shard!r} not held ({exc}); saving to disk")
            return False
        self.saved.append(record)
        done.append(
            f"shard {order.shard!r}: {record.bytes} bytes held in memory on "
            f"{len(record.holders)} node(s) in {record.seconds:.2f}s"
        )
        return True

    def _hold(self, order: ShardSave, step: int, done: list[str]) -> bool:
        """A survivor's own shard: a snapshot (``memory.handoff.take_snapshot``), reported
        held. False (saved as any other, and said so) where it does not fit or fails."""
        from ..dcp import is_shard_files
        from ..memory.handoff import take_snapshot

        assert order.state is not None
        budget = self._budget(order, done)
        state = order.state
        started = time.monotonic()

        def snap() -> Any:
            value = state()
            if is_shard_files(value):
                return "a DCP shard is not held"
            # The copy runs while the coordinator concludes and the group forms: the rejoin
            # waits for it before the live state moves (``rejoin._settle``).
            return take_snapshot(value, step, self.config.memory_budget_mb << 20, background=True)

        try:
            snapshot = run_bounded(snap, budget, "hold-snapshot")
        except MemoryError:
            snapshot = "no memory for a snapshot"
        if isinstance(snapshot, str):
            done.append(f"shard {order.shard!r}: {snapshot}; saving it now")
            return False
        record = ShardRecord(
            shard=order.shard,
            step=step,
            file=shard_file_name(order.shard),
            bytes=snapshot.nbytes,
            crc32=0,
            group=order.group,
            rank=order.rank,
            seconds=time.monotonic() - started,
            tier=Tier.HELD,
            holders=(ray_identity()["node_id"],),
        )
        self.saved.append(record)
        self.held.append(HeldShard(snapshot, record, order.keepers, order.namespace, budget))
        done.append(
            f"shard {order.shard!r}: {snapshot.nbytes} bytes held by this process (a snapshot, "
            "copied in the background), to the keepers once the group trains again"
        )
        return True

    def _save_one(self, order: ShardSave, step: int, done: list[str]) -> None:
        in_memory = bool(order.keepers) and order.state is not None
        if in_memory and order.hold and not self.may_hold:
            done.append(f"shard {order.shard!r}: not parked at its step boundary; saving, not held")
        elif in_memory and order.hold and self._hold(order, step, done):
            return
        if in_memory and self._hand_off(order, step, done):
            return
        if order.keepers and order.state is None:
            done.append("memory tier: this rank registered a saver=, not state=; saving to disk")
        if not order.root:
            # Memory-only mode (no checkpoint_dir): "saving to disk" would mean the process's
            # working directory. Nothing is written; the shard is missing and the cycle says so.
            raise RuntimeError(
                f"shard {order.shard!r} is not held in memory and no checkpoint_dir is "
                f"configured: nowhere to save it, nothing written ({'; '.join(done)})"
            )
        budget = self._budget(order, done)

        def save() -> ShardRecord:
            return write_shard(
                order.root,
                step,
                order.shard,
                order.saver,
                abandoned=self.abandon,
                group=order.group,
                rank=order.rank,
            )

        try:
            record: ShardRecord = run_bounded(save, budget, "emergency-save")
        except TimeoutError:
            self.abandon.set()
            raise TimeoutError(
                f"save of shard {order.shard!r} exceeded its budget of {budget:.1f}s; "
                "abandoned, never renamed into place"
            ) from None
        self.saved.append(record)
        done.append(
            f"shard {order.shard!r}: {record.bytes} bytes in {record.seconds:.2f}s"
            + (" (already committed: kept, not rewritten)" if record.reused else "")
        )

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
