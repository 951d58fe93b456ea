"""A warm restart's shard moved from the survivor that holds it to the spare that needs it.

A survivor whose training thread parked at the step holds its shard as a snapshot
(``late_copy.py``): no keeper has it before the group trains again. A spare that takes an
evicted replica's slot needs exactly that shard. Once the new group formed, the survivor sends
its snapshot over it - on GPUs, the interconnect's bandwidth, far above any keeper - and the
spare checks it is the step and the size the coordinator recorded before it loads it. A survivor
that dies while it sends makes the spare's receive fail: the warm restart fails, and its
members are ended as for any member that cannot load (``coordinator/warm_restarts.py``).

The tree (``memory/tree.py``) goes as its outline - the nesting, the step, each tensor's dtype,
shape and place in one buffer - as a small object, then each tensor's bytes as a tensor, received
straight into its place in that buffer (on NCCL, from and into GPU memory). Pickling the whole
tree instead (``send_object_list``) copied 64 MB three times and took 0.3 s on gloo. The sender
may send before its snapshot's background copy is done: until ``rejoin`` settles it, the
snapshot reads the live state, which has not moved.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from ..memory.tree import from_tree, leaves, map_leaves, tree_bytes
from ..protocol import LoadedFrom, Rendezvous, shard_key
from .late_copy import HeldShard

ALIGN = 64  # bytes: where each tensor starts in the flat buffer


def send(held: list[HeldShard], answer: Rendezvous) -> None:
    """Send this survivor's snapshot of ``answer.shard`` to every rank in ``answer.send_to``."""
    import torch
    import torch.distributed as dist

    key = shard_key(answer.group, answer.shard)
    snapshot = next((h.snapshot for h in held if h.record.shard == key), None)
    if snapshot is None:
        raise RuntimeError(f"asked to send shard {key!r}, which this survivor does not hold")
    parts = _Parts()
    # each leaf's bytes replaced by their place in the receiver's buffer
    outline = map_leaves(
        snapshot.value(),
        lambda leaf: dataclasses.replace(leaf, data=(parts.add(leaf.data), int(leaf.data.size))),
    )
    device = _device()
    with warnings.catch_warnings():  # read-only views of the snapshot in Ray's store
        warnings.simplefilter("ignore", UserWarning)
        # each tensor as it is: no copy into one buffer first (on NCCL, one to the GPU)
        tensors = [torch.from_numpy(a).to(device) for a in parts.arrays if a.size]
    for rank in answer.send_to:
        dist.send_object_list([(outline, parts.size)], dst=rank)
        for tensor in tensors:
            dist.send(tensor, dst=rank)


def receive(answer: Rendezvous, loader: Callable[[Any], Any]) -> LoadedFrom:
    """Receive shard ``answer.shard`` from rank ``answer.peer``; load it once it is proven to
    be step ``answer.step`` at the size the survivor held."""
    import torch
    import torch.distributed as dist

    key = shard_key(answer.group, answer.shard)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=answer.peer)
    outline, nbytes = box[0] if isinstance(box[0], tuple) else (box[0], -1)
    if not isinstance(outline, dict) or outline.get("step") != answer.step:
        step = outline.get("step") if isinstance(outline, dict) else type(outline).__name__
        raise RuntimeError(
            f"rank {answer.peer} sent shard {key!r} of step {step}, not {answer.step}"
        )
    places = [leaf.data for leaf in leaves(outline)]  # (start, size), in the order sent
    if not 0 <= nbytes <= answer.shard_bytes + ALIGN * len(places):  # with the padding
        raise RuntimeError(
            f"rank {answer.peer} announced shard {key!r} as {nbytes} bytes of tensors; the "
            f"survivor held {answer.shard_bytes} in all: not received"
        )
    flat = torch.empty(max(nbytes, 0), dtype=torch.uint8, device=_device())
    for start, size in places:
        if size:
            dist.recv(flat[start : start + size], src=answer.peer)
    received_bytes = flat.cpu().numpy()
    snapshot = map_leaves(  # each leaf a view of its place in the buffer: no copy
        outline,
        lambda leaf: dataclasses.replace(
            leaf, data=received_bytes[leaf.data[0] : leaf.data[0] + leaf.data[1]]
        ),
    )
    received = tree_bytes(snapshot)
    if received != answer.shard_bytes:
        raise RuntimeError(
            f"rank {answer.peer} sent shard {key!r} of {received} bytes; the survivor held "
            f"{answer.shard_bytes}: not loaded"
        )
    loader(from_tree(snapshot, copy=False)["state"])  # the buffer is this call's alone: no copy
    return LoadedFrom.GROUP_PEER


class _Parts:
    """The leaves' bytes in the order they are sent, and where each goes in the receiver's
    buffer: each start aligned, as an allocation would be."""

    def __init__(self) -> None:
        self.arrays: list[Any] = []
        self.size = 0

    def add(self, data: Any) -> int:
        start = -(-self.size // ALIGN) * ALIGN
        self.arrays.append(data)
        self.size = start + int(data.size)
        return start


def _device() -> Any:
    """Where the group's point-to-point calls take tensors: the current GPU on NCCL."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
