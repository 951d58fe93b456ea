"""The write side: a rank's shard lands atomically, the coordinator's manifest commits.

A rank writes its shard to a temporary name, fsyncs it, and renames it into place; a save that
is abandoned (over budget, raised, killed) never gets its final name. ``commit`` writes the
manifest only when every shard of the topology was saved at the same step, so a checkpoint is
either complete and listed, or not listed at all. A committed step is never modified: a save at
an already committed step keeps the committed shard and reports it as reused.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..dcp import DcpError, assemble, is_dcp_shard
from .files import (
    file_checksum,
    fsync_path,
    not_plain,
    path_size,
    remove_path,
    replace_uncommitted,
    sync_and_checksum,
    write_json_atomic,
)
from .read import read_manifest
from .records import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    ShardRecord,
    check_group_name,
    shard_file_name,
    step_dir,
)


def write_shard(
    root: str,
    step: int,
    shard: str,
    saver: Callable[[str, int], tuple[int, int] | None],
    abandoned: threading.Event | None = None,
    group: str = "",
    rank: int = -1,
) -> ShardRecord:
    """Save one shard atomically: ``saver(tmp_path, step)``, fsync, rename into place.

    ``saver`` may write a file or a directory at ``tmp_path`` (DCP writes directories). If it
    returns ``(bytes, crc32)`` they are trusted (the default saver computes them while writing);
    otherwise the result is read back once to compute them. If ``abandoned`` is set by the time
    the saver returns (the teardown gave up on it), the temp result is removed, never renamed.
    """
    if not root:
        raise CheckpointError(
            f"shard {shard!r}: no checkpoint directory given (an empty root would write into the "
            "working directory)"
        )
    check_group_name(group, f"shard {shard!r}")
    directory = step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    name = shard_file_name(shard)
    committed = _committed_record(directory, step, shard)
    if committed is not None:
        return ShardRecord(**{**committed.to_dict(), "group": group, "rank": rank, "reused": True})
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}")
    started = time.monotonic()
    try:
        result = saver(tmp, step)
        if not os.path.exists(tmp):
            raise CheckpointError(f"the saver returned without writing anything at {tmp}")
        if result is None:
            size, crc = sync_and_checksum(tmp)
        else:
            size, crc = result
        if abandoned is not None and abandoned.is_set():
            raise CheckpointError("save abandoned by the teardown (over budget); not renamed")
        if _committed_record(directory, step, shard) is not None:  # committed meanwhile
            raise CheckpointError(f"step {step} was committed during the save; left as it is")
        replace_uncommitted(tmp, final)
        fsync_path(directory)
    except BaseException:
        remove_path(tmp)
        raise
    return ShardRecord(shard, step, name, size, crc, group, rank, time.monotonic() - started)


def _committed_record(directory: str, step: int, shard: str) -> ShardRecord | None:
    """The committed record of ``shard`` at this step, if the step is committed.

    A committed step that lacks the shard is an error: it is never modified.
    """
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(manifest_path):
        return None
    manifest, reason = read_manifest(directory, step)
    if manifest is None:
        raise CheckpointError(
            f"step {step} at {directory} has a manifest that cannot be read ({reason}); "
            "nothing is written next to it"
        )
    raw = manifest["shards"].get(shard)
    if raw is None:
        raise CheckpointError(
            f"step {step} is committed without shard {shard!r}; a committed checkpoint is "
            "never modified"
        )
    return ShardRecord.from_dict(raw)


def check_shard_set(expected: list[str], saved: Mapping[str, Any], where: str = "") -> None:
    """CheckpointError unless ``saved`` holds exactly the ``expected`` shards."""
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointError(f"shards {missing} were not saved{where}; not committed")
    unexpected = sorted(set(saved) - set(expected))
    if unexpected:
        raise CheckpointError(f"shards {unexpected} are not in the topology; not committed")


def commit(
    root: str,
    step: int,
    expected_shards: list[str],
    records: list[ShardRecord],
    cycle: int = 0,
    extra: Mapping[str, Any] | None = None,
    verify: Collection[str] = (),
) -> str:
    """Write the manifest - only if every expected shard was saved at ``step``.

    Raises CheckpointError (and writes nothing) when a shard is missing, saved at another
    step, saved twice with a file on disk that is neither save, or its file is not on disk with
    the recorded size. ``verify``: shards whose file another writer may have renamed over the
    recorded save (a rank found faulty after the plan): read back, checked against the record.
    """
    if not expected_shards:
        raise CheckpointError("refusing to commit a checkpoint with no shards")
    for record in records:
        check_group_name(record.group, f"shard {record.shard!r}")
    by_shard, twice = _one_record_per_shard(records, step)
    check_shard_set(expected_shards, by_shard, f" at step {step}")
    directory = step_dir(root, step)
    with _step_lock(directory):  # one commit of a step at a time in this process
        return _commit_in(
            directory, step, expected_shards, by_shard, twice, records, cycle, extra, verify
        )


def _commit_in(
    directory: str,
    step: int,
    expected_shards: list[str],
    by_shard: dict[str, ShardRecord],
    twice: dict[str, list[ShardRecord]],
    records: list[ShardRecord],
    cycle: int,
    extra: Mapping[str, Any] | None,
    verify: Collection[str],
) -> str:
    """``commit``'s writing part, under the step's lock: the manifest is read first, so a
    writer that lost never rewrites the DCP metadata behind a committed manifest."""
    existing, _reason = read_manifest(directory, step)
    if existing is not None:
        _kept_as_it_is(existing, step, expected_shards)
        return os.path.join(directory, MANIFEST)  # committed before: kept as it is
    for shard, saves in twice.items():
        by_shard[shard] = _the_save_on_disk(directory, step, shard, saves)
    for record in by_shard.values():
        _check_on_disk(directory, record, read_back=record.shard in verify)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "cycle": cycle,
        "committed_at": time.time(),
        "shards": {k: by_shard[k].to_dict() for k in sorted(by_shard)},
        **(dict(extra) if extra else {}),
    }
    dcp_groups: dict[str, list[str]] = {}
    for record in records:
        if is_dcp_shard(os.path.join(directory, record.file)):
            group = record.group or record.shard.partition("/")[0]
            dcp_groups.setdefault(group, []).append(record.file)
    if dcp_groups:  # the savers wrote DCP: one global .metadata per group, before the manifest
        try:
            manifest["dcp"] = assemble(directory, dcp_groups)
        except DcpError as exc:
            raise CheckpointError(str(exc)) from None
    path = os.path.join(directory, MANIFEST)
    try:
        write_json_atomic(path, manifest, exclusive=True)
    except FileExistsError:
        existing, _reason = read_manifest(directory, step)
        if existing is None:
            raise  # the name is taken by what is no manifest: an I/O failure, nothing replaced
        _kept_as_it_is(existing, step, expected_shards)  # another writer committed it meanwhile
    return path


_STEP_LOCKS = tuple(threading.Lock() for _ in range(64))  # striped: bounded, never dropped


def _step_lock(directory: str) -> threading.Lock:
    """The lock of one step's directory: the coordinator commits on threads, and two commits of
    one step (a held step's durable copy and the next cycle's) shared the DCP metadata's
    temporary name - one failed, and the one that lost rewrote it behind the manifest."""
    return _STEP_LOCKS[hash(os.path.realpath(directory)) % len(_STEP_LOCKS)]


def _kept_as_it_is(existing: Mapping[str, Any], step: int, expected_shards: list[str]) -> None:
    """A step committed already: fine with the same shards (kept as it is), else refused."""
    if sorted(existing["shards"]) != sorted(expected_shards):
        raise CheckpointError(
            f"step {step} is already committed with shards {sorted(existing['shards'])}; "
            "a committed checkpoint is never modified"
        )


def _one_record_per_shard(
    records: list[ShardRecord], step: int
) -> tuple[dict[str, ShardRecord], dict[str, list[ShardRecord]]]:
    """Each shard's record, and the shards saved more than once (every save of each)."""
    by_shard: dict[str, ShardRecord] = {}
    twice: dict[str, list[ShardRecord]] = {}
    for record in records:
        if record.step != step:
            raise CheckpointError(
                f"shard {record.shard!r} was saved at step {record.step}, not {step}; "
                "a checkpoint holds one step."
            )
        if record.shard in by_shard:
            twice.setdefault(record.shard, [by_shard[record.shard]]).append(record)
        by_shard.setdefault(record.shard, record)
    return by_shard, twice


