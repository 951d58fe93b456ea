"""The ways a rank saves one shard, as strategies tried in order: hold, hand off, write.

A save order (``ShardSave``) names its ways, best first (``ShardSave.ways``: places, see
``place.py``); each way either saves the shard - a ``ShardRecord`` that says where it lies - or
falls back to the next with the reason (``Fallback``), which the teardown's report keeps. A way
that fails past any fallback (the state itself never came; a write past its budget) raises.

- ``HoldWay`` (``Place.HELD``): a warm restart's survivor parked at its step keeps a snapshot
  in its own memory, reported held; the keepers get it once the group trains again;
- ``HandOffWay`` (``Place.MEMORY``): the state goes to the keepers (the memory tier);
- ``DiskWay`` (``Place.DISK``): a file under ``checkpoint_dir``, atomically.

A new way to save is one class here and one member of ``Place``, in the manner of NVRx's
composed in-process restart strategies.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..checkpoint import ShardRecord, shard_file_name, write_shard
from ..config import GracefulConfig
from ..place import Place
from .late_copy import HeldShard
from .report_file import ray_identity
from .threads import run_bounded

# How a rank writes one shard: ``saver(path, step)``, returning (bytes, crc32) or None.
Saver = Callable[[str, int], "tuple[int, int] | None"]


@dataclasses.dataclass
class ShardSave:
    """Save shard ``shard`` within ``budget_s``, trying ``ways`` in order.

    No step: the step is the one the training thread parked at (or last reported), read once
    it is quiescent - never when the order arrives, when the thread may still finish a step.
    """

    root: str  # checkpoint_dir ("": none, the disk way has nowhere to write)
    shard: str
    budget_s: float
    saver: Saver
    group: str = ""
    rank: int = -1
    # A backup saver: ``turn(wait_s)`` asks the coordinator whether to save (True, why), waiting
    # at most ``wait_s``; asked no later than ``start_by``, when the save still fits.
    turn: Callable[[float], tuple[bool, str]] | None = None
    start_by: float = 0.0
    # The memory tier: the keepers (in ``namespace``) that take ``state()``.
    keepers: tuple[str, ...] = ()
    state: Callable[[], Any] | None = None
    namespace: str = ""
    # A warm restart's survivor: hold a snapshot of ``state()`` first (``HoldWay``).
    hold: bool = False

    @property
    def ways(self) -> tuple[Place, ...]:
        """The places to try, best first; the disk always last."""
        ways = []
        if self.keepers:  # a hold needs the state itself; the hand-off says so when it is not
            ways = [Place.HELD, Place.MEMORY] if self.hold and self.state else [Place.MEMORY]
        return (*ways, Place.DISK)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A way did not save the shard; the next way tries. ``why`` goes in the save's account."""

    why: str


@dataclasses.dataclass
class SaveRun:
    """What every way of one teardown's save shares: the clock it races, and what it kept."""

    config: GracefulConfig
    until: float  # when the teardown's watchdog fires (time.monotonic())
    cycle: int = 0
    may_hold: bool = True  # the training thread parked at the step: its state is that step
    held: list[HeldShard] = dataclasses.field(default_factory=list)  # snapshots, to copy later
    abandon: threading.Event = dataclasses.field(default_factory=threading.Event)

    def remaining(self) -> float:
        """Seconds left before the watchdog fires."""
        return self.until - time.monotonic()

    def budget(self, order: ShardSave, done: list[str]) -> float:
        """The order's budget, cut to what the deadline leaves (RuntimeError: nothing)."""
        budget = min(order.budget_s, self.remaining() - self.config.destroy_timeout_s)
        if budget <= 0:
            raise RuntimeError(
                f"no time left before the deadline to save shard {order.shard!r} "
                f"({'; '.join(done)})"
            )
        return budget


class SaveWay(Protocol):
    """One way to save a shard: where it puts it, and the attempt."""

    place: Place

    def try_save(
        self, run: SaveRun, order: ShardSave, step: int, done: list[str]
    ) -> ShardRecord | Fallback: ...

    def said(self, record: ShardRecord) -> str:
        """How the save went, in words, for the teardown's report."""
        ...


