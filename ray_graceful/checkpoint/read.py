"""The read side: which committed checkpoint a restart loads, verified before it is trusted.

``latest_committed(root)`` is what a restart loads: the newest manifest whose shard files are
all present with the recorded sizes and checksums (a torn or altered shard is refused, and the
next older checkpoint is taken). A manifest entry must name the shard's own file inside its
step directory, and nothing but plain files and directories is ever opened.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from ..dcp import is_dcp_shard, read_shard_files
from .files import file_checksum, load_state_dict, not_plain, path_size
from .records import FORMAT_VERSION, MANIFEST, CheckpointError, CommittedCheckpoint, ShardRecord

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")


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
    if file_checksum(path) != (record["bytes"], record["crc32"]):
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
        checkpoint, reason = read_committed(step, directory, verify_checksums)
        yield step, directory, checkpoint, reason


def read_manifest(directory: str, step: int) -> tuple[dict[str, Any] | None, str]:
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


def read_committed(
    step: int, directory: str, verify: bool
) -> tuple[CommittedCheckpoint | None, str]:
    manifest, reason = read_manifest(directory, step)
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
            size = path_size(path)
            if size != record.bytes:
                return None, f"shard {key!r}: {size} bytes on disk, {record.bytes} committed"
            if verify and file_checksum(path) != (record.bytes, record.crc32):
                return None, f"shard {key!r}: checksum differs from the committed one (torn)"
        except OSError as exc:
            return None, f"shard {key!r}: {exc}"
        shards[key] = path
    return CommittedCheckpoint(step, directory, shards, manifest), ""
