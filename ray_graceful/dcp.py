"""Emergency checkpoints in PyTorch's DCP format, written without a collective.

An ordinary ``torch.distributed.checkpoint.save`` is collective: every rank plans, rank 0
writes one global ``.metadata``. An emergency save cannot be: its peers were released before
the save began. So here:

- each designated saver writes only its own local chunks (of DTensors and plain tensors) with
  ``dcp.save(..., no_dist=True, use_collectives=False)``: its data file and a metadata file of
  its own, in its shard's directory - no barrier, no process group call (``dcp_saver``);
- at commit, the coordinator merges the savers' metadata into the one global ``.metadata``
  that PyTorch's own loader reads, in ``step-N/dcp-<group>/`` (``assemble``). Every tensor's
  chunks must cover it exactly - each element once - or nothing is committed and the error
  names the tensor. The manifest is still written last, after it.

The user loads with PyTorch's loader, at the same world size or another (resharding is DCP's)::

    dcp.load(state_dict, checkpoint_id=latest_committed(root).dcp_path("policy"))

Checked with torch 2.13 (``no_dist`` and ``use_collectives`` are ``dcp.save`` parameters; the
per-saver metadata file is ``__0.metadata``). Only public DCP names are used: the metadata
types of ``torch.distributed.checkpoint.metadata`` and ``dataclasses.replace`` on a storage
record. Like DCP's own loader, the merge unpickles metadata files: the checkpoint directory is
trusted storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import pickle
import re
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


class DcpError(ValueError):
    """The savers' DCP chunks do not make one checkpoint; the message names the tensor."""


LOCAL_METADATA = "__0.metadata"  # what dcp.save(no_dist=True, use_collectives=False) writes
GLOBAL_METADATA = ".metadata"  # what dcp.load reads
DCP_FILES = "dcp_files"  # a DCP shard as the memory tier holds it: {DCP_FILES: {name: bytes}}
DIR_PREFIX = "dcp-"


class DcpSaver:
    """A saver (``saver(path, step)``) that writes one rank's local chunks in DCP's format.

    Made by ``dcp_saver``. Beside the disk save it serves the memory tier: ``in_memory`` gives
    the same files as bytes for the keepers (whose durable copy then writes the same
    directory), and ``restore`` loads this rank's own chunks back from either, at the same
    topology (a warm restart's spare, or a rank whose step differs).
    """

    def __init__(self, state_dict: Callable[[], dict[str, Any]]) -> None:
        self.state_dict = state_dict

    def __call__(self, path: str, step: int) -> None:
        # No fsync per file here: write_shard fsyncs the directory beside its checksum.
        _save_local(self.state_dict(), path, sync=False)

    def in_memory(self) -> dict[str, Any]:
        """This rank's DCP files as the memory tier holds them: ``{DCP_FILES: {name: bytes}}``.

        Written by DCP's own writer into a scratch directory in memory (``/dev/shm`` where
        there is one), then read as uint8 tensors: the memory tier ships them as it ships any
        tensor, and counts their bytes against the keepers' budgets.
        """
        with _scratch() as scratch:
            target = os.path.join(scratch, "shard")
            _save_local(self.state_dict(), target, sync=False)
            return read_shard_files(target)

    def restore(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """Load this rank's own chunks from ``loaded`` (``load_latest(...).state``) in place.

        Returns ``state_dict()`` with the loaded values (DCP loads into its tensors; values
        that are not tensors are replaced in the returned dict: apply it as after
        ``dcp.load``). The rank must hold the chunks it saved - the same shard at the same
        world size; another world size loads the assembled checkpoint with ``dcp.load``.
        """
        import torch.distributed.checkpoint as dcp

        if not is_shard_files(loaded):
            raise DcpError(
                "restore() takes what load_latest() / a warm restart loaded for a dcp_saver "
                f"rank, a dict with {DCP_FILES!r}; got {type(loaded).__name__}"
            )
        state = self.state_dict()
        with _scratch() as scratch:
            write_shard_files(loaded, scratch, sync=False)
            os.replace(
                os.path.join(scratch, LOCAL_METADATA), os.path.join(scratch, GLOBAL_METADATA)
            )
            with _single_process_is_meant():
                dcp.load(state, storage_reader=dcp.FileSystemReader(scratch), no_dist=True)
        return state


def dcp_saver(state_dict: Callable[[], dict[str, Any]]) -> DcpSaver:
    """A saver for ``graceful_setup(saver=...)``: this rank's state in DCP's on-disk format.

    ``state_dict()`` returns what ``dcp.save`` takes (an FSDP2 / DTensor model's state dict,
    optimizer state, plain values). Only this rank's local chunks are written, with no
    collective; the coordinator assembles the global metadata at commit. With the memory tier
    on, the same files are held in keepers' memory and their durable copy is this directory.
    """
    if not callable(state_dict):
        raise TypeError(f"dcp_saver(state_dict={state_dict!r}): give a callable")
    return DcpSaver(state_dict)


def _save_local(state: dict[str, Any], path: str, sync: bool) -> None:
    import torch.distributed.checkpoint as dcp

    os.makedirs(path)
    with _single_process_is_meant():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path, sync_files=sync),
            no_dist=True,
            use_collectives=False,
        )


