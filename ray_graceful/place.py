"""``Place``: the one word for where a shard's bytes are, or go.

A shard saved in a cycle lies in one place (``ShardRecord.tier``); a cycle commits in one
(``destination``, written down with a cycle in flight); a save tries places in order (the save
ways, ``worker/save_ways.py``). One enum for all of them, so that a new way to save is one
member here and one class there. A leaf module beside ``word.py``: the checkpoint records, the
coordinator and the worker all read it without importing each other.

Where a rank's state for a resume *came from* (``LoadedFrom``) is a place plus how near it was
(the keeper on this node or another, the rank's own live state or a peer's); it keeps its own
words, each of which names its place (``LoadedFrom.place``).
"""

from __future__ import annotations

from .word import Word


class Place(Word):
    """Where a shard is, or where a cycle's savers put it; compares and serialises as its string."""

    DISK = "disk"  # a file under checkpoint_dir
    MEMORY = "memory"  # held by keepers (memory/), its file not yet written
    # a warm restart's survivor holds it as a snapshot in its own memory, on its way to the
    # keepers (``holders``: the survivor's node) - never part of a committed checkpoint
    HELD = "held"
    RAY_TRAIN = "ray-train"  # the training function reports it to Ray Train: nothing to commit
    NOWHERE = "nowhere"  # no checkpoint_dir and no memory tier: a plan abandons, saying so


# The places a saved shard can lie in (``ShardRecord.tier``).
SHARD_PLACES = (Place.DISK, Place.MEMORY, Place.HELD)


class LoadedFrom(Word):
    """Where a rank's state for a resume came from (``Rejoined.loaded_from``,
    ``LoadedShard.tier``): a place, and how near."""

    OWN_STATE = "own state"  # a warm restart's survivor proved it holds the step: no load
    MEMORY_LOCAL = "memory-local"  # the memory tier, a keeper on this node
    MEMORY_PEER = "memory-peer"  # the memory tier, a keeper on another node
    GROUP_PEER = "group-peer"  # a warm restart: sent by the survivor that holds it, over the group
    DISK = "disk"  # the committed checkpoint on disk

    @property
    def place(self) -> Place:
        """The place the state was in."""
        return _PLACE_OF[self]


_PLACE_OF = {
    LoadedFrom.OWN_STATE: Place.HELD,
    LoadedFrom.GROUP_PEER: Place.HELD,
    LoadedFrom.MEMORY_LOCAL: Place.MEMORY,
    LoadedFrom.MEMORY_PEER: Place.MEMORY,
    LoadedFrom.DISK: Place.DISK,
}


def destination(checkpoint_dir: str | None, memory_replicas: int, train_fn_saves: bool) -> Place:
    """Where a cycle's savers put their shards: Ray Train (the training function reports
    them), the keepers (the memory tier, disk behind), the checkpoint directory, or nowhere."""
    if train_fn_saves:
        return Place.RAY_TRAIN
    if memory_replicas > 0:
        return Place.MEMORY
    return Place.DISK if checkpoint_dir is not None else Place.NOWHERE