def _check_on_disk(directory: str, record: ShardRecord, read_back: bool = False) -> None:
    """The shard's file is its own, a plain file, and of the recorded size - and, to
    ``read_back``, of the recorded CRC32; else refused."""
    if record.file != shard_file_name(record.shard):
        raise CheckpointError(
            f"shard {record.shard!r} reports file {record.file!r}, not its own "
            f"{shard_file_name(record.shard)!r}; not committed"
        )
    path = os.path.join(directory, record.file)
    problem = not_plain(path)
    if problem:
        raise CheckpointError(f"shard {record.shard!r} refused: {problem}")
    size = path_size(path)
    if size != record.bytes:
        raise CheckpointError(
            f"shard {record.shard!r}: {path} has {size} bytes on disk, the report says "
            f"{record.bytes}; not committed"
        )
    if read_back and file_checksum(path) != (record.bytes, record.crc32):
        raise CheckpointError(
            f"shard {record.shard!r}: {path} is not the save kept (CRC32 {record.crc32:08x}): "
            "another writer renamed its own over it; not committed"
        )


def _the_save_on_disk(
    directory: str, step: int, shard: str, saves: list[ShardRecord]
) -> ShardRecord:
    """Of the saves of one shard at one step, the one whose file is on disk.

    It happens when a rank left alone while the coordinator restarted and saved its shard, and
    the plan then had a replica save the same shard: each renamed a complete file into the same
    place, so the file there is one of them - the same step of a replicated shard, which either
    replica's save stands for. Its size and CRC32 say which record is its own; a file that is
    neither (a third writer, a torn one) is never committed.
    """
    twice = f"shard {shard!r} was saved twice at step {step}"
    path = os.path.join(directory, shard_file_name(shard))
    problem = not_plain(path)
    if problem:
        raise CheckpointError(f"{twice}, and its file is refused: {problem}")
    on_disk = file_checksum(path)
    for record in saves:
        if record.file == shard_file_name(shard) and (record.bytes, record.crc32) == on_disk:
            return record
    raise CheckpointError(
        f"{twice}, and {path} is neither save ({on_disk[0]} bytes, CRC32 {on_disk[1]:08x}); "
        "not committed"
    )