@contextlib.contextmanager
def _single_process_is_meant() -> Iterator[None]:
    """DCP warns that it "assumes" a single process when given ``no_dist``: here it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _scratch() -> tempfile.TemporaryDirectory[str]:
    """A directory in memory (``/dev/shm`` where there is one), removed on leaving."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.TemporaryDirectory(
        prefix="ray-graceful-dcp-", dir=shm, ignore_cleanup_errors=True
    )


def read_shard_files(path: str) -> dict[str, Any]:
    """A saver's DCP directory as ``{DCP_FILES: {name: uint8 tensor}}`` (files at its top)."""
    import numpy as np
    import torch

    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise DcpError(f"{path}: {name} is not a file; a DCP shard holds files only")
        files[name] = torch.from_numpy(np.fromfile(full, dtype=np.uint8))
    if LOCAL_METADATA not in files:
        raise DcpError(f"{path} holds no {LOCAL_METADATA}: not a dcp_saver's shard")
    return {DCP_FILES: files}


def write_shard_files(shard: dict[str, Any], path: str, sync: bool = True) -> None:
    """Write ``read_shard_files``' result back as a directory at ``path`` (made if missing)."""
    os.makedirs(path, exist_ok=True)
    for name, data in shard[DCP_FILES].items():
        if os.sep in name or name in ("", ".", ".."):
            raise DcpError(f"a DCP shard's file is named {name!r}: not a plain file name")
        with open(os.path.join(path, name), "wb") as f:
            f.write(memoryview(data.numpy()))
            if sync:
                f.flush()
                os.fsync(f.fileno())


def is_shard_files(value: Any) -> bool:
    """Whether ``value`` is a DCP shard as the memory tier holds it."""
    return isinstance(value, dict) and isinstance(value.get(DCP_FILES), dict)


def chunk_summary(shard: dict[str, Any]) -> dict[str, list[Any]]:
    """Per tensor, ``[size, dtype, [[offsets, sizes], ...]]`` of the chunks this shard holds.

    What the coordinator needs to check coverage at a memory commit, before any file exists
    on disk; plain lists, so it travels in a report.
    """
    return _summary(pickle.loads(shard[DCP_FILES][LOCAL_METADATA].numpy().tobytes()))


def _summary(local: Any) -> dict[str, list[Any]]:
    """``chunk_summary`` of one saver's unpickled ``Metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        fqn: [
            list(entry.size),
            str(entry.properties.dtype),
            [[list(c.offsets), list(c.sizes)] for c in entry.chunks],
        ]
        for fqn, entry in local.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def check_summaries(summaries: dict[str, dict[str, list[Any]]]) -> None:
    """``DcpError`` unless the savers' chunks (source -> ``chunk_summary``) cover every tensor.

    The memory tier's form of the check ``assemble`` makes on disk: replicas' identical chunks
    count once; every element must be in exactly one chunk.
    """
    tensors: dict[str, tuple[list[int], str, dict[tuple[Any, ...], None]]] = {}
    for source, summary in sorted(summaries.items()):
        for fqn, (size, dtype, chunks) in summary.items():
            held = tensors.setdefault(fqn, (list(size), dtype, {}))
            if held[0] != list(size) or held[1] != dtype:
                raise DcpError(
                    f"tensor {fqn!r}: {source} saved it as {list(size)} {dtype}, another "
                    f"saver as {held[0]} {held[1]}"
                )
            for offsets, sizes in chunks:
                held[2].setdefault((tuple(offsets), tuple(sizes)), None)
    for fqn, (size, _dtype, boxes) in tensors.items():
        _check_coverage(fqn, size, [(list(o), list(s)) for o, s in boxes])


def is_dcp_shard(path: str) -> bool:
    """Whether a saved shard is a DCP saver's directory."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, LOCAL_METADATA))


