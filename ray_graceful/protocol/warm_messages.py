"""A warm restart's messages: the coordinator's ``Rendezvous`` to each member (join the new
group, or leave), and what the member did (``Rejoined``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..place import LoadedFrom
from .checks import PROTOCOL_VERSION
from .words import RejoinResult, RendezvousAction


def train_slot_member(group: str, rank: int) -> str:
    """The member id a warm restart gives the process Ray Train starts in an evicted rank's
    slot: it does not exist yet when the slot is handed out, so the slot is its name."""
    return f"ray-train:{group}/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    """A warm restart's answer to one member: "join" group ``group`` as ``rank`` of
    ``world_size`` through the store at ``store_host:store_port`` under ``prefix`` (one per
    cycle and group: a stale rank cannot join), then hold shard ``shard`` of step ``step`` -
    its own state if it can prove it is that step, else loaded (from the memory tier, disk, or
    a survivor that holds it: ``peer``); or "leave", with ``reason``."""

    action: RendezvousAction
    reason: str = ""
    cycle: int = 0
    group: str = ""
    rank: int = 0
    world_size: int = 0
    shard: str = ""
    step: int = -1
    store_host: str = ""
    store_port: int = 0
    prefix: str = ""
    timeout_s: float = 30.0
    was: str = ""  # "survivor of rank N" | "spare for rank N"
    # Its shard is held by a survivor, not yet in any keeper: received from rank ``peer`` of
    # the new group once it formed, ``shard_bytes`` long (``memory/tree.py``'s count)
    peer: int = -1
    shard_bytes: int = 0
    # A survivor holding a shard that spares need: it sends it to these ranks of the new group
    send_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", RendezvousAction(self.action))


@dataclass(frozen=True)
class Rejoined:
    """What one member of a warm restart did ("joined" or "left"), loaded from where ("own
    state", "memory-local", "memory-peer", "disk"), and its ``seconds``: ``rendezvous`` (the
    group formed), ``register`` (registered in the new cycle) and ``load``."""

    action: RejoinResult
    member: str = ""
    group: str = ""
    rank: int = -1
    world_size: int = 0
    step: int = -1
    cycle: int = 0
    was: str = ""
    loaded_from: LoadedFrom | None = None  # None: it left before loading
    reason: str = ""
    pid: int = 0
    node_id: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0  # when its rejoin began forming the group (time.time())
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", RejoinResult(self.action))
        if self.loaded_from is not None:
            object.__setattr__(self, "loaded_from", LoadedFrom(self.loaded_from))

    @property
    def joined(self) -> bool:
        return self.action == RejoinResult.JOINED