class HoldWay:
    """A survivor's own shard: a snapshot (``memory.handoff.take_snapshot``), reported held."""

    place = Place.HELD

    def try_save(
        self, run: SaveRun, order: ShardSave, step: int, done: list[str]
    ) -> ShardRecord | Fallback:
        from ..dcp import is_shard_files
        from ..memory.handoff import take_snapshot

        if not run.may_hold:
            return Fallback("not parked at its step boundary; saving, not held")
        assert order.state is not None  # ShardSave.ways: held only with a state
        budget = run.budget(order, done)
        state = order.state
        started = time.monotonic()

        def snap() -> Any:
            value = state()
            if is_shard_files(value):
                return "a DCP shard is not held"
            # The copy runs while the coordinator concludes and the group forms: the rejoin
            # waits for it before the live state moves (``rejoin._settle``).
            return take_snapshot(value, step, run.config.memory_budget_mb << 20, background=True)

        try:
            snapshot = run_bounded(snap, budget, "hold-snapshot")
        except MemoryError:
            snapshot = "no memory for a snapshot"
        if isinstance(snapshot, str):
            return Fallback(f"{snapshot}; saving it now")
        record = ShardRecord(
            shard=order.shard,
            step=step,
            file=shard_file_name(order.shard),
            bytes=snapshot.nbytes,
            crc32=0,
            group=order.group,
            rank=order.rank,
            seconds=time.monotonic() - started,
            tier=Place.HELD,
            holders=(ray_identity()["node_id"],),
        )
        run.held.append(HeldShard(snapshot, record, order.keepers, order.namespace, budget))
        return record

    def said(self, record: ShardRecord) -> str:
        return (
            f"{record.bytes} bytes held by this process (a snapshot, copied in the background), "
            "to the keepers once the group trains again"
        )


class HandOffWay:
    """The memory tier: saved once every keeper named holds the shard."""

    place = Place.MEMORY

    def try_save(
        self, run: SaveRun, order: ShardSave, step: int, done: list[str]
    ) -> ShardRecord | Fallback:
        from ..memory.handoff import hand_off

        if order.state is None:
            return Fallback(
                "memory tier: this rank registered a saver=, not state=; saving to disk"
            )
        budget = run.budget(order, done)
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
                run.cycle,
                budget,
                order.group,
                order.rank,
            )

        try:
            return run_bounded(give, budget, "memory-hand-off")
        except Exception as exc:
            if isinstance(exc, TimeoutError) and not captured.is_set():
                # The state itself never came: a disk save would call state() again and hang
                # again, and a backup of this shard waits on this save's failure to start.
                raise TimeoutError(
                    f"the state of shard {order.shard!r} was not captured within its budget "
                    f"of {budget:.1f}s (state_dict() did not return); not tried again on disk"
                ) from None
            return Fallback(f"memory tier: not held ({exc}); saving to disk")

    def said(self, record: ShardRecord) -> str:
        return (
            f"{record.bytes} bytes held in memory on {len(record.holders)} node(s) in "
            f"{record.seconds:.2f}s"
        )


class DiskWay:
    """A file under ``checkpoint_dir``, renamed into place only once complete."""

    place = Place.DISK

    def try_save(
        self, run: SaveRun, order: ShardSave, step: int, done: list[str]
    ) -> ShardRecord | Fallback:
        if not order.root:
            # Memory-only mode (no checkpoint_dir): "saving to disk" would mean the process's
            # working directory. Nothing is written; the shard is missing and the cycle says so.
            why = "not held in memory and no checkpoint_dir is configured: nowhere to save it"
            return Fallback(why + ", nothing written")
        budget = run.budget(order, done)

        def save() -> ShardRecord:
            return write_shard(
                order.root,
                step,
                order.shard,
                order.saver,
                abandoned=run.abandon,
                group=order.group,
                rank=order.rank,
            )

        try:
            return run_bounded(save, budget, "emergency-save")
        except TimeoutError:
            run.abandon.set()
            raise TimeoutError(
                f"save of shard {order.shard!r} exceeded its budget of {budget:.1f}s; "
                "abandoned, never renamed into place"
            ) from None

    def said(self, record: ShardRecord) -> str:
        return f"{record.bytes} bytes in {record.seconds:.2f}s" + (
            " (already committed: kept, not rewritten)" if record.reused else ""
        )


WAYS: dict[Place, SaveWay] = {way.place: way for way in (HoldWay(), HandOffWay(), DiskWay())}


def save_shard(
    run: SaveRun,
    order: ShardSave,
    step: int,
    done: list[str],
    ways: Mapping[Place, SaveWay] = WAYS,
) -> ShardRecord:
    """Try the order's ways in turn; the first record. Each fallback's reason goes in ``done``;
    RuntimeError, led by the last way's reason, once every way fell back. ``ways``: a test's
    own, in place of the real ones."""
    last: Fallback | None = None
    for place in order.ways:
        if last is not None:  # said before the next way tries: its account, in order
            done.append(f"shard {order.shard!r}: {last.why}")
        way = ways[place]
        result = way.try_save(run, order, step, done)
        if isinstance(result, ShardRecord):
            done.append(f"shard {order.shard!r}: {way.said(result)}")
            return result
        last = result
    # The last way's reason leads: it is why the shard is nowhere.
    why = last.why if last is not None else "it has no way to save"
    raise RuntimeError(f"shard {order.shard!r} was not saved: {why} ({'; '.join(done)})")