def assemble(step_directory: str, shards: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Write each group's global ``.metadata``; returns {group: its directory, relative}.

    ``shards`` maps a group to the shard directories (names inside ``step_directory``) its
    savers wrote. Raises ``DcpError`` naming the tensor whose chunks do not cover it.
    """
    out = {}
    for group, names in sorted(shards.items()):
        metadata = merge(step_directory, sorted(names))
        relative = dcp_directory(group)
        directory = os.path.join(step_directory, relative)
        os.makedirs(directory, exist_ok=True)
        final = os.path.join(directory, GLOBAL_METADATA)
        data = pickle.dumps(metadata)
        if _holds(final, data):
            out[group] = relative  # another writer of this step wrote the same: left as it is
            continue
        # a name of this writer's own: two commits of one step never share a temporary file
        tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        fd = os.open(directory, os.O_RDONLY)  # the rename, durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        out[group] = relative
    return out


def _holds(path: str, data: bytes) -> bool:
    """Whether the file at ``path`` holds exactly ``data``."""
    try:
        if os.path.getsize(path) != len(data):
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def merge(step_directory: str, shard_dirs: list[str]) -> Any:
    """One ``Metadata`` from the savers' own, their files named relative to ``dcp-<group>/``."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    locals_ = {}
    for name in shard_dirs:
        with open(os.path.join(step_directory, name, LOCAL_METADATA), "rb") as f:
            locals_[name] = pickle.load(f)
    check_summaries({name: _summary(local) for name, local in locals_.items()})
    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for name, local in locals_.items():
        for fqn, entry in local.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                _add_chunks(tensors, fqn, entry)
            else:
                others.setdefault(fqn, entry)
        for index, info in local.storage_data.items():
            path = f"../{name}/{info.relative_path}"
            storage.setdefault(index, dataclasses.replace(info, relative_path=path))
        planner.update(local.planner_data or {})
    return Metadata(
        state_dict_metadata={**others, **tensors}, planner_data=planner, storage_data=storage
    )


def _add_chunks(tensors: dict[str, Any], fqn: str, entry: Any) -> None:
    """Merge ``entry``'s chunks into ``tensors[fqn]`` (already checked by ``check_summaries``)."""
    held = tensors.get(fqn)
    if held is None:
        tensors[fqn] = dataclasses.replace(entry, chunks=list(entry.chunks))
        return
    seen = {(tuple(c.offsets), tuple(c.sizes)) for c in held.chunks}
    for chunk in entry.chunks:  # a replica's identical chunk is kept once
        if (tuple(chunk.offsets), tuple(chunk.sizes)) not in seen:
            held.chunks.append(chunk)


def _check_coverage(fqn: str, size: list[int], boxes: list[tuple[list[int], list[int]]]) -> None:
    """Every element of the tensor in exactly one chunk, or ``DcpError`` saying how."""
    total = math.prod(size)
    covered = 0
    for offsets, sizes in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise DcpError(
                f"tensor {fqn!r}: a chunk at {offsets} of {sizes} lies outside its size {size}"
            )
        covered += math.prod(sizes)
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + asz, bo + bsz)
                for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                raise DcpError(
                    f"tensor {fqn!r}: chunks at {a_off} and {b_off} overlap (two savers wrote "
                    "the same elements differently: is the shard label right?)"
                )
    if covered != total:
        raise DcpError(
            f"tensor {fqn!r}: the saved chunks cover {covered} of its {total} elements; not "
            "committed (a shard whose saver did not save, or ranks labelled as replicas that "
            "hold different parts)"
        )


def dcp_directory(group: str) -> str:
    """The directory, inside a step directory, that holds ``group``'s global metadata."""
    return DIR_PREFIX + file_safe(group)


MAX_SAFE_NAME = 120  # characters: "shard-<name>.pt" and its temporary name stay far below 255


def file_safe(name: str) -> str:
    """``name`` as one part of a file name: ``[A-Za-z0-9._-]`` kept, any other character "_",
    and then the CRC32 of ``name`` - so that two names differing only there ("actor ref",
    "actor_ref") never share a file or a directory. A name longer than ``MAX_SAFE_NAME`` (a
    200-character group and its shard label) keeps its first 100 characters and a SHA-256
    digest of the whole: a file system takes at most 255 bytes in a name, and a save that fails
    on "File name too long" fails at the eviction."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if safe != name or not safe:
        safe = f"{safe}-{zlib.crc32(name.encode()):08x}"
    if len(safe) > MAX_SAFE_NAME:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        safe = f"{safe[:100]}-{digest}"
    return safe
