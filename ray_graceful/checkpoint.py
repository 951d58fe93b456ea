"""The emergency-checkpoint protocol: shards land atomically, a manifest written last commits.

Layout under a checkpoint root::

    step-00000120/
        shard-<key>.pt          one per shard, each renamed into place only once complete
        MANIFEST.json           written last, by the coordinator: the checkpoint is committed

A rank writes its shard to a temporary name, fsyncs it, and renames it into place; a save that
is abandoned (over budget, raised, killed) never gets its final name. The coordinator writes the
manifest only when every shard of the topology was saved at the same step, so a checkpoint is
either complete and listed, or not listed at all. ``latest_committed(root)`` is what a restart
loads: the newest manifest whose shard files are all present with the recorded sizes and
checksums (a torn or altered shard is refused, and the next older checkpoint is taken).

A committed checkpoint is never touched again. A save at a step that is already committed (a
notice in the first step after a resume) keeps the committed shard and reports it as reused;
a manifest entry must name the shard's own file inside its step directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .dcp import DcpError, assemble, dcp_directory, is_dcp_shard, read_shard_files
from .protocol import shard_key

logger = logging.getLogger(__name__)

__all__ = ["shard_key"]  # re-exported: checkpoints name shards as the protocol does

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")

Saver = Callable[[str, int], None]


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
    tier: str = "disk"  # "memory": held by keepers (memory/), its file not yet written
    holders: tuple[str, ...] = ()  # memory: the nodes whose keepers hold it
    # memory, a dcp_saver's shard: its chunks (dcp.chunk_summary), checked at the memory commit
    dcp_chunks: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "holders": list(self.holders)}  # JSON's shape: read back, equal
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
        except TypeError as exc:
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


def step_dir(root: str, step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step {step!r} is not allowed: must be an int >= 0.")
    return os.path.join(root, f"step-{step:08d}")


def shard_file_name(shard: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", shard)
    if safe != shard or not safe:
        safe = f"{safe}-{zlib.crc32(shard.encode()):08x}"
    return f"shard-{safe}.pt"


def save_state_dict(state: Any, path: str) -> tuple[int, int]:
    """Default saver: ``torch.save`` to ``path``, durable; returns (bytes, crc32).

    ``torch.save`` given a path takes its fast C++ writer (a Python file object is ~2x slower).
    The fsync and the CRC32 then run side by side (``sync_and_checksum``).
    """
    import torch

    torch.save(state, path)
    return sync_and_checksum(path)


def sync_and_checksum(path: str) -> tuple[int, int]:
    """fsync ``path`` (a file or a tree) and return its (bytes, crc32), side by side.

    The checksum reads back from the page cache while the flush runs, so it costs next to
    nothing over the fsync that durability needs anyway (done one after the other, it was
    a quarter of a DCP save's time).
    """
    box: dict[str, tuple[int, int]] = {}
    reader = threading.Thread(target=lambda: box.setdefault("sum", _file_checksum(path)))
    reader.start()
    _fsync_tree(path)
    reader.join()
    return box["sum"]


def load_state_dict(path: str, map_location: Any = "cpu") -> Any:
    """Load what ``save_state_dict`` wrote: tensors, numbers, strings and containers only.

    ``weights_only=True``: a checkpoint file cannot run code when loaded.
    """
    import torch

    return torch.load(path, map_location=map_location, weights_only=True)


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_checksum(path: str) -> tuple[int, int]:
    if os.path.isdir(path):
        size, crc = 0, 0
        for base, _dirs, files in sorted(os.walk(path)):
            for name in sorted(files):
                s, c = _file_checksum(os.path.join(base, name))
                size += s
                crc = zlib.crc32(c.to_bytes(4, "little"), crc)
        return size, crc
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _fsync_tree(path: str) -> None:
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for base, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(base, name))
        fsync_path(base)


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
        _replace_uncommitted(tmp, final)
        fsync_path(directory)
    except BaseException:
        _remove(tmp)
        raise
    return ShardRecord(shard, step, name, size, crc, group, rank, time.monotonic() - started)


def _committed_record(directory: str, step: int, shard: str) -> ShardRecord | None:
    """The committed record of ``shard`` at this step, if the step is committed.

    A committed step that lacks the shard is an error: it is never modified.
    """
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(manifest_path):
        return None
    manifest, reason = _read_manifest(directory, step)
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


def _replace_uncommitted(tmp: str, final: str) -> None:
    """Put ``tmp`` at ``final``: a file atomically; an old directory is moved aside first.

    Only ever called for an uncommitted step (a leftover of a save that was not committed),
    so nothing a restart could load is lost at any point.
    """
    if os.path.isdir(final) and not os.path.islink(final):
        aside = f"{final}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)
        os.replace(tmp, final)
        _remove(aside)
    else:
        os.replace(tmp, final)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    except OSError:
        pass


def _write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


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
) -> str:
    """Write the manifest - only if every expected shard was saved at ``step``.

    Raises CheckpointError (and writes nothing) when a shard is missing, saved at another
    step, duplicated, or its file is not on disk with the recorded size.
    """
    if not expected_shards:
        raise CheckpointError("refusing to commit a checkpoint with no shards")
    by_shard: dict[str, ShardRecord] = {}
    for record in records:
        if record.step != step:
            raise CheckpointError(
                f"shard {record.shard!r} was saved at step {record.step}, not {step}; "
                "a checkpoint holds one step."
            )
        if record.shard in by_shard:
            raise CheckpointError(f"shard {record.shard!r} was saved twice at step {step}")
        by_shard[record.shard] = record
    check_shard_set(expected_shards, by_shard, f" at step {step}")
    directory = step_dir(root, step)
    existing, _reason = _read_manifest(directory, step)
    if existing is not None:
        if sorted(existing["shards"]) != sorted(expected_shards):
            raise CheckpointError(
                f"step {step} is already committed with shards {sorted(existing['shards'])}; "
                "a committed checkpoint is never modified"
            )
        return os.path.join(directory, MANIFEST)  # committed before: kept as it is
    for record in by_shard.values():
        if record.file != shard_file_name(record.shard):
            raise CheckpointError(
                f"shard {record.shard!r} reports file {record.file!r}, not its own "
                f"{shard_file_name(record.shard)!r}; not committed"
            )
        path = os.path.join(directory, record.file)
        problem = not_plain(path)
        if problem:
            raise CheckpointError(f"shard {record.shard!r} refused: {problem}")
        size = _path_size(path)
        if size != record.bytes:
            raise CheckpointError(
                f"shard {record.shard!r}: {path} has {size} bytes on disk, the report says "
                f"{record.bytes}; not committed"
            )
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
            dcp_groups.setdefault(record.shard.partition("/")[0], []).append(record.file)
    if dcp_groups:  # the savers wrote DCP: one global .metadata per group, before the manifest
        try:
            manifest["dcp"] = assemble(directory, dcp_groups)
        except DcpError as exc:
            raise CheckpointError(str(exc)) from None
    path = os.path.join(directory, MANIFEST)
    _write_json_atomic(path, manifest)
    return path


def _path_size(path: str) -> int | None:
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(b, n)) for b, _d, files in os.walk(path) for n in files
        )
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def load_committed_shard(checkpoint: CommittedCheckpoint, shard: str) -> Any:
    """Load one shard of a committed checkpoint, checking it against its committed checksum.

    What a restarted rank does: it verifies the shard it loads, not every shard of the
    checkpoint (``latest_committed(verify_checksums=True)`` reads them all - per rank, the whole
    checkpoint). A torn shard raises ``CheckpointError``: falling back to an older step here
    while the other ranks load this one would mix steps within the group.
    """
    path = checkpoint.shard_path(shard)
    record = checkpoint.manifest["shards"][shard]
    problem = not_plain(path)
    if problem:
        raise CheckpointError(f"shard {shard!r} at step {checkpoint.step} refused: {problem}")
    if _file_checksum(path) != (record["bytes"], record["crc32"]):
        raise CheckpointError(
            f"shard {shard!r} of the committed checkpoint at step {checkpoint.step} ({path}) "
            "does not match its committed checksum (torn or modified). "
            f"latest_committed({os.path.dirname(checkpoint.path)!r}) names the newest intact "
            "step; move the damaged step directory aside to resume from it."
        )
    if is_dcp_shard(path):  # a dcp_saver's directory: the same form the memory tier holds
        return {"step": checkpoint.step, "state": read_shard_files(path)}
    return load_state_dict(path)  # read again, from the page cache the checksum filled


def latest_committed(root: str, verify_checksums: bool = True) -> CommittedCheckpoint | None:
    """The newest committed, intact checkpoint under ``root``, or None.

    Skips, with a logged reason, a step directory with no manifest (a save that did not
    finish), a manifest that is unreadable, torn or of the wrong shape, and one whose shard
    files are missing, of the wrong size, or (``verify_checksums``, the default) of the wrong
    content. Verifying reads every shard once; pass False only where the storage itself is
    trusted to catch corruption.
    """
    for step, directory, checkpoint, reason in scan_checkpoints(root, verify_checksums):
        if checkpoint is not None:
            return checkpoint
        if reason != "no manifest (not committed)":
            logger.warning(
                "ray_graceful: skipped checkpoint step %s (%s): %s", step, directory, reason
            )
    return None


def scan_checkpoints(
    root: str, verify_checksums: bool = True
) -> Iterator[tuple[int, str, CommittedCheckpoint | None, str]]:
    """Every step directory under ``root``, newest first: (step, dir, checkpoint, why not)."""
    if not os.path.isdir(root):
        return
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match:
            steps.append((int(match.group(1)), os.path.join(root, name)))
    for step, directory in sorted(steps, reverse=True):
        if os.path.islink(directory) or not os.path.isdir(directory):
            yield step, directory, None, "the step directory is not a plain directory (a link?)"
            continue
        checkpoint, reason = _read_committed(step, directory, verify_checksums)
        yield step, directory, checkpoint, reason


def not_plain(path: str) -> str | None:
    """Why ``path`` is not a plain file or a tree of plain files and directories, or None.

    A checkpoint is read only from what its own directory holds: a symbolic link (it may point
    anywhere, outside the root included), a FIFO (reading it blocks forever), a socket or a
    device is refused, at any depth, without being opened or followed.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return f"{os.path.basename(path)}: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    if not stat.S_ISDIR(mode):
        return f"{os.path.basename(path)} is {_kind(mode)}, not a plain file or directory"
    for base, dirs, files in os.walk(path):  # never follows links
        for name in dirs + files:
            inner = os.path.join(base, name)
            inner_mode = os.lstat(inner).st_mode
            if not (stat.S_ISREG(inner_mode) or stat.S_ISDIR(inner_mode)):
                where = os.path.relpath(inner, os.path.dirname(path))
                return f"{where} is {_kind(inner_mode)}, not a plain file or directory"
    return None


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def _read_manifest(directory: str, step: int) -> tuple[dict[str, Any] | None, str]:
    """The manifest of a step directory if it is well formed, else (None, why)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        return None, "no manifest (not committed)"
    problem = not_plain(path) or (f"{MANIFEST} is a directory" if os.path.isdir(path) else None)
    if problem:
        return None, f"manifest refused: {problem}"
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read(16 << 20))
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"manifest unreadable: {type(exc).__name__}: {str(exc)[:200]}"
    if not isinstance(manifest, dict):
        return None, f"manifest is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != FORMAT_VERSION:
        return None, f"manifest format {str(manifest.get('format'))[:40]!r}, not {FORMAT_VERSION}"
    if manifest.get("step") != step:
        return None, f"manifest says step {str(manifest.get('step'))[:40]}, its directory {step}"
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or not shards:
        return None, 'manifest lists no shards ("shards" must be a non-empty object)'
    return manifest, ""


def _read_committed(
    step: int, directory: str, verify: bool
) -> tuple[CommittedCheckpoint | None, str]:
    manifest, reason = _read_manifest(directory, step)
    if manifest is None:
        return None, reason
    shards = {}
    for key, raw in manifest["shards"].items():
        try:
            record = ShardRecord.from_dict(raw)
        except CheckpointError as exc:
            return None, f"shard {str(key)[:80]!r}: {exc}"
        if record.shard != key or record.step != step:
            return (
                None,
                f"shard {str(key)[:80]!r}: its record says {record.shard!r} step {record.step}",
            )
        path = os.path.join(directory, record.file)
        problem = not_plain(path)
        if problem:
            return None, f"shard {key!r} refused: {problem}"
        try:
            size = _path_size(path)
            if size != record.bytes:
                return None, f"shard {key!r}: {size} bytes on disk, {record.bytes} committed"
            if verify and _file_checksum(path) != (record.bytes, record.crc32):
                return None, f"shard {key!r}: checksum differs from the committed one (torn)"
        except OSError as exc:
            return None, f"shard {key!r}: {exc}"
        shards[key] = path
    return CommittedCheckpoint(step, directory, shards, manifest), ""
