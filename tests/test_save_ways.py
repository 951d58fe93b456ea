"""The save ways as strategies: an order tries its ways in order, each either saves the shard
(a record of where it lies) or falls back with its reason, which the save's account keeps.
The held and memory ways are stand-ins here (``save_shard``'s ``ways`` seam); the disk way is
the real one, writing a real shard file."""

from __future__ import annotations

import os
import time

import pytest

from ray_graceful import GracefulConfig
from ray_graceful.checkpoint import ShardRecord, save_state_dict, step_dir
from ray_graceful.place import Place
from ray_graceful.worker.save_ways import WAYS, DiskWay, Fallback, SaveRun, ShardSave, save_shard

pytestmark = pytest.mark.unit


class Refusing:
    """A way that always falls back, and counts its tries."""

    def __init__(self, place: Place, why: str) -> None:
        self.place, self.why, self.tries = place, why, 0

    def try_save(self, run, order, step, done):
        self.tries += 1
        return Fallback(self.why)

    def said(self, record):
        raise AssertionError("a refusing way saved nothing")


def saver(path: str, step: int):
    return save_state_dict({"step": step}, path)


def order(root: str = "", **kw) -> ShardSave:
    return ShardSave(root, "g/0", 10.0, saver, "g", 0, **kw)


def run() -> SaveRun:
    return SaveRun(GracefulConfig(), time.monotonic() + 60)


def test_the_ways_of_an_order_are_best_first_and_the_disk_last():
    state = lambda: {}  # noqa: E731
    assert order().ways == (Place.DISK,)
    assert order(keepers=("k",), state=state).ways == (Place.MEMORY, Place.DISK)
    assert order(keepers=("k",), state=state, hold=True).ways == (
        Place.HELD,
        Place.MEMORY,
        Place.DISK,
    )
    # a hold needs the state itself: a saver= alone goes to the hand-off, which says why not
    assert order(keepers=("k",), hold=True).ways == (Place.MEMORY, Place.DISK)
    assert set(WAYS) == {Place.HELD, Place.MEMORY, Place.DISK}


def test_each_way_that_falls_back_says_why_and_the_disk_saves(tmp_path):
    root = str(tmp_path)
    held = Refusing(Place.HELD, "not parked at its step boundary; saving, not held")
    memory = Refusing(Place.MEMORY, "memory tier: not held (keeper full)")
    ways = {Place.HELD: held, Place.MEMORY: memory, Place.DISK: DiskWay()}
    done: list[str] = []
    the_order = order(root, keepers=("k",), state=lambda: {}, hold=True)
    record = save_shard(run(), the_order, 7, done, ways)
    assert isinstance(record, ShardRecord) and record.tier is Place.DISK and record.step == 7
    assert os.path.exists(os.path.join(step_dir(root, 7), record.file))
    assert (held.tries, memory.tries) == (1, 1)
    assert done[0] == "shard 'g/0': not parked at its step boundary; saving, not held"
    assert done[1] == "shard 'g/0': memory tier: not held (keeper full)"
    assert done[2].startswith(f"shard 'g/0': {record.bytes} bytes in ")


def test_the_first_way_that_saves_ends_the_chain(tmp_path):
    class Holding:
        place = Place.HELD

        def try_save(self, run, order, step, done):
            return ShardRecord(order.shard, step, "f", 3, 0, tier=Place.HELD)

        def said(self, record):
            return "held"

    memory = Refusing(Place.MEMORY, "unused")
    ways = {Place.HELD: Holding(), Place.MEMORY: memory, Place.DISK: DiskWay()}
    done: list[str] = []
    the_order = order(str(tmp_path), keepers=("k",), state=lambda: {}, hold=True)
    record = save_shard(run(), the_order, 7, done, ways)
    assert record.tier is Place.HELD and done == ["shard 'g/0': held"]
    assert memory.tries == 0 and not os.path.exists(step_dir(str(tmp_path), 7))


def test_without_a_checkpoint_dir_a_shard_the_keepers_refused_is_not_saved_and_said_so():
    memory = Refusing(Place.MEMORY, "memory tier: not held (keeper full)")
    ways = {Place.MEMORY: memory, Place.DISK: DiskWay()}
    with pytest.raises(RuntimeError) as failed:
        save_shard(run(), order(keepers=("k",), state=lambda: {}), 7, [], ways)
    said = str(failed.value)
    assert "shard 'g/0' was not saved" in said
    assert "keeper full" in said and "no checkpoint_dir is configured" in said
