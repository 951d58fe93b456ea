"""A warm restart's shard moved from the survivor that holds it to the spare that needs it.

A survivor whose training thread parked at the step holds its shard as a snapshot
(``late_copy.py``): no keeper has it before the group trains again. A spare that takes an
evicted replica's slot needs exactly that shard. Once the new group formed, the survivor sends
its snapshot over it - on GPUs, the interconnect's bandwidth, far above any keeper - and the
spare checks it is the step and the size the coordinator recorded before it loads it. A survivor
that dies while it sends makes the spare's receive fail: the warm restart fails, and its
members are ended as for any member that cannot load (``coordinator/warm_restarts.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..memory.tree import from_tree, tree_bytes
from ..protocol import LoadedFrom, Rendezvous, shard_key
from .late_copy import HeldShard


def send(held: list[HeldShard], answer: Rendezvous) -> None:
    """Send this survivor's snapshot of ``answer.shard`` to every rank in ``answer.send_to``."""
    import torch.distributed as dist

    key = shard_key(answer.group, answer.shard)
    snapshot = next((h.snapshot for h in held if h.record.shard == key), None)
    if snapshot is None:
        raise RuntimeError(f"asked to send shard {key!r}, which this survivor does not hold")
    tree = snapshot.value()
    for rank in answer.send_to:
        dist.send_object_list([tree], dst=rank)


def receive(answer: Rendezvous, loader: Callable[[Any], Any]) -> LoadedFrom:
    """Receive shard ``answer.shard`` from rank ``answer.peer``; load it once it is proven to
    be step ``answer.step`` at the size the survivor held."""
    import torch.distributed as dist

    key = shard_key(answer.group, answer.shard)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=answer.peer)
    snapshot = box[0]
    if not isinstance(snapshot, dict) or snapshot.get("step") != answer.step:
        step = snapshot.get("step") if isinstance(snapshot, dict) else type(snapshot).__name__
        raise RuntimeError(
            f"rank {answer.peer} sent shard {key!r} of step {step}, not {answer.step}"
        )
    nbytes = tree_bytes(snapshot)
    if nbytes != answer.shard_bytes:
        raise RuntimeError(
            f"rank {answer.peer} sent shard {key!r} of {nbytes} bytes; the survivor held "
            f"{answer.shard_bytes}: not loaded"
        )
    loader(from_tree(snapshot)["state"])
    return LoadedFrom.GROUP_PEER
