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

import dataclasses
import math
import os
import pickle
from collections.abc import Callable, Iterable
from typing import Any


class DcpError(ValueError):
    """The savers' DCP chunks do not make one checkpoint; the message names the tensor."""


LOCAL_METADATA = "__0.metadata"  # what dcp.save(no_dist=True, use_collectives=False) writes
GLOBAL_METADATA = ".metadata"  # what dcp.load reads
DIR_PREFIX = "dcp-"


def dcp_saver(state_dict: Callable[[], dict[str, Any]]) -> Callable[[str, int], None]:
    """A saver for ``graceful_setup(saver=...)``: this rank's state in DCP's on-disk format.

    ``state_dict()`` returns what ``dcp.save`` takes (an FSDP2 / DTensor model's state dict,
    optimizer state, plain values). Only this rank's local chunks are written, with no
    collective; the coordinator assembles the global metadata at commit.
    """
    if not callable(state_dict):
        raise TypeError(f"dcp_saver(state_dict={state_dict!r}): give a callable")

    def save(path: str, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        os.makedirs(path)
        dcp.save(
            state_dict(),
            storage_writer=dcp.FileSystemWriter(path, sync_files=True),
            no_dist=True,
            use_collectives=False,
        )

    save.__qualname__ = "dcp_saver.save"
    return save


def is_dcp_shard(path: str) -> bool:
    """Whether a saved shard is a DCP saver's directory."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, LOCAL_METADATA))


def assemble(step_directory: str, shards: dict[str, Iterable[str]]) -> dict[str, str]:
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
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(directory, os.O_RDONLY)  # the rename, durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        out[group] = relative
    return out


def merge(step_directory: str, shard_dirs: list[str]) -> Any:
    """One ``Metadata`` from the savers' own, their files named relative to ``dcp-<group>/``."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for name in shard_dirs:
        with open(os.path.join(step_directory, name, LOCAL_METADATA), "rb") as f:
            local = pickle.load(f)
        for fqn, entry in local.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                _add_chunks(tensors, fqn, entry, name)
            else:
                others.setdefault(fqn, entry)
        for index, info in local.storage_data.items():
            path = f"../{name}/{info.relative_path}"
            storage.setdefault(index, dataclasses.replace(info, relative_path=path))
        planner.update(local.planner_data or {})
    for fqn, entry in tensors.items():
        _check_coverage(fqn, entry)
    return Metadata(
        state_dict_metadata={**others, **tensors}, planner_data=planner, storage_data=storage
    )


def _add_chunks(tensors: dict[str, Any], fqn: str, entry: Any, source: str) -> None:
    held = tensors.get(fqn)
    if held is None:
        tensors[fqn] = dataclasses.replace(entry, chunks=list(entry.chunks))
        return
    if held.size != entry.size or held.properties.dtype != entry.properties.dtype:
        raise DcpError(
            f"tensor {fqn!r}: {source} saved it as {list(entry.size)} {entry.properties.dtype}, "
            f"another saver as {list(held.size)} {held.properties.dtype}"
        )
    seen = {(tuple(c.offsets), tuple(c.sizes)) for c in held.chunks}
    for chunk in entry.chunks:  # a replica's identical chunk is kept once
        if (tuple(chunk.offsets), tuple(chunk.sizes)) not in seen:
            held.chunks.append(chunk)


def _check_coverage(fqn: str, entry: Any) -> None:
    """Every element of the tensor in exactly one chunk, or ``DcpError`` saying how."""
    size = list(entry.size)
    total = math.prod(size)
    covered = 0
    boxes = []
    for chunk in entry.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise DcpError(
                f"tensor {fqn!r}: a chunk at {offsets} of {sizes} lies outside its size {size}"
            )
        boxes.append((offsets, sizes))
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
    return DIR_PREFIX + "".join(c if c.isalnum() or c in "._-" else "_" for c in group)
