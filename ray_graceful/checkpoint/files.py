"""Durable files: save, fsync, checksum, load, and refuse what is not a plain file.

The byte-level half of the protocol, shared by the write side (a rank's shard, the
coordinator's manifest) and the read side (a restart's verification).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any


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
    reader = threading.Thread(target=lambda: box.setdefault("sum", file_checksum(path)))
    reader.start()
    fsync_tree(path)
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


def file_checksum(path: str) -> tuple[int, int]:
    if os.path.isdir(path):
        size, crc = 0, 0
        for base, _dirs, files in sorted(os.walk(path)):
            for name in sorted(files):
                s, c = file_checksum(os.path.join(base, name))
                size += s
                crc = zlib.crc32(c.to_bytes(4, "little"), crc)
        return size, crc
    # Read through a mapping of the file, not into buffers: an 8 MB bytes object per chunk, made
    # on a thread of each save's own, stayed in that thread's allocator arena, and a keeper that
    # wrote one shard per eviction grew by about one shard an eviction (``heap.py``).
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, 0
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
            return size, zlib.crc32(mapped)


def fsync_tree(path: str) -> None:
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for base, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(base, name))
        fsync_path(base)


def path_size(path: str) -> int | None:
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(b, n)) for b, _d, files in os.walk(path) for n in files
        )
    try:
        return os.path.getsize(path)
    except OSError:
        return None


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


def replace_uncommitted(tmp: str, final: str) -> None:
    """Put ``tmp`` at ``final``: a file atomically; an old directory is moved aside first.

    Only ever called for an uncommitted step (a leftover of a save that was not committed),
    so nothing a restart could load is lost at any point.
    """
    if os.path.isdir(final) and not os.path.islink(final):
        aside = f"{final}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)
        os.replace(tmp, final)
        remove_path(aside)
    else:
        os.replace(tmp, final)


def remove_path(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    except OSError:
        pass


def write_json_atomic(path: str, payload: Mapping[str, Any], exclusive: bool = False) -> None:
    """Write ``payload`` to ``path`` whole or not at all (a temporary file of this thread's
    own, fsynced, then moved into place).

    ``exclusive``: never replace an existing ``path`` - ``FileExistsError`` instead. A manifest
    is written so: two writers of the same step (two threads or two processes) cannot both
    succeed, and a committed one is never replaced. Where the filesystem has no hard links,
    the check and the move are two steps.
    """
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    try:
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    fsync_path(os.path.dirname(path) or ".")


def _link_new(tmp: str, path: str) -> None:
    """``tmp`` at ``path`` unless ``path`` exists (``FileExistsError``)."""
    try:
        os.link(tmp, path)  # atomic, and fails where the name is taken
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network or FUSE filesystems)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "already exists", path) from None
        os.replace(tmp, path)
