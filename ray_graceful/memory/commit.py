"""When a memory-tier checkpoint counts as committed - as strict as the manifest on disk.

Every shard of the plan saved at one step, each either held in memory by ``replicas`` keepers
on nodes that survive or written to disk (a shard that did not fit a keeper's budget), never
twice: then the coordinator records a ``MemoryCheckpoint``. It is made durable in the
background (the keepers write their shards, the manifest goes last) and the record says when.
A restart loads from it before any older checkpoint on disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import CheckpointError, ShardRecord, check_shard_set
from ..dcp import DcpError, check_summaries
from ..place import Place


@dataclass
class MemoryCheckpoint:
    """A committed emergency checkpoint some of whose shards live only in keepers' memory."""

    job_id: str
    cycle: int
    step: int
    shards: dict[str, ShardRecord]  # shard key -> its record (tier "memory" or "disk")
    committed_at: float = field(default_factory=time.time)
    durable_path: str | None = None  # the step directory, once the manifest is on disk
    durable_at: float | None = None
    durable_error: str | None = None
    handed_on: list[dict[str, Any]] = field(default_factory=list)  # moved off a leaving node
    lost: str | None = None  # why it can no longer be restored from memory
    checked_at: float = 0.0  # when its holders were last seen alive (coordinator/memory.py)

    def in_memory(self) -> dict[str, tuple[str, ...]]:
        return {k: r.holders for k, r in self.shards.items() if r.tier is Place.MEMORY}

    def describe(self) -> dict[str, Any]:
        return {
            "tier": "memory",
            "step": self.step,
            "holders": {k: list(v) for k, v in sorted(self.in_memory().items())},
            "on_disk": sorted(k for k, r in self.shards.items() if r.tier is Place.DISK),
            "durable_path": self.durable_path,
            "durable_at": self.durable_at,
            "durable_error": self.durable_error,
            "handed_on": list(self.handed_on),
            "lost": self.lost,
        }

    def to_record(self) -> dict[str, Any]:
        """``describe()`` with every shard's record: ``memory-cycle-N.json``, from which a
        restarted coordinator rebuilds this checkpoint (``from_record``)."""
        return {
            **self.describe(),
            "cycle": self.cycle,
            "committed_at": self.committed_at,
            "records": [r.to_dict() for _, r in sorted(self.shards.items())],
        }

    @classmethod
    def from_record(cls, job_id: str, data: dict[str, Any]) -> MemoryCheckpoint:
        """The checkpoint ``to_record`` wrote; CheckpointError if ``data`` is not one."""
        try:
            records = [ShardRecord.from_dict(r) for r in data["records"]]
            memory = cls(job_id, int(data["cycle"]), int(data["step"]), {})
            memory.committed_at = float(data["committed_at"])
            memory.durable_path = data.get("durable_path")
            memory.durable_at = data.get("durable_at")
            memory.durable_error = data.get("durable_error")
            memory.handed_on = list(data.get("handed_on") or [])
            memory.lost = data.get("lost")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"not a memory checkpoint record: {exc!r}") from None
        memory.shards = {r.shard: r for r in records}
        return memory


class LeavingHolders(CheckpointError):
    """Every shard is whole in the keepers' memory, but too few of its holders stay: their
    nodes have notices. Not a memory checkpoint - it would vanish with them - yet the keepers
    still hold it while their nodes drain, so it can be written through to disk
    (``MemoryTier.write_through``) and count as committed once its manifest lands."""

    def __init__(self, reason: str, checkpoint: MemoryCheckpoint) -> None:
        super().__init__(reason)
        self.checkpoint = checkpoint  # every check passed but the holders'


def commit_in_memory(
    job_id: str,
    cycle: int,
    expected: list[str],
    records: list[ShardRecord],
    replicas: int,
    evicted_nodes: frozenset[str] = frozenset(),
) -> MemoryCheckpoint:
    """The memory checkpoint of these records, or CheckpointError saying what is missing.

    A holder on a node with a notice (a late one included: it came after the plan) does not
    count: its keeper goes when the node goes. Where that alone is amiss - each shard held by
    ``replicas`` keepers, too few of them staying - the error is ``LeavingHolders``.
    """
    if not expected:
        raise CheckpointError("refusing to commit a checkpoint with no shards")
    steps = {r.step for r in records}
    if len(steps) > 1:
        raise CheckpointError(f"shards were saved at steps {sorted(steps)}: a checkpoint holds one")
    by_shard: dict[str, ShardRecord] = {}
    leaving: list[str] = []
    for record in records:
        if record.shard in by_shard:
            raise CheckpointError(f"shard {record.shard!r} was saved twice")
        survivors = set(record.holders) - evicted_nodes
        if record.tier is Place.MEMORY and len(survivors) < replicas:
            why = (
                f"shard {record.shard!r} is held by {len(survivors)} node(s) not being "
                f"evicted, memory_replicas is {replicas}; not committed"
            )
            if len(set(record.holders)) < replicas:
                raise CheckpointError(why)
            leaving.append(why)
        by_shard[record.shard] = record
    check_shard_set(expected, by_shard)
    _check_dcp_coverage(by_shard)
    checkpoint = MemoryCheckpoint(job_id, cycle, steps.pop(), by_shard)
    if leaving:
        raise LeavingHolders("; ".join(leaving[:3]), checkpoint)
    return checkpoint


def _check_dcp_coverage(by_shard: dict[str, ShardRecord]) -> None:
    """A dcp_saver group's chunks must cover every tensor, as ``assemble`` demands on disk.

    Checked now, not at the durable copy: a memory checkpoint is committed as of this moment,
    and a restart may load it before any file is written.
    """
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for key, record in by_shard.items():
        if record.dcp_chunks is not None:
            groups.setdefault(key.partition("/")[0], {})[key] = record.dcp_chunks
    for group, summaries in sorted(groups.items()):
        try:
            check_summaries(summaries)
        except (DcpError, TypeError, ValueError) as exc:
            raise CheckpointError(f"group {group!r}: {exc}") from None
