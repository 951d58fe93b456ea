"""What a checkpoint is made of: shard records, a committed checkpoint, and where each lies.

A step's directory is ``step-<8 digits>``; a shard's file inside it is ``shard-<key>.pt``, its
key made safe for a file name (with a checksum of the key where characters had to be replaced,
so two keys never share a file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from ..dcp import dcp_directory, file_safe
from ..place import SHARD_PLACES, Place

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint operation was refused; the message says why."""


@dataclass(frozen=True)
class ShardRecord:
    """One saved shard, as reported by its rank and listed in the manifest."""

    shard: str
    step: int
    file: str  # name inside the step directory
    bytes: int
    crc32: int
    group: str = ""
    rank: int = -1
    seconds: float = 0.0
    reused: bool = False  # the step was already committed: the committed shard was kept
    tier: Place = Place.DISK
    holders: tuple[str, ...] = ()  # memory: the nodes whose keepers hold it
    # memory, a dcp_saver's shard: its chunks (dcp.chunk_summary), checked at the memory commit
    dcp_chunks: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        try:
            tier = Place(self.tier)  # "memory" as well as Place.MEMORY
            if tier not in SHARD_PLACES:
                raise ValueError(tier)
        except ValueError:
            allowed = ", ".join(t.value for t in SHARD_PLACES)
            raise ValueError(f"tier {str(self.tier)[:40]!r} is not one of {allowed}") from None
        object.__setattr__(self, "tier", tier)

    def to_dict(self) -> dict[str, Any]:
        # JSON's shape: read back, equal
        out = {**asdict(self), "holders": list(self.holders), "tier": self.tier.value}
        if out["dcp_chunks"] is None:  # only a memory hand-off of a dcp_saver has them
            del out["dcp_chunks"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardRecord:
        """From a report or a manifest entry; CheckpointError if it is not one."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"a shard record is a mapping, got {type(data).__name__}")
        try:
            values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            if isinstance(values.get("holders"), list):
                values["holders"] = tuple(values["holders"])
            record = cls(**values)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"not a shard record: {exc}") from None
        if record.dcp_chunks is not None and not isinstance(record.dcp_chunks, dict):
            raise CheckpointError(
                f"shard record field dcp_chunks = {record.dcp_chunks!r}: not a mapping"
            )
        kinds = {"shard": str, "file": str, "step": int, "bytes": int, "crc32": int}
        for name, kind in kinds.items():
            value = getattr(record, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(
                    f"shard record field {name} = {value!r}: not a {kind.__name__}"
                )
        if record.file != shard_file_name(record.shard):
            raise CheckpointError(
                f"shard {record.shard!r} names file {record.file!r}; its file is "
                f"{shard_file_name(record.shard)!r} inside its step directory"
            )
        return record


@dataclass(frozen=True)
class CommittedCheckpoint:
    """What ``latest_committed`` returns: a step and where each shard lies."""

    step: int
    path: str
    shards: dict[str, str]  # shard key -> absolute file path
    manifest: dict[str, Any]

    def dcp_path(self, group: str) -> str:
        """The ``checkpoint_id`` to give ``dcp.load`` for ``group`` (savers from ``dcp_saver``)."""
        assembled = self.manifest.get("dcp") or {}
        if not isinstance(assembled, dict) or group not in assembled:
            raise CheckpointError(
                f"group {group!r} has no DCP checkpoint at step {self.step} ({self.path}); "
                f"DCP groups here: {sorted(assembled) if isinstance(assembled, dict) else 'none'}"
            )
        if assembled[group] != dcp_directory(group):  # a manifest names only its own directory
            raise CheckpointError(f"the manifest's DCP directory for {group!r} is not its own")
        return os.path.join(self.path, assembled[group])

    def shard_path(self, shard: str | int) -> str:
        key = str(shard)
        if key not in self.shards:
            raise CheckpointError(
                f"shard {key!r} is not in the checkpoint at step {self.step} ({self.path}); "
                f"it holds {sorted(self.shards)}."
            )
        return self.shards[key]


def check_group_name(group: str, where: str) -> None:
    """CheckpointError unless ``group`` is a name a checkpoint can keep apart from the others:
    "/" separates a group from its shard label in every shard key, so "team/actor" and
    "team/critic" would be read back as one group "team" (one DCP checkpoint for both)."""
    if "/" in group:
        raise CheckpointError(
            f"{where}: group {group!r} is not allowed: a name without '/' (it separates a group "
            "from its shard label in a checkpoint's keys)"
        )


def shard_key(group: str, label: str) -> str:
    """How shard ``label`` of group ``group`` is named in a checkpoint: ``"policy/0"``."""
    return f"{group}/{label}"


class ShardId(NamedTuple):
    """A shard's identity: its group and its label in that group (``ShardId("policy", "0")``).

    The one identity of a shard everywhere: the plan's savers and backups are keyed by it, and
    ``key`` is how a checkpoint, an order and the memory tier name it (``"policy/0"``). It is a
    tuple, so ``("policy", "0")`` is the same shard.
    """

    group: str
    label: str

    @property
    def key(self) -> str:
        return shard_key(self.group, self.label)


def step_dir(root: str, step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step {step!r} is not allowed: must be an int >= 0.")
    return os.path.join(root, f"step-{step:08d}")


def shard_file_name(shard: str) -> str:
    return f"shard-{file_safe(shard)}.pt"
